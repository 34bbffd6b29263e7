"""TensorFlow's "Multi-worker training with Keras" tutorial: MultiWorkerMirroredStrategy + fit.

Source: github tensorflow/docs, site/en/tutorials/distribute/multi_worker_with_keras.ipynb
(``mnist_setup.py``: MNIST scaled to [0, 1], ``shuffle(60000).repeat().batch(batch_size)``,
Input(28, 28) / Reshape / Conv2D(32, 3) / Flatten / Dense(128) / Dense(10), SGD(0.001),
``SparseCategoricalCrossentropy(from_logits=True)``, accuracy; ``main.py``:
``per_worker_batch_size = 64``, the worker count read from ``TF_CONFIG``,
``global_batch_size = 64 * num_workers``, the model built under ``strategy.scope()``,
``fit(epochs=3, steps_per_epoch=70)``; the fault-tolerance section's ``BackupAndRestore``).
Written anew after the tutorial: same model, compile and fit.

Run as each worker of a cluster: ``python -m jaxdist.launch --workers 2 --devices-per-process 2
-- python -m programs.tf_multi_worker_with_keras OUT WORKDIR`` (from ``tests/``).

The input is the tutorial's ``tf.data`` pipeline: every worker builds the whole of it with the
global batch size, and ``fit`` gives each worker its rows of every global batch (TF's
``AutoShardPolicy`` ``AUTO`` on in-memory data: by data), 64 per worker per step.

Edits beyond API renames:
- data: scikit-learn digits enlarged to 28x28 (``_data.digits_as_mnist``), 384 rows =
  3 steps x 128, instead of ``keras.datasets.mnist``; ``shuffle(384)`` for ``shuffle(60000)``.
- 2 epochs of 3 steps instead of 3 of 70.
- ``jaxdist.keras.BackupAndRestore`` (writes from the chief only) for Keras's.
- ``keras.utils.set_random_seed(0)`` first (it seeds TF too, so every worker's unseeded
  ``shuffle`` draws the same order, and the one-device reference run's); the model saving and
  reloading sections are left out; results are returned (and written as JSON per worker).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import jaxdist  # noqa: E402
import jaxdist.keras  # noqa: E402

from ._data import digits_as_mnist  # noqa: E402

PER_WORKER_BATCH_SIZE = 64
EPOCHS, STEPS_PER_EPOCH = 2, 3      # 3 and 70 in the tutorial


def mnist_dataset(batch_size: int):
    import tensorflow as tf

    rows = STEPS_PER_EPOCH * batch_size
    x_train, y_train = digits_as_mnist(rows)
    x_train = x_train / np.float32(255)
    y_train = y_train.astype(np.int64)
    train_dataset = tf.data.Dataset.from_tensor_slices(
        (x_train, y_train)).shuffle(rows).repeat().batch(batch_size)
    return train_dataset


def build_and_compile_cnn_model():
    model = keras.Sequential([
        keras.Input(shape=(28, 28)),
        keras.layers.Reshape(target_shape=(28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.SGD(learning_rate=0.001),
                  metrics=["accuracy"])
    return model


def main(strategy: jaxdist.Strategy | None = None, num_workers: int | None = None,
         workdir: str | None = None) -> dict:
    """One worker's job; ``num_workers`` (default: ``TF_CONFIG``'s worker count) fixes the
    global batch, so a 1-device run can be given the cluster's global batches."""
    strategy = strategy or jaxdist.get_strategy()
    if num_workers is None:
        tf_config = json.loads(os.environ["TF_CONFIG"])
        num_workers = len(tf_config["cluster"]["worker"])
    global_batch_size = PER_WORKER_BATCH_SIZE * num_workers
    keras.utils.set_random_seed(0)
    multi_worker_dataset = mnist_dataset(global_batch_size)

    with strategy.scope():
        multi_worker_model = build_and_compile_cnn_model()
    callbacks = []
    if workdir is not None:
        callbacks.append(jaxdist.keras.BackupAndRestore(os.path.join(workdir, "backup")))
    history = multi_worker_model.fit(multi_worker_dataset, epochs=EPOCHS,
                                     steps_per_epoch=STEPS_PER_EPOCH, callbacks=callbacks,
                                     verbose=0)
    return {"history": history.history,
            "weights": [np.asarray(w) for w in multi_worker_model.get_weights()]}


if __name__ == "__main__":
    out, workdir = sys.argv[1], sys.argv[2]
    strategy = jaxdist.MultiWorkerMirroredStrategy()
    result = main(strategy, workdir=workdir)
    result["replicas"] = strategy.num_replicas_in_sync
    with open(f"{out}.{jax.process_index()}.json", "w") as f:
        json.dump(jax.tree.map(lambda a: np.asarray(a).tolist(), result), f)
    print("done", jax.process_index(), flush=True)
