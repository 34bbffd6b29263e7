"""keras-io "Text classification from scratch": Embedding + Conv1D sentiment model on IMDB.

Source: github keras-team/keras-io, examples/nlp/text_classification_from_scratch.py (Mark
Omernick, Francois Chollet; reviews vectorised by ``TextVectorization(max_tokens=20000,
output_sequence_length=500)``, ``Embedding(20000, 128)``, Dropout(0.5), two
``Conv1D(128, 7, strides=3)``, global max pooling, Dense(128), Dropout(0.5), sigmoid;
binary cross-entropy, Adam, batch 32, ``fit(train_ds, validation_data=val_ds)`` then
``evaluate(test_ds)``). Written anew after the example: same model, compile, fit, evaluate.

Edits beyond API renames:
- data: synthetic token-id sequences (``_data.imdb_like_token_ids``: ids below 20000, zero
  padding to 500) stand in for the vectorised reviews, since ``TextVectorization`` and
  ``text_dataset_from_directory`` need TensorFlow; 64 train / 40 validation / 40 test rows
  (IMDB: 20000 = 625 x 32 / 5000 = 156 x 32 + 8 / 25000 = 781 x 32 + 8, the same
  remainders); they are numpy arrays passed with ``batch_size=32, shuffle=False`` instead of
  batched, cached ``tf.data`` datasets (the directory loader shuffles once, with seed 1337:
  the arrays are shuffled once with that seed).
- 1 epoch instead of 3; ``keras.utils.set_random_seed(0)`` before building the model.
- the model is built and compiled under ``strategy.scope()``.
- the end-to-end model on raw strings (``TextVectorization`` inside) is left out.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import layers  # noqa: E402

import jaxdist  # noqa: E402

from ._data import imdb_like_token_ids  # noqa: E402

MAX_FEATURES = 20000
EMBEDDING_DIM = 128
SEQUENCE_LENGTH = 500
BATCH_SIZE = 32
EPOCHS = 1              # 3 in the example
TRAIN_ROWS, VAL_ROWS, TEST_ROWS = 64, 40, 40


def build_model():
    inputs = keras.Input(shape=(None,), dtype="int64")
    x = layers.Embedding(MAX_FEATURES, EMBEDDING_DIM)(inputs)
    x = layers.Dropout(0.5)(x)
    x = layers.Conv1D(128, 7, padding="valid", activation="relu", strides=3)(x)
    x = layers.Conv1D(128, 7, padding="valid", activation="relu", strides=3)(x)
    x = layers.GlobalMaxPooling1D()(x)
    x = layers.Dense(128, activation="relu")(x)
    x = layers.Dropout(0.5)(x)
    predictions = layers.Dense(1, activation="sigmoid", name="predictions")(x)
    return keras.Model(inputs, predictions)


def main(strategy: jaxdist.Strategy | None = None) -> dict:
    strategy = strategy or jaxdist.get_strategy()
    x, y = imdb_like_token_ids(TRAIN_ROWS + VAL_ROWS, MAX_FEATURES, SEQUENCE_LENGTH, seed=0)
    order = np.random.default_rng(1337).permutation(len(y))
    x, y = x[order], y[order]
    x_train, y_train = x[:TRAIN_ROWS], y[:TRAIN_ROWS]
    x_val, y_val = x[TRAIN_ROWS:], y[TRAIN_ROWS:]
    x_test, y_test = imdb_like_token_ids(TEST_ROWS, MAX_FEATURES, SEQUENCE_LENGTH, seed=1)

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model()
        model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"])
    history = model.fit(x_train, y_train, batch_size=BATCH_SIZE, shuffle=False,
                        validation_data=(x_val, y_val), epochs=EPOCHS, verbose=0)
    score = model.evaluate(x_test, y_test, batch_size=BATCH_SIZE, verbose=0)
    return {"history": history.history, "score": score,
            "weights": [np.asarray(w) for w in model.get_weights()]}
