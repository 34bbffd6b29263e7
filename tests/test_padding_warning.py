"""Padding is never silent: a replica function that reduces a zero-padded partial batch without
asking which rows are real is warned, once, with the row mask to use.

63 rows in a global batch of 64 on 2 replicas: TF hands replica 1 its 31 rows; jaxdist hands it
32 rows, the last one zeros (one SPMD program has one shape), so ``jnp.mean`` over the rows
gives 31/32 of one device's answer. ``ctx.row_mask`` / ``ctx.valid_rows`` tell the real rows;
``compute_average_loss``, the Trainer and the Keras paths use them by themselves.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from devutil import first_devices
from flax import nnx

import jaxdist

pytestmark = pytest.mark.devices(2)

ROWS, GLOBAL = 63, 64


@pytest.fixture
def strategy():
    return jaxdist.MirroredStrategy(first_devices(2))


def _batch(strategy, rows=ROWS, cols=4):
    x = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) / 100 + 1
    y = (np.arange(rows) % 3).astype(np.int32)
    ds = jaxdist.Dataset.from_tensor_slices((x, y)).batch(GLOBAL)
    return x, y, next(iter(strategy.experimental_distribute_dataset(ds)))


def _padding_warnings(caught):
    return [str(w.message) for w in caught if "partial batch reached" in str(w.message)]


def _run_recording(strategy, fn, args, times=1):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(times):
            out = strategy.run(fn, args=args)
    return out, _padding_warnings(caught)


def test_an_unmasked_mean_over_a_padded_batch_warns_once_naming_the_mask(strategy):
    x, _, (xb, _) = _batch(strategy)

    def replica_mean(xb):  # the program: 31.5 instead of 32.0 rows of ones
        return jnp.mean(jnp.sign(xb[:, 0])) * xb.shape[0]

    out, msgs = _run_recording(strategy, replica_mean, (xb,), times=3)
    assert len(msgs) == 1, msgs
    assert "row_mask" in msgs[0] and "valid_rows" in msgs[0] and "[32, 31]" in msgs[0]
    assert "replica_mean" in msgs[0]
    # The numbers themselves are what the warning is about: replica 1 counts its padding row.
    assert [float(v) for v in strategy.experimental_local_results(out)] == [32.0, 31.0]
    # Another padded signature of the same function is not warned again.
    _, _, (xb2, _) = _batch(strategy, rows=61)
    assert _run_recording(strategy, replica_mean, (xb2,))[1] == []


def test_reading_the_mask_gives_one_devices_numbers_and_no_warning(strategy):
    x, _, (xb, _) = _batch(strategy)

    def masked_mean(xb):
        mask = jaxdist.get_replica_context().row_mask(xb.shape[0])
        rows = jnp.where(mask[:, None], xb, 0.0)
        return jnp.sum(rows, axis=0) / jnp.sum(mask)

    def valid_rows_mean(xb):
        n = jaxdist.get_replica_context().valid_rows
        rows = jnp.where((jnp.arange(xb.shape[0]) < n)[:, None], xb, 0.0)
        return jnp.sum(rows, axis=0) / n

    for fn in (masked_mean, valid_rows_mean):
        out, msgs = _run_recording(strategy, fn, (xb,))
        assert msgs == [], fn.__name__
        parts = strategy.experimental_local_results(out)
        np.testing.assert_allclose(parts[0], x[:32].mean(axis=0), rtol=1e-6)
        np.testing.assert_allclose(parts[1], x[32:].mean(axis=0), rtol=1e-6)  # 31 rows


def test_compute_average_loss_step_is_exact_and_not_warned(strategy):
    x, y, (xb, yb) = _batch(strategy)
    w0 = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32))

    def loss_fn(w, xb, yb):
        per_example = optax.softmax_cross_entropy_with_integer_labels(xb @ w, yb)
        return jaxdist.compute_average_loss(per_example, global_batch_size=GLOBAL)

    def step(w, xb, yb):
        loss, grads = jax.value_and_grad(loss_fn)(w, xb, yb)
        return w - 0.1 * grads, loss

    with strategy.scope():
        w = strategy.place(w0)
    (new_w, loss), msgs = _run_recording(strategy, step, (w, xb, yb))
    assert msgs == []
    want_w, want_loss = step(w0, x, y)
    np.testing.assert_allclose(new_w, want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(strategy.reduce("SUM", loss, axis=None), want_loss, rtol=1e-5)


def test_per_row_outputs_and_state_the_batch_does_not_reach_are_not_warned(strategy):
    _, _, (xb, _) = _batch(strategy)
    with strategy.scope():
        w, count = jnp.ones((4, 2)), jnp.int32(0)

    def predict(w, count, xb):  # per-row outputs come back cut to the real rows
        return xb @ w, count + 1, w

    (preds, new_count, same_w), msgs = _run_recording(strategy, predict, (w, count, xb))
    assert msgs == []
    assert [p.shape[0] for p in strategy.experimental_local_results(preds)] == [32, 31]
    assert int(new_count) == 1


def test_a_full_batch_is_never_warned(strategy):
    x = np.ones((64, 4), np.float32)
    xb = next(iter(strategy.experimental_distribute_dataset(
        jaxdist.Dataset.from_tensor_slices(x).batch(GLOBAL))))
    assert _run_recording(strategy, lambda xb: jnp.mean(xb), (xb,))[1] == []


class _MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.l2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def test_trainer_fit_and_evaluate_on_partial_batches_are_not_warned(strategy):
    from jaxdist.train import Trainer

    x, y, _ = _batch(strategy, rows=2 * GLOBAL + ROWS)
    with strategy.scope():
        trainer = Trainer(_MLP(nnx.Rngs(0)), optax.sgd(0.1), global_batch_size=GLOBAL,
                          strategy=strategy, progress_bar="never", log_every_steps=1000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit((x, y), epochs=1)
        trainer.evaluate((x, y))
    assert _padding_warnings(caught) == []


def test_nnx_step_with_compute_average_loss_is_not_warned(strategy):
    """flax NNX objects crossing run (split and merged by jaxdist) keep the rule."""
    x, y, (xb, yb) = _batch(strategy)
    with strategy.scope():
        model = _MLP(nnx.Rngs(0))

    def step(model, xb, yb):
        def loss_fn(m):
            per_example = optax.softmax_cross_entropy_with_integer_labels(m(xb), yb)
            return jaxdist.compute_average_loss(per_example, global_batch_size=GLOBAL)
        return nnx.grad(loss_fn)(model)

    _, msgs = _run_recording(strategy, step, (model, xb, yb))
    assert msgs == []

    def unmasked(model, xb, yb):
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(model(xb), yb))

    _, msgs = _run_recording(strategy, unmasked, (model, xb, yb))
    assert len(msgs) == 1 and "row_mask" in msgs[0]


def test_keras_custom_loop_and_fit_on_partial_batches_are_not_warned(strategy):
    """The Keras custom loop of TF's tutorial (compute_average_loss; metrics masked by jaxdist)
    and Keras' fit are not warned; the same loop with Keras' own mean reduction is."""
    keras = pytest.importorskip("keras")
    import jaxdist.keras

    x, y, _ = _batch(strategy, rows=GLOBAL + ROWS)
    dist = strategy.experimental_distribute_dataset(
        jaxdist.Dataset.from_tensor_slices((x, y)).batch(GLOBAL))
    with strategy.scope():
        per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                 reduction=None)
        mean_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        accuracy = keras.metrics.SparseCategoricalAccuracy()
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        optimizer = keras.optimizers.SGD(0.1)

    def make_step(loss_of):
        def train_step(inputs):
            xb, yb = inputs

            def forward():
                predictions = model(xb, training=True)
                return loss_of(yb, predictions), predictions
            (loss, predictions), grads = jaxdist.keras.value_and_grad(
                forward, model.trainable_variables, has_aux=True)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            accuracy.update_state(yb, predictions)
            return loss
        return train_step

    masked = make_step(lambda yb, p: jaxdist.compute_average_loss(per_example(yb, p)))
    unmasked = make_step(mean_loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in dist:
            strategy.run(masked, args=(batch,))
        assert _padding_warnings(caught) == []
        with strategy.scope():
            fit_model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
            fit_model.compile(loss="sparse_categorical_crossentropy", optimizer="sgd")
        fit_model.fit(x, y, batch_size=GLOBAL, epochs=1, verbose=0)
        assert _padding_warnings(caught) == []
        for batch in dist:
            strategy.run(unmasked, args=(batch,))
    assert len(_padding_warnings(caught)) == 1
