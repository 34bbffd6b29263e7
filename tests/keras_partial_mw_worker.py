"""One task of a Keras ``fit`` with partial batches across processes (run by
tests/test_keras_partial_batches.py).

Process p feeds its own rows of every global batch of 32: 16 each, except the last batch, where
process 0 has 4 rows and process 1 has 2 (70 rows in all), so the processes pad different row
counts and the global mask is not a prefix.
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import jaxdist  # noqa: E402

SPLIT = {0: [16, 16, 4], 1: [16, 16, 2]}  # rows of each global batch, per process


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(70, 5)).astype("float32")
    y = (x @ np.array([1.0, -2.0, 0.5, 1.5, -1.0], "float32") > 0).astype("int32")
    return x, y


def shard(a, index):
    """Process ``index``'s rows: the global batches are [p0 rows, p1 rows] in turn."""
    out, start = [], 0
    for b in range(len(SPLIT[0])):
        rows = [SPLIT[p][b] for p in (0, 1)]
        out.append(a[start + sum(rows[:index]):start + sum(rows[:index + 1])])
        start += sum(rows)
    return np.concatenate(out)


def model():
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                          keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    m.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


def main(out):
    strategy = jaxdist.MultiWorkerMirroredStrategy()
    i = jax.process_index()
    x, y = data()
    with strategy.scope():
        m = model()
        hist = m.fit(shard(x, i), shard(y, i), batch_size=16, epochs=2, shuffle=False,
                     verbose=0).history
        ev = m.evaluate(shard(x, i), shard(y, i), batch_size=16, verbose=0, return_dict=True)
    result = {"history": {k: [float(v) for v in vs] for k, vs in hist.items()},
              "eval": {k: float(v) for k, v in ev.items()},
              "weights": [np.asarray(w).tolist() for w in m.get_weights()],
              "processes": jax.process_count(), "replicas": strategy.num_replicas_in_sync}
    with open(f"{out}.{i}.json", "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
