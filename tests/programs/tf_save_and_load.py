"""TensorFlow's "Save and load a model using a distribution strategy" tutorial (Keras APIs).

Source: github tensorflow/docs, site/en/tutorials/distribute/save_and_load.ipynb (MNIST from
TFDS through ``map(scale).cache().shuffle(10000).batch(64 * replicas)``; a Conv2D(32) /
MaxPooling / Flatten / Dense(64) / Dense(10) model built and compiled under
``MirroredStrategy().scope()`` with Adam, ``SparseCategoricalCrossentropy(from_logits=True)``
and accuracy; ``fit(train_dataset, epochs=2)``; ``model.save`` outside the scope;
``load_model`` without a strategy and ``fit`` 2 epochs; ``load_model`` and ``fit`` inside
``OneDeviceStrategy("/cpu:0").scope()``). Written anew after the tutorial: the same pipeline,
model, compile arguments and calls.

Edits beyond API renames:
- data: scikit-learn digits enlarged to 28x28 (``_data.digits_as_mnist``) through
  ``tf.data.Dataset.from_tensor_slices`` instead of TFDS MNIST (the rest of the tf.data chain
  as written); 576 train rows (2 x 256 + 64: a last partial batch, as MNIST's 60000 leave
  one) and 320 eval rows; the shuffle is seeded (``shuffle(10000, seed=0)`` after
  ``keras.utils.set_random_seed(0)``, which sets TF's global seed).
- the global batch is 64 x 4 in every run (the tutorial multiplies by the replica count), so
  the 1-device run sees the same global batches as the 4-replica one.
- the strategy under test takes the place of ``MirroredStrategy()``; ``OneDeviceStrategy``
  gets the first device; ``keras.utils.set_random_seed(0)`` before the model is built.
- Keras 3 names: ``model.save("model.keras")`` (a ``.keras`` file in a temporary directory)
  instead of a TF SavedModel directory. The ``tf.saved_model`` part (a SavedModel's
  serving signature, ``hub.KerasLayer``) has no JAX counterpart and is left out.
- each ``fit`` returns its history; the loaded models are also evaluated; the weights are
  returned.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402

import jaxdist  # noqa: E402

from ._data import digits_as_mnist  # noqa: E402

BUFFER_SIZE = 10000
BATCH_SIZE_PER_REPLICA = 64
REPLICAS = 4            # the tutorial uses mirrored_strategy.num_replicas_in_sync
BATCH_SIZE = BATCH_SIZE_PER_REPLICA * REPLICAS
TRAIN_ROWS, EVAL_ROWS = 576, 320


def get_data():
    import tensorflow as tf  # the tfdata test extra: the tutorial's pipeline is tf.data

    def rows(count, offset):
        x, y = digits_as_mnist(count, offset)
        return x[..., None], y

    mnist_train = tf.data.Dataset.from_tensor_slices(rows(TRAIN_ROWS, 0))
    mnist_test = tf.data.Dataset.from_tensor_slices(rows(EVAL_ROWS, TRAIN_ROWS))

    def scale(image, label):
        image = tf.cast(image, tf.float32)
        image /= 255
        return image, label

    train_dataset = (mnist_train.map(scale).cache().shuffle(BUFFER_SIZE, seed=0)
                     .batch(BATCH_SIZE))
    eval_dataset = mnist_test.map(scale).batch(BATCH_SIZE)
    return train_dataset, eval_dataset


def get_model(strategy):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((28, 28, 1)),
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
    mirrored_strategy = strategy or jaxdist.get_strategy()
    keras.utils.set_random_seed(0)  # TF's global seed too: the shuffle's order derives from it
    train_dataset, eval_dataset = get_data()
    out = {}
    model = get_model(mirrored_strategy)
    out["fit"] = model.fit(train_dataset, epochs=2, verbose=0).history
    with tempfile.TemporaryDirectory() as tmp:
        keras_model_path = os.path.join(tmp, "keras_save.keras")
        model.save(keras_model_path)  # outside the strategy's scope, as the tutorial says

        restored_keras_model = keras.models.load_model(keras_model_path)
        out["restored_fit"] = restored_keras_model.fit(train_dataset, epochs=2,
                                                       verbose=0).history
        out["restored_eval"] = restored_keras_model.evaluate(eval_dataset, verbose=0)
        out["restored_weights"] = restored_keras_model.get_weights()

        another_strategy = jaxdist.OneDeviceStrategy(jax.devices()[0])
        with another_strategy.scope():
            restored_keras_model_ds = keras.models.load_model(keras_model_path)
            out["restored_ds_fit"] = restored_keras_model_ds.fit(train_dataset, epochs=2,
                                                                 verbose=0).history
        out["restored_ds_eval"] = restored_keras_model_ds.evaluate(eval_dataset, verbose=0)
        out["restored_ds_weights"] = restored_keras_model_ds.get_weights()
    return out
