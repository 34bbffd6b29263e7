"""One task of TF's "Multi-worker training with Keras" shape
(tests/test_keras_multi_worker_input.py): ``per_worker_batch_size * num_workers`` global
batch, ``MultiWorkerMirroredStrategy``, the model built and compiled under
``strategy.scope()``, ``model.fit`` outside it, on every input kind
Keras takes. Every process runs the same program on the same input.

The model's first layer (``Fingerprint``) records, in every training step, the ids of the rows
the step trains on (column 0 of ``x``, dropped before the ``Dense`` layers) on each device, with
the step number (a counter variable of the layer), through ``jax.debug.callback(...,
partitioned=True)``: what each process really trains on, not what some reader yields.
"""

import json
import os
import sys
from collections import defaultdict

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import jaxdist  # noqa: E402

PER_WORKER_BATCH_SIZE = 64
STEPS_PER_EPOCH, EPOCHS = 3, 2
# Runs whose global batches are those of one process with the same global batch size.
SAME_AS_ONE_PROCESS = ("tfdata", "tfdata_data", "arrays", "generator", "pydataset", "dataset")
RUNS = SAME_AS_ONE_PROCESS + ("pydataset_shuffled", "tfdata_off", "tfdata_file",
                              "make_or_restore")
FILES = 4

_RECORD: dict[int, list[int]] = defaultdict(list)


def _record(step, ids):
    _RECORD[int(np.asarray(step))].extend(int(i) for i in np.asarray(ids))


class Fingerprint(keras.layers.Layer):
    """Records the row ids (column 0) each training step sees and drops that column."""

    def build(self, input_shape):
        self.step = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                    dtype="int32", name="step")

    def call(self, x, training=None):
        if training:
            jax.debug.callback(_record, self.step.value, x[:, 0], partitioned=True)
            self.step.assign(self.step + 1)
        return x[:, 1:]

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[1] - 1)


def data(global_batch):
    rows = STEPS_PER_EPOCH * global_batch
    rng = np.random.default_rng(0)
    features = rng.normal(size=(rows, 5)).astype("float32")
    ids = np.arange(rows, dtype="float32")[:, None]
    y = (features @ np.arange(1, 6, dtype="float32")[:, None] / 5).astype("float32")
    return np.concatenate([ids, features], axis=1), y


def build_and_compile_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), Fingerprint(),
                              keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    return model


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch):
        super().__init__()
        self.x, self.y, self.batch = x, y, batch

    def __len__(self):
        return len(self.x) // self.batch

    def __getitem__(self, i):
        s = slice(i * self.batch, (i + 1) * self.batch)
        return self.x[s], self.y[s]


def _generator(x, y, batch):
    while True:
        for i in range(0, len(x), batch):
            yield x[i:i + batch], y[i:i + batch]


def write_files(x, y, directory):
    """The rows as ``FILES`` TFRecord files of consecutive rows (a serialized float vector
    ``[x..., y]`` per record)."""
    import tensorflow as tf

    os.makedirs(directory, exist_ok=True)
    paths, per = [], len(x) // FILES
    for f in range(FILES):
        paths.append(os.path.join(directory, f"part-{f}.tfrecord"))
        with tf.io.TFRecordWriter(paths[-1]) as writer:
            for r in range(f * per, (f + 1) * per):
                row = np.concatenate([x[r], y[r]]).astype("float32")
                writer.write(tf.io.serialize_tensor(row).numpy())
    return paths


