"""keras-io "Structured data classification from scratch": heart-disease CSV, 13 features.

Source: github keras-team/keras-io,
examples/structured_data/structured_data_classification_from_scratch.py (fchollet; 303 rows,
``dataframe.sample(frac=0.2, random_state=1337)`` for validation, numerical features through
``Normalization`` adapted on the training split, categorical ones one-hot encoded, Dense(32)
+ Dropout(0.5) + sigmoid; Adam, binary cross-entropy, batch 32, shuffled each epoch; then
``predict`` on one new patient). Written anew after the example: same model, compile, fit and
predict.

Edits beyond API renames:
- data: a synthetic table with the CSV's 13 columns, value ranges and 303 rows
  (``_data.heart_like``) instead of downloading heart.csv; numpy instead of pandas for the
  80/20 split (seeded with 1337; 242 train rows = 7 x 32 + 18, 61 validation rows).
- categorical encoding: ``IntegerLookup`` / ``StringLookup`` need TensorFlow in Keras 3, so
  integer features use ``CategoryEncoding(num_tokens=max + 1, output_mode="one_hot")`` (the
  alternative the example names) and ``thal`` is mapped to the index of its value in the
  training split's sorted vocabulary (0 for values not seen there, as the lookup's OOV slot)
  before the same layer.
- arrays with ``batch_size=32, shuffle=True`` instead of batched ``tf.data`` datasets with
  ``shuffle(len)``; 2 epochs instead of 50; ``keras.utils.set_random_seed(0)`` first.
- the model is built and compiled under ``strategy.scope()``; no ``plot_model``.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import layers  # noqa: E402

import jaxdist  # noqa: E402

from ._data import heart_like  # noqa: E402

EPOCHS = 2              # 50 in the example
BATCH_SIZE = 32
ROWS = 303
INTEGER_CATEGORICAL = ["sex", "cp", "fbs", "restecg", "exang", "ca"]
NUMERICAL = ["age", "trestbps", "chol", "thalach", "oldpeak", "slope"]


def split(table: dict[str, np.ndarray]):
    """80/20 split as ``dataframe.sample(frac=0.2, random_state=1337)``."""
    n = len(table["target"])
    val_idx = np.random.default_rng(1337).choice(n, size=round(0.2 * n), replace=False)
    train_idx = np.setdiff1d(np.arange(n), val_idx)
    pick = lambda idx: {k: v[idx] for k, v in table.items()}  # noqa: E731
    return pick(train_idx), pick(val_idx)


def features_and_labels(table, thal_vocab):
    x = {k: v.reshape(-1, 1) for k, v in table.items() if k != "target"}
    x["thal"] = thal_index(x["thal"], thal_vocab)
    for k in NUMERICAL:
        x[k] = x[k].astype("float32")
    return x, table["target"]


def thal_index(values, vocab):
    """Index in ``vocab`` plus one; 0 for an unseen value (the lookup's OOV slot)."""
    where = {v: i + 1 for i, v in enumerate(vocab)}
    return np.vectorize(lambda v: where.get(v, 0))(values).astype("int64")


def encode_numerical_feature(feature, name, train_x):
    normalizer = layers.Normalization()
    normalizer.adapt(train_x[name])
    return normalizer(feature)


def encode_categorical_feature(feature, name, train_x):
    encoder = layers.CategoryEncoding(num_tokens=int(train_x[name].max()) + 1,
                                      output_mode="one_hot")
    return encoder(feature)


def build_model(train_x):
    inputs = {k: keras.Input(shape=(1,), name=k, dtype="int64")
              for k in INTEGER_CATEGORICAL + ["thal"]}
    inputs.update({k: keras.Input(shape=(1,), name=k) for k in NUMERICAL})
    encoded = {k: encode_categorical_feature(inputs[k], k, train_x)
               for k in INTEGER_CATEGORICAL + ["thal"]}
    encoded.update({k: encode_numerical_feature(inputs[k], k, train_x) for k in NUMERICAL})
    order = ["sex", "cp", "fbs", "restecg", "exang", "slope", "ca", "thal", "age", "trestbps",
             "chol", "thalach", "oldpeak"]
    all_features = layers.concatenate([encoded[k] for k in order])
    x = layers.Dense(32, activation="relu")(all_features)
    x = layers.Dropout(0.5)(x)
    output = layers.Dense(1, activation="sigmoid")(x)
    return keras.Model(inputs, output)


def main(strategy: jaxdist.Strategy | None = None) -> dict:
    strategy = strategy or jaxdist.get_strategy()
    train, val = split(heart_like(ROWS))
    thal_vocab = sorted(set(train["thal"].tolist()))
    train_x, train_y = features_and_labels(train, thal_vocab)
    val_x, val_y = features_and_labels(val, thal_vocab)

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_model(train_x)
        model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
    history = model.fit(train_x, train_y, batch_size=BATCH_SIZE, epochs=EPOCHS, shuffle=True,
                        validation_data=(val_x, val_y), verbose=0)
    sample = {"age": 60, "sex": 1, "cp": 1, "trestbps": 145, "chol": 233, "fbs": 1,
              "restecg": 2, "thalach": 150, "exang": 0, "oldpeak": 2.3, "slope": 3, "ca": 0,
              "thal": "fixed"}
    input_dict, _ = features_and_labels(
        {**{k: np.array([v]) for k, v in sample.items()}, "target": np.array([0])}, thal_vocab)
    predictions = model.predict(input_dict, verbose=0)
    return {"history": history.history, "prediction": predictions,
            "weights": [np.asarray(w) for w in model.get_weights()]}
