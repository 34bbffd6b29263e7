"""TensorFlow's "Distributed training with Keras" tutorial: ``model.fit`` under MirroredStrategy.

Source: github tensorflow/docs, site/en/tutorials/distribute/keras.ipynb (MNIST from TFDS,
``BATCH_SIZE = 64 * strategy.num_replicas_in_sync``, ``map(scale).cache().shuffle(10000)
.batch(BATCH_SIZE)``, a Conv2D(32) / MaxPooling / Dense(64) / Dense(10) model compiled under
``strategy.scope()`` with Adam and ``SparseCategoricalCrossentropy(from_logits=True)``;
callbacks TensorBoard, ModelCheckpoint(save_weights_only), LearningRateScheduler(decay),
PrintLR; ``fit(train_dataset, epochs=12)``, the latest checkpoint loaded and evaluated, the
model saved and loaded again without and with the strategy's scope). Written anew after the
tutorial: same model, input pipeline, callbacks and calls.

Edits beyond API renames:
- data: scikit-learn digits enlarged to 28x28 (``_data.digits_as_mnist``) instead of TFDS
  MNIST; 352 train rows (256 + 96: MNIST's 60000 leave a last batch of 96 at 4 x 64) and 272
  eval rows (256 + 16, as 10000); ``jaxdist.Dataset`` stands in for ``tf.data`` (same
  ``map`` / ``shuffle(10000)`` / ``batch`` chain; the shuffle is seeded).
- the global batch is 64 x 4 in every run (the tutorial multiplies by the replica count), so
  the 1-device run sees the same global batches as the 4-replica one.
- 4 epochs instead of 12 (the decay schedule still changes the rate after epoch 3).
- Keras 3 names: checkpoints ``ckpt_{epoch}.weights.h5``, ``model.optimizer.learning_rate``,
  ``model.save("model.keras")`` instead of a TF SavedModel; ``jaxdist.keras.TensorBoard``
  instead of Keras's (which needs TensorFlow); files go to a temporary directory.
- PrintLR records the rates instead of printing them; results are returned.
- the model loaded without the strategy's scope is compiled and evaluated inside the default
  strategy's scope (``jaxdist.get_strategy().scope()``): outside every jaxdist scope a Keras
  model is plain Keras, which reads no ``jaxdist.Dataset`` (TF's default strategy, implicit
  there, takes ``tf.data``).
"""

from __future__ import annotations

import glob
import os
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import jaxdist  # noqa: E402
import jaxdist.keras  # noqa: E402

from ._data import digits_as_mnist  # noqa: E402

BUFFER_SIZE = 10000
BATCH_SIZE_PER_REPLICA = 64
REPLICAS = 4            # the tutorial uses strategy.num_replicas_in_sync
BATCH_SIZE = BATCH_SIZE_PER_REPLICA * REPLICAS
EPOCHS = 4              # 12 in the tutorial
TRAIN_ROWS, EVAL_ROWS = 352, 272


def scale(image, label):
    return image.astype(np.float32) / 255, label


def decay(epoch):
    if epoch < 3:
        return 1e-3
    elif epoch >= 3 and epoch < 7:
        return 1e-4
    else:
        return 1e-5


def make_model():
    model = keras.Sequential([
        keras.Input(shape=(28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=keras.optimizers.Adam(), metrics=["accuracy"])
    return model


def main(strategy: jaxdist.Strategy | None = None) -> dict:
    strategy = strategy or jaxdist.get_strategy()
    x, y = digits_as_mnist(TRAIN_ROWS + EVAL_ROWS)
    x = x[..., None]
    mnist_train = jaxdist.Dataset.from_tensor_slices((x[:TRAIN_ROWS], y[:TRAIN_ROWS]))
    mnist_test = jaxdist.Dataset.from_tensor_slices((x[TRAIN_ROWS:], y[TRAIN_ROWS:]))
    train_dataset = mnist_train.map(scale).shuffle(BUFFER_SIZE, seed=0).batch(BATCH_SIZE)
    eval_dataset = mnist_test.map(scale).batch(BATCH_SIZE)

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = make_model()

    rates = []

    class PrintLR(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            rates.append(float(model.optimizer.learning_rate))

    with tempfile.TemporaryDirectory() as workdir:
        checkpoint_dir = os.path.join(workdir, "training_checkpoints")
        checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch}.weights.h5")
        callbacks = [
            jaxdist.keras.TensorBoard(log_dir=os.path.join(workdir, "logs")),
            keras.callbacks.ModelCheckpoint(filepath=checkpoint_prefix, save_weights_only=True),
            keras.callbacks.LearningRateScheduler(decay),
            PrintLR(),
        ]
        history = model.fit(train_dataset, epochs=EPOCHS, callbacks=callbacks, verbose=0)

        latest = max(glob.glob(os.path.join(checkpoint_dir, "ckpt_*.weights.h5")),
                     key=lambda f: int(os.path.basename(f)[5:-11]))  # the last epoch's
        model.load_weights(latest)
        eval_loss, eval_acc = model.evaluate(eval_dataset, verbose=0)

        path = os.path.join(workdir, "saved_model", "model.keras")
        os.makedirs(os.path.dirname(path))
        model.save(path)
        with jaxdist.get_strategy().scope():  # the default strategy reads a jaxdist.Dataset
            unreplicated_model = keras.models.load_model(path)
            unreplicated_model.compile(
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                optimizer=keras.optimizers.Adam(), metrics=["accuracy"])
            unreplicated = unreplicated_model.evaluate(eval_dataset, verbose=0)
        with strategy.scope():
            replicated_model = keras.models.load_model(path)
            replicated_model.compile(
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                optimizer=keras.optimizers.Adam(), metrics=["accuracy"])
            replicated = replicated_model.evaluate(eval_dataset, verbose=0)
    return {"history": history.history, "rates": rates, "eval": [eval_loss, eval_acc],
            "unreplicated_eval": unreplicated, "replicated_eval": replicated,
            "weights": [np.asarray(w) for w in model.get_weights()]}
