"""One task of a Keras ``fit`` under MultiWorkerMirroredStrategy (tests/internal/test_keras_mw.py).

Every process runs the same program on the whole data with the global batch size, as in TF's
multi-worker Keras tutorial; ``fit`` shards it (``AutoShardPolicy.DATA``: process p keeps rows
[p*B/n, (p+1)*B/n) of every global batch of B).
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import keras_seed  # noqa: E402  (tests/: the script's directory)
import numpy as np  # noqa: E402

import jaxdist  # noqa: E402

GLOBAL_BATCH = 8


def data():
    x = np.random.default_rng(0).normal(size=(32, 5)).astype("float32")
    y = (x @ np.arange(1, 6, dtype="float32")[:, None] / 5).astype("float32")
    return x, y


def model():
    keras_seed.set_random_seed(0)
    m = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )
    m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    return m


class _KillAfter(keras.callbacks.Callback):
    """Ends the process abruptly at the end of an epoch (a preempted job)."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            os._exit(17)


def main(out, workdir, epochs, kill_after):
    import jaxdist.keras as jk

    strategy = jaxdist.MultiWorkerMirroredStrategy()
    n, i = jax.process_count(), jax.process_index()
    x, y = data()
    callbacks = [
        jk.BackupAndRestore(os.path.join(workdir, "backup")),
        jk.ModelCheckpoint(os.path.join(workdir, "ckpt", "e{epoch}.weights.h5"),
                           save_weights_only=True),
        jk.TensorBoard(os.path.join(workdir, "logs")),
    ]
    if kill_after >= 0:
        callbacks.append(_KillAfter(kill_after))
    with strategy.scope():
        m = model()
        hist = m.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=callbacks).history
    result = {"history": {k: [float(v) for v in vs] for k, vs in hist.items()},
              "weights": [np.asarray(w).tolist() for w in m.get_weights()],
              "replicas": strategy.num_replicas_in_sync, "processes": n}
    with open(f"{out}.{i}.json", "w") as f:
        json.dump(result, f)
    print("done", i, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
