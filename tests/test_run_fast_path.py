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


# The steady state in one process is one jax.jit over run's whole argument tuple: a signature
# it has not seen traces again, and what only the per-leaf path handles falls back to it.


def _warm(strategy, fn, args, times=3):
    out = None
    for _ in range(times):
        out = strategy.run(fn, args=args)
    return out


@pytest.mark.devices(2)
def test_a_partial_batch_after_full_ones_gives_the_rows_it_holds(strategy):
    def total(xb):
        return jaxdist.get_replica_context().all_reduce("SUM", xb.sum())

    full = np.ones((4, 3), np.float32)
    _warm(strategy, total, (_batch(strategy, full),))
    part = next(iter(strategy.experimental_distribute_dataset(
        jaxdist.Dataset.from_tensor_slices(np.ones((3, 3), np.float32)).batch(4))))
    out = strategy.run(total, args=(part,))
    assert float(strategy.experimental_local_results(out)[0]) == 9.0  # 3 rows, not 4


@pytest.mark.devices(2)
def test_a_per_replica_value_of_another_replica_count_is_named(strategy):
    x = np.ones((4, 3), np.float32)
    _warm(strategy, _double, (_batch(strategy, x),))
    three = jaxdist.MirroredStrategy(first_devices(3)) if len(jax.devices()) >= 3 else None
    if three is None:
        pytest.skip("needs 3 devices for a PerReplica of 3 replicas")
    with pytest.raises(ValueError, match="PerReplica value has 3 replicas, but .* has 2"):
        strategy.run(_double, args=(_batch(three, np.ones((6, 3), np.float32)),))


@pytest.mark.devices(2)
def test_a_constant_argument_after_the_steady_state_takes_the_full_path(strategy):
    def scaled(xb, mode):
        return xb.sum() * (10.0 if mode == "ten" else 1.0)

    xd = _batch(strategy, np.ones((4, 3), np.float32))
    _warm(strategy, scaled, (xd, 1.0))
    out = strategy.run(scaled, args=(xd, "ten"))
    assert float(strategy.reduce("SUM", out, axis=None)) == 120.0
    out = strategy.run(scaled, args=(xd, 1.0))  # and back
    assert float(strategy.reduce("SUM", out, axis=None)) == 12.0


@pytest.mark.devices(2)
def test_under_a_users_jit_after_the_steady_state(strategy):
    xd = _batch(strategy, np.arange(12, dtype=np.float32).reshape(4, 3))
    eager = _warm(strategy, _step, (jnp.ones(3), xd, 2.0))

    @jax.jit
    def outer(w, xb):
        return strategy.run(_step, args=(w, xb, 2.0))

    inside = outer(jnp.ones(3), xd)
    np.testing.assert_allclose(strategy.experimental_local_results(inside)[0],
                               strategy.experimental_local_results(eager)[0])


@pytest.mark.devices(2)
def test_donation_in_the_steady_state_consumes_the_donated_state(strategy):
    def step(w, xb):
        g = jaxdist.get_replica_context().all_reduce("SUM", xb.sum(0))
        return w - 0.1 * g, g.sum()

    xd = _batch(strategy, np.ones((4, 3), np.float32))
    donate = jaxdist.RunOptions(donate_argnums=(0,))
    with strategy.scope():
        w = jnp.zeros(3)
    for i in range(4):
        old = w
        w, _ = strategy.run(step, args=(w, xd), options=donate)
        assert old.is_deleted(), f"call {i}: the donated state is still alive"
    np.testing.assert_allclose(np.asarray(w), np.full(3, -1.6), rtol=1e-6)  # 4 x 0.1 x 4


@pytest.mark.devices(2)
def test_an_nnx_module_after_arrays_for_the_same_function_is_trained(strategy):
    """An NNX module's steps write its state back: a call with a module never runs in the
    steady-state jit that a call with plain arrays of the same function set up."""
    nnx = pytest.importorskip("flax.nnx")
    import collections

    def step(model, xb):
        new = model.kernel[...] + jaxdist.get_replica_context().all_reduce("SUM", xb.sum())
        if isinstance(model, nnx.Module):
            model.kernel[...] = new
        return new.sum()

    class Holder(nnx.Module):
        def __init__(self):
            self.kernel = nnx.Param(jnp.zeros(2))

    Params = collections.namedtuple("Params", "kernel")
    xd = _batch(strategy, np.ones((4, 3), np.float32))
    out = _warm(strategy, step, (strategy.place(Params(jnp.zeros(2))), xd))
    assert float(out) == 24.0
    assert strategy.extended._tree_calls.get((step, ())), "no steady-state jit was set up"
    model = Holder()
    strategy.run(step, args=(model, xd))
    strategy.run(step, args=(model, xd))
    np.testing.assert_allclose(np.asarray(model.kernel[...]), [24.0, 24.0])


@pytest.mark.devices(2)
def test_scope_checks_hold_once_the_steady_state_is_warm(strategy):
    """In its own scope a call stays on the steady-state jit; in another strategy's scope it
    is TF's mixing error; inside a merge_call it runs fn in the merged replica context."""
    x = np.ones((4, 3), np.float32)
    xd = _batch(strategy, x)
    with strategy.scope():
        w = jnp.arange(3.0)

    def step(w, xb):  # arrays only: served by the steady-state jit
        return _step(w, xb, 2.0)

    for _ in range(3):
        strategy.run(step, args=(w, xd))
    assert strategy.extended._tree_calls.get((step, ()))
    with strategy.scope():  # the scope's context mesh is part of jit's key: one more trace
        strategy.run(step, args=(w, xd))
        versions = strategy.extended._compiled_versions(step)
        for _ in range(3):
            out = strategy.run(step, args=(w, xd))
    np.testing.assert_allclose(strategy.experimental_local_results(out)[0],
                               _expected(w, x, 2.0))
    assert strategy.extended._compiled_versions(step) == versions
    other = jaxdist.MirroredStrategy(first_devices(2))
    with other.scope(), pytest.raises(RuntimeError, match="Mixing different tf.distribute"):
        strategy.run(step, args=(w, xd))
    assert strategy.extended._tree_calls.get((step, ()))  # still served by its jit

    contexts = []

    def record(v):
        contexts.append(jaxdist.get_replica_context())
        return v * 2

    for _ in range(3):  # record's steady-state jit exists before the merge below uses it
        strategy.run(record, args=(w,))
    assert strategy.extended._tree_calls.get((record, ()))
    contexts.clear()

    def merged(strategy_, value):
        return strategy_.run(record, args=(value,))

    def step_with_merge(v):
        ctx = jaxdist.get_replica_context()
        out = ctx.merge_call(merged, args=(v,))
        assert contexts and contexts[-1] is ctx  # fn ran in the replica context it came from
        return out

    out = strategy.run(step_with_merge, args=(w,))
    np.testing.assert_allclose(strategy.experimental_local_results(out)[0], np.asarray(w) * 2)