def fit_kwargs(name, x, y, global_batch, index=0, count=1, workdir=None):
    """``fit``'s arguments for one run (the tutorial's ``fit(dataset, epochs,
    steps_per_epoch)`` with each input kind)."""
    fit = dict(epochs=EPOCHS, verbose=0)
    if name.startswith("tfdata"):
        import tensorflow as tf

        ds = tf.data.Dataset.from_tensor_slices((x, y))
        if name == "tfdata":       # the tutorial's pipeline, its shuffle seeded
            ds = ds.shuffle(len(x), seed=7).repeat().batch(global_batch)
            return dict(fit, x=ds, steps_per_epoch=STEPS_PER_EPOCH)
        options = tf.data.Options()
        if name == "tfdata_file":  # each worker reads its files (TF's FILE sharding)
            options.experimental_distribute.auto_shard_policy = (
                tf.data.experimental.AutoShardPolicy.FILE)
            files = write_files(x, y, os.path.join(workdir, f"files-{index}"))

            def parse(record):
                row = tf.io.parse_tensor(record, tf.float32)
                return row[:-1], row[-1:]

            ds = tf.data.TFRecordDataset(files).map(parse).batch(global_batch)
            return dict(fit, x=ds.with_options(options))
        if name == "tfdata_data":
            options.experimental_distribute.auto_shard_policy = (
                tf.data.experimental.AutoShardPolicy.DATA)
            return dict(fit, x=ds.batch(global_batch).with_options(options))
        # OFF: each worker already reads its own rows; the batch stays the global batch
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.OFF)
        return dict(fit, x=ds.shard(count, index).batch(global_batch).with_options(options))
    if name == "arrays":
        return dict(fit, x=x, y=y, batch_size=global_batch, shuffle=False)
    if name == "generator":
        return dict(fit, x=_generator(x, y, global_batch), steps_per_epoch=STEPS_PER_EPOCH)
    if name == "pydataset":
        return dict(fit, x=Batches(x, y, global_batch), shuffle=False)
    if name == "pydataset_shuffled":
        return dict(fit, x=Batches(x, y, global_batch), shuffle=True)
    if name == "dataset":
        return dict(fit, x=jaxdist.Dataset.from_tensor_slices((x, y)).batch(global_batch))
    raise ValueError(name)


def make_or_restore_model(checkpoint_dir):
    """TF's multi-worker tutorial / keras-io: the latest checkpoint, else a new model."""
    checkpoints = [os.path.join(checkpoint_dir, name) for name in os.listdir(checkpoint_dir)]
    if checkpoints:
        latest_checkpoint = max(checkpoints, key=os.path.getctime)
        return keras.models.load_model(latest_checkpoint,
                                       custom_objects={"Fingerprint": Fingerprint})
    return build_and_compile_model()


def _make_or_restore(strategy, x, y, global_batch, checkpoint_dir):
    """The ``arrays`` run as two jobs: 1 epoch checkpointed by the chief, then a job that
    restores it inside the scope and fits the second epoch."""
    from jax.experimental import multihost_utils

    import jaxdist.keras

    os.makedirs(checkpoint_dir, exist_ok=True)
    for epoch in range(EPOCHS):
        with strategy.scope():
            model = make_or_restore_model(checkpoint_dir)
        callbacks = [jaxdist.keras.ModelCheckpoint(
            os.path.join(checkpoint_dir, "ckpt-{epoch}.keras"))]
        model.fit(x, y, batch_size=global_batch, epochs=epoch + 1, initial_epoch=epoch,
                  shuffle=False, verbose=0, callbacks=callbacks)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"checkpoint {epoch} written")
    return model


def run(name, strategy, global_batch, index=0, count=1, workdir=None):
    """One fit: ``{"steps": {step: sorted row ids this process trained on}, "weights"}``."""
    x, y = data(global_batch)
    _RECORD.clear()
    if name == "make_or_restore":
        model = _make_or_restore(strategy, x, y, global_batch, os.path.join(workdir, "ckpt"))
    else:
        with strategy.scope():
            model = build_and_compile_model()
        model.fit(**fit_kwargs(name, x, y, global_batch, index, count, workdir))
    jax.effects_barrier()
    out = {"steps": {str(k): sorted(v) for k, v in sorted(_RECORD.items())},
           "weights": [np.asarray(w).tolist() for w in model.get_weights()],
           "optimizer": [np.asarray(v).tolist() for v in model.optimizer.variables]}
    if name == "tfdata":  # evaluate and predict on the tutorial's input kind too
        import tensorflow as tf

        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
        out["evaluate"] = model.evaluate(ds, verbose=0)
        out["predict"] = np.asarray(model.predict(ds.map(lambda a, b: a), verbose=0)).tolist()
        # 70 rows in batches of 32: the last has 6 (3 a process, padded to its 2 replicas)
        uneven = tf.data.Dataset.from_tensor_slices(x[:70]).batch(32)
        out["predict_uneven"] = np.asarray(model.predict(uneven, verbose=0)).tolist()
        out["predict_arrays"] = np.asarray(model.predict(x[:70], batch_size=32,
                                                         verbose=0)).tolist()
    return out


def main(out, runs):
    strategy = jaxdist.MultiWorkerMirroredStrategy()
    n, i = jax.process_count(), jax.process_index()
    result = {"processes": n, "replicas": strategy.num_replicas_in_sync}
    for name in runs:
        result[name] = run(name, strategy, PER_WORKER_BATCH_SIZE * n, i, n, out + ".work")
    with open(f"{out}.{i}.json", "w") as f:
        json.dump(result, f)
    print("done", i, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else RUNS))
