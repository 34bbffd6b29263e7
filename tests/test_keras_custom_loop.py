"""TF's "Custom training with tf.distribute.Strategy" tutorial, ported, with a Keras model.

Source: tensorflow/docs, site/en/tutorials/distribute/custom_training.ipynb. Edits beyond API
renames (tf.distribute -> jaxdist, tf.nn.compute_average_loss -> jaxdist.compute_average_loss):
the GradientTape block becomes ``jaxdist.keras.value_and_grad`` (JAX differentiates functions);
Fashion-MNIST becomes same-shaped synthetic 28x28 images, fewer rows; the model is smaller;
``@tf.function`` is dropped (``strategy.run`` compiles). The model, optimizer and metrics are
closed over by the steps, exactly as in the tutorial. The comparison of 4 replicas with one
device over the same global batches is tests/programs/tf_custom_training.py (run by
tests/test_programs.py); here: the objects are carried, BatchNorm, the errors, the block of
docs/keras.md.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

keras = pytest.importorskip("keras")

import jaxdist  # noqa: E402
import jaxdist.keras  # noqa: E402

ROWS, TEST_ROWS = 200, 70  # not multiples of the global batch: partial last batches
BATCH_SIZE_PER_REPLICA = 8
EPOCHS = 2


def _need(n):
    if jax.local_device_count() < n:
        pytest.skip(f"needs {n} local devices, {jax.local_device_count()} available")


def _data():
    rng = np.random.RandomState(0)
    x = rng.rand(ROWS + TEST_ROWS, 28, 28, 1).astype(np.float32)
    y = (x[:, :14].mean(axis=(1, 2, 3)) * 20).astype(np.int64) % 10
    return (x[:ROWS], y[:ROWS]), (x[ROWS:], y[ROWS:])


def tutorial(strategy, batch_norm=False):
    """The tutorial's program, top to bottom (comments mark the edits)."""
    (train_images, train_labels), (test_images, test_labels) = _data()
    BUFFER_SIZE = len(train_images)  # noqa: N806
    GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync  # noqa: N806
    # edit: jaxdist.Dataset for tf.data.Dataset (same methods)
    train_dataset = jaxdist.Dataset.from_tensor_slices((train_images, train_labels)).shuffle(
        BUFFER_SIZE, seed=0).batch(GLOBAL_BATCH_SIZE)
    test_dataset = jaxdist.Dataset.from_tensor_slices((test_images, test_labels)).batch(
        GLOBAL_BATCH_SIZE)
    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

    def create_model():
        keras.utils.set_random_seed(0)
        layers = [
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(
                16, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3)
            ),
        ]
        if batch_norm:
            layers.append(keras.layers.BatchNormalization())
        layers.append(keras.layers.Dense(10))
        return keras.Sequential([keras.Input((28, 28, 1)), *layers])

    with strategy.scope():
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

        def compute_loss(labels, predictions, model_losses):
            per_example_loss = loss_object(labels, predictions)
            loss = jaxdist.compute_average_loss(per_example_loss)
            if model_losses:
                loss += jaxdist.scale_regularization_loss(sum(model_losses))
            return loss

        test_loss = keras.metrics.Mean(name="test_loss")
        train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_accuracy = keras.metrics.SparseCategoricalAccuracy(name="test_accuracy")
        model = create_model()
        optimizer = keras.optimizers.Adam(learning_rate=0.01)

    def train_step(inputs):
        images, labels = inputs

        def forward():  # edit: the GradientTape block
            predictions = model(images, training=True)
            return compute_loss(labels, predictions, model.losses), predictions

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
    for _ in range(EPOCHS):
        total_loss = 0.0
        num_batches = 0
        for x in train_dist_dataset:
            total_loss += float(distributed_train_step(x))
            num_batches += 1
        train_loss = total_loss / num_batches
        for x in test_dist_dataset:
            distributed_test_step(x)
        history.append((train_loss, float(train_accuracy.result()), float(test_loss.result()),
                        float(test_accuracy.result())))
        test_loss.reset_state()
        train_accuracy.reset_state()
        test_accuracy.reset_state()
    return history, [np.asarray(w) for w in model.weights], int(optimizer.iterations.value)


@pytest.mark.devices(2)
def test_metrics_and_optimizer_state_are_carried():
    """Never a silent no-op: the closed-over Keras objects change after strategy.run."""
    _need(2)
    history, weights, iterations = tutorial(jaxdist.MirroredStrategy(jax.local_devices()[:2]))
    assert iterations == EPOCHS * -(-ROWS // 16)
    assert all(0.0 < h[1] <= 1.0 and 0.0 < h[3] <= 1.0 for h in history)
    assert history[1][0] < history[0][0]  # it trains


@pytest.mark.devices(2)
def test_batch_norm_statistics_are_averaged_over_replicas():
    _need(2)
    _, weights, _ = tutorial(jaxdist.MirroredStrategy(jax.local_devices()[:2]), batch_norm=True)
    assert all(np.all(np.isfinite(w)) for w in weights)


@pytest.mark.devices(2)
def test_diverging_trainable_variable_is_an_error():
    _need(2)
    strategy = jaxdist.MirroredStrategy(jax.local_devices()[:2])
    with strategy.scope():
        layer = keras.layers.Dense(2)
        layer.build((None, 2))
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full((2,), float(ctx.replica_id_in_sync_group), np.float32)
    )

    def step(x):
        layer.kernel.assign(layer.kernel + x)  # a per-replica value, never reduced

    with pytest.raises(ValueError, match=r"differs across the replicas"):
        strategy.run(step, args=(x,))


def test_doc_custom_loop_block_runs_as_written(capsys):
    import pathlib
    import re

    page = (pathlib.Path(__file__).parent.parent / "docs" / "keras.md").read_text()
    section = page.split("## Keras models in custom training loops", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "docs/keras.md:keras-custom-loop", "exec"), {"__name__": "doc_keras"})
    steps, accuracy = capsys.readouterr().out.split()
    assert int(steps) == -(-100 // (16 * jax.local_device_count()))
    assert 0.0 <= float(accuracy) <= 1.0
