"""A Keras ``fit`` under a jaxdist strategy with ``jaxdist.keras.BackupAndRestore``
(tests/test_preemption_keras.py): MultiWorkerMirrored when ``TF_CONFIG`` is set, else
Mirrored over the local devices.

Usage: ``python keras_preempt_worker.py OUT WORKDIR EPOCHS SLEEP_MS``; each batch's end is
printed (``batch <epoch> <batch>``) so a test can send SIGTERM mid-epoch; ``SLEEP_MS`` slows
the batches down without changing what they compute.
"""

import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import keras_seed  # noqa: E402  (tests/: the script's directory)
import numpy as np  # noqa: E402

import jaxdist  # noqa: E402

GLOBAL_BATCH = 8


def data():
    x = np.random.default_rng(0).normal(size=(256, 5)).astype("float32")
    y = (x @ np.arange(1, 6, dtype="float32")[:, None] / 5).astype("float32")
    return x, y


class _Progress(keras.callbacks.Callback):
    def __init__(self, sleep_ms: float):
        super().__init__()
        self.sleep = sleep_ms / 1000
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        print(f"batch {self.epoch} {batch}", flush=True)
        time.sleep(self.sleep)


def main(out, workdir, epochs, sleep_ms):
    import jaxdist.keras as jk

    strategy = (jaxdist.MultiWorkerMirroredStrategy() if os.environ.get("TF_CONFIG")
                else jaxdist.MirroredStrategy())
    x, y = data()
    callbacks = [jk.BackupAndRestore(os.path.join(workdir, "backup"), delete_checkpoint=False),
                 _Progress(sleep_ms)]
    with strategy.scope():
        keras_seed.set_random_seed(0)
        m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        m.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0,
              callbacks=callbacks)
    with open(f"{out}.{jax.process_index()}.json", "w") as f:
        json.dump([np.asarray(w).tolist() for w in m.get_weights()], f)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))
