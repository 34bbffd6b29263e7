"""keras-io "Timeseries classification from scratch": a fully convolutional network on FordA.

Source: github keras-team/keras-io, examples/timeseries/timeseries_classification_from_scratch.py
(hfawaz; three Conv1D(64, 3, "same") + BatchNormalization + ReLU blocks, global average
pooling, softmax; Adam, sparse categorical cross-entropy, batch 32, ``validation_split=0.2``,
callbacks ModelCheckpoint(save_best_only, monitor="val_loss"), ReduceLROnPlateau,
EarlyStopping; the best model is loaded back and scored on the test set with ``predict``).
Written anew after the example: same model, compile, callbacks, fit, load and predict.

Edits beyond API renames:
- data: synthetic z-normalised series of FordA's shape (500 steps, labels -1/1;
  ``_data.ford_a_like``) instead of the UCR TSV files; 81 train rows (``validation_split=0.2``
  leaves 64 = 2 x 32 to train on and 17 to validate: FordA's 3601 leave 2880 = 90 x 32 and
  721 = 22 x 32 + 17) and 40 test rows (32 + 8, as FordA's 1320); the training rows are
  permuted with a seeded ``np.random.default_rng(0)`` instead of the unseeded
  ``np.random.permutation``.
- 2 epochs instead of 500; ``keras.utils.set_random_seed(0)`` before building the model.
- the checkpoint file is ``best_model.keras`` in a temporary directory (Keras 3 saves whole
  models only as ``.keras``; the example wrote ``best_model.h5`` in the working directory).
- the model is built and compiled under ``strategy.scope()``.
- no plots; the history, test accuracy and weights are returned.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.metrics import accuracy_score  # noqa: E402

import jaxdist  # noqa: E402

from ._data import ford_a_like  # noqa: E402

EPOCHS = 2              # 500 in the example
BATCH_SIZE = 32
TRAIN_ROWS, TEST_ROWS = 81, 40


def make_model(input_shape, num_classes):
    input_layer = keras.layers.Input(input_shape)
    x = input_layer
    for _ in range(3):
        x = keras.layers.Conv1D(filters=64, kernel_size=3, padding="same")(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.ReLU()(x)
    gap = keras.layers.GlobalAveragePooling1D()(x)
    output_layer = keras.layers.Dense(num_classes, activation="softmax")(gap)
    return keras.models.Model(inputs=input_layer, outputs=output_layer)


def main(strategy: jaxdist.Strategy | None = None) -> dict:
    strategy = strategy or jaxdist.get_strategy()
    x_train, y_train = ford_a_like(TRAIN_ROWS, seed=0)
    x_test, y_test = ford_a_like(TEST_ROWS, seed=1)
    x_train = x_train.reshape((x_train.shape[0], x_train.shape[1], 1))
    x_test = x_test.reshape((x_test.shape[0], x_test.shape[1], 1))
    num_classes = len(np.unique(y_train))
    idx = np.random.default_rng(0).permutation(len(x_train))
    x_train, y_train = x_train[idx], y_train[idx]
    y_train[y_train == -1] = 0
    y_test[y_test == -1] = 0

    keras.utils.set_random_seed(0)
    with tempfile.TemporaryDirectory() as workdir:
        best = os.path.join(workdir, "best_model.keras")
        with strategy.scope():
            model = make_model(x_train.shape[1:], num_classes)
            callbacks = [
                keras.callbacks.ModelCheckpoint(best, save_best_only=True, monitor="val_loss"),
                keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=20,
                                                  min_lr=0.0001),
                keras.callbacks.EarlyStopping(monitor="val_loss", patience=50, verbose=0),
            ]
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                          metrics=["accuracy"])
        history = model.fit(x_train, y_train, batch_size=BATCH_SIZE, epochs=EPOCHS,
                            callbacks=callbacks, validation_split=0.2, verbose=0)
        model = keras.models.load_model(best)
        y_pred = model.predict(x_test, verbose=0).argmax(axis=1)
    return {"history": history.history, "test_accuracy": accuracy_score(y_pred, y_test),
            "weights": [np.asarray(w) for w in model.get_weights()]}
