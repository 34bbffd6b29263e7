"""strategy.run's steady-state fast path gives the full path's answer whenever a call differs
from the one it remembered: another placement, a host array, another static value, another
strategy's devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from devutil import first_devices

import jaxdist


@pytest.fixture
def strategy():
    return jaxdist.MirroredStrategy(first_devices(2))


def _step(w, xb, scale):
    return jaxdist.get_replica_context().all_reduce("SUM", (xb @ w) * scale)


def _batch(strategy, x):
    return next(iter(strategy.experimental_distribute_dataset([x])))


def _expected(w, x, scale):
    return (np.asarray(x) @ np.asarray(w)).reshape(2, -1).sum(0) * scale


@pytest.mark.devices(2)
def test_fast_path_answers_as_the_full_path_when_a_call_changes(strategy):
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    xd = _batch(strategy, x)
    with strategy.scope():
        w = jnp.arange(3.0)
    for _ in range(3):  # the remembered signature, then the fast path
        out = strategy.run(_step, args=(w, xd, 2.0))
    np.testing.assert_allclose(strategy.experimental_local_results(out)[0],
                               _expected(w, x, 2.0))
    # The same tree with the state on one device (another sharding), then as a host array.
    w1 = jax.device_put(np.arange(3.0, dtype=np.float32) + 1, first_devices(2)[1])
    out = strategy.run(_step, args=(w1, xd, 2.0))
    np.testing.assert_allclose(strategy.experimental_local_results(out)[1],
                               _expected(w1, x, 2.0))
    w2 = np.arange(3.0, dtype=np.float32) - 1
    out = strategy.run(_step, args=(w2, xd, 2.0))
    np.testing.assert_allclose(strategy.experimental_local_results(out)[0],
                               _expected(w2, x, 2.0))
    # Back to the remembered placement, with a batch whose rows differ.
    x3 = x + 100
    out = strategy.run(_step, args=(w, _batch(strategy, x3), 2.0))
    np.testing.assert_allclose(strategy.experimental_local_results(out)[0],
                               _expected(w, x3, 2.0))


@pytest.mark.devices(2)
def test_fast_path_recompiles_for_another_static_value(strategy):
    x = np.ones((4, 3), np.float32)
    xd = _batch(strategy, x)

    def step(xb, mode):
        return xb.sum() * (1.0 if mode == "one" else 10.0)

    for _ in range(2):
        one = strategy.run(step, args=(xd, "one"))
    ten = strategy.run(step, args=(xd, "ten"))
    assert float(strategy.reduce("SUM", one, axis=None)) == 12.0
    assert float(strategy.reduce("SUM", ten, axis=None)) == 120.0


def _double(xb):
    return xb * 2


@pytest.mark.devices(4)
def test_a_value_placed_on_another_strategys_devices_after_the_fast_path():
    a = jaxdist.MirroredStrategy(first_devices(4)[:2])
    b = jaxdist.MirroredStrategy(first_devices(4)[2:])
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    xa = _batch(a, x)
    for _ in range(3):
        out = a.run(_double, args=(xa,))
    out = a.run(_double, args=(_batch(b, x + 1),))
    parts = a.experimental_local_results(out)
    assert {d for p in parts for d in p.devices()} <= set(first_devices(4)[:2])
    np.testing.assert_allclose(np.concatenate([np.asarray(p) for p in parts]), (x + 1) * 2)
