"""TensorFlow's "Custom training with tf.distribute.Strategy" tutorial, with its Keras model.

Source: github tensorflow/docs, site/en/tutorials/distribute/custom_training.ipynb (Fashion
MNIST; ``GLOBAL_BATCH_SIZE = 64 * strategy.num_replicas_in_sync``; a Keras
Conv2D(32)/MaxPool/Conv2D(64)/MaxPool/Dense(64)/Dense(10) model, Adam, and metrics created
under ``strategy.scope()``; per-example ``SparseCategoricalCrossentropy(from_logits=True,
reduction=NONE)`` scaled by ``tf.nn.compute_average_loss``; ``train_step`` / ``test_step``
run by ``strategy.run``, the loss summed with ``strategy.reduce``; a checkpoint every second
epoch; the latest checkpoint restored into a new model and evaluated without the strategy).
Written anew after the tutorial: same model, input, loss scaling, metrics and loop.

Edits beyond API renames:
- data: scikit-learn digits enlarged to 28x28 (``_data.digits_as_mnist``) instead of Fashion
  MNIST; 352 train rows (256 + 96: Fashion MNIST's 60000 leave a last batch of 96 at
  4 x 64) and 272 test rows (256 + 16, as 10000); ``jaxdist.Dataset`` for ``tf.data``
  (seeded shuffle).
- the global batch is 64 x 4 in every run, so the 1-device run sees the same global batches.
- 2 epochs instead of 10.
- the ``tf.GradientTape`` block becomes ``jaxdist.keras.value_and_grad`` of a function of no
  arguments (JAX differentiates functions, not tapes); the model, optimizer and metrics are
  closed over by the steps as in the tutorial (``strategy.run`` carries their variables).
- ``@tf.function`` is dropped (``strategy.run`` compiles).
- ``tf.train.Checkpoint(optimizer, model)`` becomes ``model.save_weights`` (the restore only
  evaluates the model; the optimizer state is not needed); files go to a temporary directory.
- the "alternate ways of iterating" sections are left out; results are returned, not printed.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import jaxdist  # noqa: E402
import jaxdist.keras  # noqa: E402

from ._data import digits_as_mnist  # noqa: E402

BATCH_SIZE_PER_REPLICA = 64
REPLICAS = 4            # the tutorial uses strategy.num_replicas_in_sync
GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * REPLICAS
EPOCHS = 2              # 10 in the tutorial
TRAIN_ROWS, TEST_ROWS = 352, 272


def create_model():
    model = keras.Sequential([
        keras.Input(shape=(28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    return model


def main(strategy: jaxdist.Strategy | None = None) -> dict:
    strategy = strategy or jaxdist.get_strategy()
    images, labels = digits_as_mnist(TRAIN_ROWS + TEST_ROWS)
    images = images[..., None] / np.float32(255)
    train_images, train_labels = images[:TRAIN_ROWS], labels[:TRAIN_ROWS]
    test_images, test_labels = images[TRAIN_ROWS:], labels[TRAIN_ROWS:]
    buffer_size = len(train_images)

    train_dataset = jaxdist.Dataset.from_tensor_slices(
        (train_images, train_labels)).shuffle(buffer_size, seed=0).batch(GLOBAL_BATCH_SIZE)
    test_dataset = jaxdist.Dataset.from_tensor_slices(
        (test_images, test_labels)).batch(GLOBAL_BATCH_SIZE)
    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

    keras.utils.set_random_seed(0)
    with strategy.scope():
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                 reduction=None)

        def compute_loss(labels, predictions):
            per_example_loss = loss_object(labels, predictions)
            return jaxdist.compute_average_loss(per_example_loss,
                                                global_batch_size=GLOBAL_BATCH_SIZE)

        test_loss = keras.metrics.Mean(name="test_loss")
        train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_accuracy = keras.metrics.SparseCategoricalAccuracy(name="test_accuracy")
        model = create_model()
        optimizer = keras.optimizers.Adam()

    def train_step(inputs):
        images, labels = inputs

        def forward():  # was: with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            return compute_loss(labels, predictions), predictions

        (loss, predictions), gradients = jaxdist.keras.value_and_grad(
            forward, model.trainable_variables, has_aux=True)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        train_accuracy.update_state(labels, predictions)
        return loss

    def test_step(inputs):
        images, labels = inputs
        predictions = model(images, training=False)
        t_loss = loss_object(labels, predictions)
        test_loss.update_state(t_loss)
        test_accuracy.update_state(labels, predictions)

    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(jaxdist.ReduceOp.SUM, per_replica_losses, axis=None)

    def distributed_test_step(dataset_inputs):
        return strategy.run(test_step, args=(dataset_inputs,))

    history = []
    with tempfile.TemporaryDirectory() as checkpoint_dir:
        checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")
        saved = []
        for epoch in range(EPOCHS):
            total_loss = 0.0
            num_batches = 0
            for x in train_dist_dataset:
                total_loss += distributed_train_step(x)
                num_batches += 1
            train_loss = total_loss / num_batches
            for x in test_dist_dataset:
                distributed_test_step(x)
            if epoch % 2 == 0:
                saved.append(f"{checkpoint_prefix}-{epoch + 1}.weights.h5")
                model.save_weights(saved[-1])
            history.append({
                "loss": train_loss,
                "accuracy": train_accuracy.result(),
                "test_loss": test_loss.result(),
                "test_accuracy": test_accuracy.result(),
            })
            test_loss.reset_state()
            train_accuracy.reset_state()
            test_accuracy.reset_state()

        # Restore the latest checkpoint into a new model and test it without the strategy.
        eval_accuracy = keras.metrics.SparseCategoricalAccuracy(name="eval_accuracy")
        new_model = create_model()
        new_model.load_weights(saved[-1])
        for images, labels in test_dataset:
            predictions = new_model(images, training=False)
            eval_accuracy.update_state(labels, predictions)
    return {"history": history, "restored_accuracy": eval_accuracy.result(),
            "weights": [np.asarray(w) for w in model.get_weights()]}
