"""keras-io "Simple MNIST convnet": Conv2D/MaxPooling x2, Dropout, softmax; Adam.

Source: github keras-team/keras-io, examples/vision/mnist_convnet.py (fchollet; batch 128,
``validation_split=0.1``, categorical cross-entropy on one-hot labels, ``evaluate`` on the
test set). Written anew after the example: same model, compile, fit and evaluate calls.

Edits beyond API renames:
- data: scikit-learn digits enlarged to 28x28 (``_data.digits_as_mnist``) instead of
  ``keras.datasets.mnist``; 1120 train rows (``validation_split=0.1`` leaves 1008 = 7 x 128 +
  112 to train on and 112 to validate, the remainders MNIST's 54000 / 6000 leave) and 208
  test rows (6 x 32 + 16, as 10000 at evaluate's default batch of 32).
- 1 epoch instead of 15; ``keras.utils.set_random_seed(0)`` before building the model.
- the model is built and compiled under ``strategy.scope()``.
- no ``model.summary()`` or prints; the history, test score and weights are returned.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import layers  # noqa: E402

import jaxdist  # noqa: E402

from ._data import digits_as_mnist  # noqa: E402

NUM_CLASSES = 10
INPUT_SHAPE = (28, 28, 1)
BATCH_SIZE = 128
EPOCHS = 1              # 15 in the original
TRAIN_ROWS, TEST_ROWS = 1120, 208


def load_data():
    x_train, y_train = digits_as_mnist(TRAIN_ROWS)
    x_test, y_test = digits_as_mnist(TEST_ROWS, offset=TRAIN_ROWS)
    x_train = np.expand_dims(x_train.astype("float32") / 255, -1)
    x_test = np.expand_dims(x_test.astype("float32") / 255, -1)
    y_train = keras.utils.to_categorical(y_train, NUM_CLASSES)
    y_test = keras.utils.to_categorical(y_test, NUM_CLASSES)
    return (x_train, y_train), (x_test, y_test)


def build_model():
    return keras.Sequential([
        keras.Input(shape=INPUT_SHAPE),
        layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Flatten(),
        layers.Dropout(0.5),
        layers.Dense(NUM_CLASSES, activation="softmax"),
    ])


def main(strategy: jaxdist.Strategy | None = None) -> dict:
    strategy = strategy or jaxdist.get_strategy()
    (x_train, y_train), (x_test, y_test) = load_data()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model()
        model.compile(loss="categorical_crossentropy", optimizer="adam",
                      metrics=["accuracy"])
    history = model.fit(x_train, y_train, batch_size=BATCH_SIZE, epochs=EPOCHS,
                        validation_split=0.1, verbose=0)
    score = model.evaluate(x_test, y_test, verbose=0)
    return {"history": history.history, "score": score,
            "weights": [np.asarray(w) for w in model.get_weights()]}
