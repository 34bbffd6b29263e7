"""One task of Keras ``fit`` / ``evaluate`` across processes (run by
tests/internal/test_keras_partial_batches.py and tests/internal/test_keras_input.py).

Every run is one program, the same on every process, as a TF multi-worker Keras program is:

* ``arrays``: ``fit(x, y, batch_size=32)`` on the whole 70 rows; each process keeps its rows of
  every global batch of 32 (``AutoShardPolicy.DATA``), the last global batch has 6 rows (3 per
  process), so the global batches are one device's.
* ``dataset``: the same with a seeded, shuffled ``jaxdist.Dataset`` of global batches of 32.
* ``tfdata``: the same with a ``tf.data.Dataset`` (when TensorFlow is installed).
* ``off``: ``AutoShardPolicy.OFF``: each process feeds the rows it reads itself (a
  ``jaxdist.Dataset`` of its own shard, batches of 16): 16 each, except the last global batch,
  where process 0 has 4 rows and process 1 has 2, so the processes pad different row counts
  and the global mask is not a prefix.
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import jaxdist  # noqa: E402

SPLIT = {0: [16, 16, 4], 1: [16, 16, 2]}  # rows of each global batch, per process (OFF run)
RUNS = ("arrays", "dataset", "tfdata", "off")


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(70, 5)).astype("float32")
    y = (x @ np.array([1.0, -2.0, 0.5, 1.5, -1.0], "float32") > 0).astype("int32")
    return x, y


def dataset(x, y):
    """The shuffled pipeline of the ``dataset`` run (global batches of 32)."""
    return jaxdist.Dataset.from_tensor_slices((x, y)).shuffle(70, seed=5).batch(32)


def shard(a, index):
    """Process ``index``'s rows: the global batches are [p0 rows, p1 rows] in turn."""
    out, start = [], 0
    for b in range(len(SPLIT[0])):
        rows = [SPLIT[p][b] for p in (0, 1)]
        out.append(a[start + sum(rows[:index]):start + sum(rows[:index + 1])])
        start += sum(rows)
    return np.concatenate(out)


class Rows(keras.metrics.Metric):
    """The number of real rows seen: the mean loss of a global batch fed twice (each process
    feeding all of it) is the mean of one, this count is twice as large."""

    def __init__(self, name="rows", **kwargs):
        super().__init__(name=name, **kwargs)
        self.n = self.add_variable(shape=(), initializer="zeros", name="n")

    def update_state(self, y_true, y_pred, sample_weight=None):
        ops = keras.ops
        w = (ops.ones((ops.shape(y_true)[0],)) if sample_weight is None
             else ops.reshape(sample_weight, (-1,)))
        self.n.assign_add(ops.sum(ops.cast(w, "float32")))

    def result(self):
        return keras.ops.cast(self.n, "float32")

    def reset_state(self):
        self.n.assign(0.0)


def model():
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                          keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    m.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy", Rows()],
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


def run(name, strategy, x, y, i):
    with strategy.scope():
        m = model()
    if name == "arrays":
        fit = dict(x=x, y=y, batch_size=32, shuffle=False)
        ev = dict(x=x, y=y, batch_size=32)
    elif name == "dataset":
        fit = dict(x=dataset(x, y))
        ev = dict(x=jaxdist.Dataset.from_tensor_slices((x, y)).batch(32))
    elif name == "tfdata":
        import tensorflow as tf

        fit = dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(32))
        ev = dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(32))
    else:
        options = jaxdist.data.Options()
        options.experimental_distribute.auto_shard_policy = jaxdist.AutoShardPolicy.OFF
        mine = jaxdist.Dataset.from_tensor_slices((shard(x, i), shard(y, i)))
        fit = dict(x=mine.batch(16).with_options(options))
        ev = dict(x=mine.batch(16).with_options(options))
    hist = m.fit(epochs=2, verbose=0, **fit).history
    evaluated = m.evaluate(verbose=0, return_dict=True, **ev)
    return {"history": {k: [float(v) for v in vs] for k, vs in hist.items()},
            "eval": {k: float(v) for k, v in evaluated.items()},
            "weights": [np.asarray(w).tolist() for w in m.get_weights()]}


def main(out, runs):
    strategy = jaxdist.MultiWorkerMirroredStrategy()
    i = jax.process_index()
    x, y = data()
    result = {"processes": jax.process_count(), "replicas": strategy.num_replicas_in_sync}
    for name in runs:
        result[name] = run(name, strategy, x, y, i)
    with open(f"{out}.{i}.json", "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else RUNS))
