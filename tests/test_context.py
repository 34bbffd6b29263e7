"""Context stack: get_strategy, has_strategy, replica / cross-replica contexts, scopes."""

import jax
import jax.numpy as jnp
import pytest

import jaxdist


def test_default_strategy_outside_scope():
    s = jaxdist.get_strategy()
    assert isinstance(s, jaxdist.Strategy) and type(s).__name__ == "DefaultStrategy"
    assert s is jaxdist.get_strategy(), "default strategy must be a singleton"
    assert not jaxdist.has_strategy()
    assert not jaxdist.in_cross_replica_context()
    rctx = jaxdist.get_replica_context()
    assert rctx is not None and rctx.num_replicas_in_sync == 1
    assert s.num_replicas_in_sync == 1
    assert s.cluster_resolver is None


def test_default_strategy_run_is_pass_through():
    s = jaxdist.get_strategy()
    calls = []

    def fn(x, y=0):
        calls.append(type(x))
        return x + y

    assert s.run(fn, args=(1,), kwargs={"y": 2}) == 3
    assert calls == [int], "the default strategy must call fn directly, untraced"
    assert s.reduce("SUM", 5.0, axis=None) == 5.0
    assert s.experimental_local_results(7) == (7,)


def test_scope_sets_strategy_and_cross_replica_context():
    s = jaxdist.MirroredStrategy()
    with s.scope() as entered:
        assert entered is s
        assert jaxdist.get_strategy() is s
        assert jaxdist.has_strategy()
        assert jaxdist.in_cross_replica_context()
        assert jaxdist.get_replica_context() is None
        assert jaxdist.get_cross_replica_context() is s
    assert not jaxdist.has_strategy()


@pytest.mark.devices(4)
def test_replica_context_inside_run():
    s = jaxdist.MirroredStrategy(jax.devices()[:4])
    seen = {}

    def fn():
        rctx = jaxdist.get_replica_context()
        seen["rctx"] = rctx
        seen["cross"] = jaxdist.in_cross_replica_context()
        seen["strategy"] = jaxdist.get_strategy()
        return rctx.replica_id_in_sync_group

    out = s.run(fn)
    n = len(jax.devices()[:4])
    assert seen["rctx"] is not None and seen["rctx"].num_replicas_in_sync == n
    assert seen["cross"] is False
    assert seen["strategy"] is s
    ids = [int(v) for v in s.experimental_local_results(out)]
    assert ids == list(range(n))


def test_same_strategy_scope_reentrant():
    s = jaxdist.MirroredStrategy()
    with s.scope(), s.scope():
        assert jaxdist.get_strategy() is s


def test_mixing_strategies_is_an_error():
    a = jaxdist.MirroredStrategy()
    b = jaxdist.OneDeviceStrategy(jax.devices()[0])
    with a.scope():
        with pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy objects"):
            with b.scope():
                pass
        assert jaxdist.get_strategy() is a


def test_scope_is_thread_local():
    import threading

    s = jaxdist.MirroredStrategy()
    seen = []
    with s.scope():
        t = threading.Thread(target=lambda: seen.append(jaxdist.has_strategy()))
        t.start()
        t.join(5)
    assert seen == [False]


def test_default_strategy_replica_context_reductions_identity():
    rctx = jaxdist.get_replica_context()
    x = jnp.arange(3.0)
    assert (rctx.all_reduce("SUM", x) == x).all()
    assert (rctx.all_gather(x, 0) == x).all()


@pytest.mark.devices(2)
def test_cross_replica_methods_raise_inside_the_replica_function():
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    v = s.experimental_distribute_values_from_function(lambda c: jnp.float32(1.0))

    def fn(x):
        s.reduce("SUM", x, axis=None)
        return x

    with pytest.raises(RuntimeError, match="requires being in cross-replica context"):
        s.run(fn, args=(v,))


@pytest.mark.devices(2)
def test_experimental_set_strategy_is_thread_local_and_replaceable():
    import threading

    a = jaxdist.MirroredStrategy(jax.devices()[:2])
    b = jaxdist.OneDeviceStrategy(jax.devices()[0])
    seen = []
    jaxdist.experimental_set_strategy(a)
    try:
        assert jaxdist.get_strategy() is a and jaxdist.in_cross_replica_context()
        t = threading.Thread(target=lambda: seen.append(jaxdist.has_strategy()))
        t.start()
        t.join(5)
        jaxdist.experimental_set_strategy(b)
        assert jaxdist.get_strategy() is b
    finally:
        jaxdist.experimental_set_strategy(None)
    assert seen == [False]
    assert not jaxdist.has_strategy()


@pytest.mark.devices(4)
def test_merge_call_in_compiled_step_reduces_and_reruns_in_replica_context():
    s = jaxdist.MirroredStrategy(jax.devices()[:4])
    v = s.experimental_distribute_values_from_function(
        lambda c: jnp.float32(c.replica_id_in_sync_group + 1)
    )
    seen = {}

    def merge_fn(strategy, x):
        seen["replica_ctx"] = jaxdist.get_replica_context()
        seen["cross"] = jaxdist.get_cross_replica_context()
        total = strategy.reduce("SUM", x, axis=None)
        mean = strategy.extended.reduce_to("MEAN", x)
        again = strategy.run(lambda y: y * 10, args=(x,))
        return total, mean, again

    out = s.run(lambda x: jaxdist.get_replica_context().merge_call(merge_fn, args=(x,)),
                args=(v,))
    total, mean, again = out
    assert seen["replica_ctx"] is None and seen["cross"] is s
    n = s.num_replicas_in_sync  # 4, or fewer where fewer devices exist
    assert float(total) == n * (n + 1) / 2 and float(mean) == (n + 1) / 2
    assert [float(a) for a in s.experimental_local_results(again)] == [
        10.0 * (i + 1) for i in range(n)]


@pytest.mark.devices(2)
def test_update_non_slot_runs_once_cross_replica_and_places_result():
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    calls = []

    def fn(step):
        calls.append(jaxdist.in_cross_replica_context())
        return step + 1

    out = s.extended.update_non_slot(None, fn, args=(jnp.int32(4),))
    assert calls == [True]
    assert int(out) == 5 and out.sharding.device_set == set(jax.devices()[:2])


def _sum_merge(strategy, x):
    return strategy.reduce("SUM", x, axis=None)


def _merge(x):
    return jaxdist.get_replica_context().merge_call(_sum_merge, args=(x,))


_CONTROL_FLOW = {
    "while_loop": lambda x: jax.lax.while_loop(lambda c: c < 2.0, _merge, x),
    "fori_loop": lambda x: jax.lax.fori_loop(0, 2, lambda i, c: _merge(c), x),
    "scan": lambda x: jax.lax.scan(lambda c, _: (_merge(c), None), x, None, length=2)[0],
    "map": lambda x: jax.lax.map(_merge, jnp.stack([x, x])),
    "cond": lambda x: jax.lax.cond(x > 0, _merge, lambda y: y, x),
    "switch": lambda x: jax.lax.switch(1, [lambda y: y, _merge], x),
}


@pytest.mark.devices(2)
@pytest.mark.parametrize("flow", sorted(_CONTROL_FLOW))
def test_merge_call_inside_control_flow_raises_at_trace_time_and_devices_stay_usable(
        devices, flow):
    # TF raises for a merge_call inside tf.while_loop / tf.cond; jaxdist raises while the step
    # is traced, so nothing is dispatched (the while_loop here would never end: the sum of 0
    # over the replicas is 0) and the next step with a collective completes.
    s = jaxdist.MirroredStrategy(devices[:2])
    v = s.experimental_distribute_values_from_function(lambda c: jnp.float32(0.0))
    with pytest.raises(RuntimeError, match="`merge_call` called while defining a new graph"):
        s.run(_CONTROL_FLOW[flow], args=(v,))
    with pytest.raises(RuntimeError, match="inside a jax.lax control-flow body"):
        s.run(jax.jit(_CONTROL_FLOW[flow]), args=(v,))  # the same under a nested jax.jit
    total = s.run(lambda x: jaxdist.get_replica_context().all_reduce("SUM", x + 1.0), args=(v,))
    assert float(jax.block_until_ready(total)) == 2.0


@pytest.mark.devices(2)
def test_merge_call_outside_control_flow_still_works(devices):
    # Not control flow: a nested jax.jit, jax.grad, jax.checkpoint around the merge_call; and a
    # replica function that is itself traced inside a user's lax.scan (strategy.run in a loop).
    s = jaxdist.MirroredStrategy(devices[:2])
    v = s.experimental_distribute_values_from_function(
        lambda c: jnp.float32(c.replica_id_in_sync_group + 1))
    assert float(s.run(jax.jit(_merge), args=(v,))) == 3.0
    assert float(s.run(jax.checkpoint(_merge), args=(v,))) == 3.0
    # (only that it traces: the gradient through a merge function's reduce is not asserted)
    grads = s.run(jax.grad(lambda x: _merge(x) * 2.0), args=(v,))
    assert len(s.experimental_local_results(grads)) == 2

    @jax.jit
    def two_steps(x):
        def body(c, _):
            return c + s.run(_merge, args=(x,)), None

        return jax.lax.scan(body, jnp.float32(0.0), None, length=2)[0]

    assert float(two_steps(v)) == 6.0


@pytest.mark.devices(2)
def test_merge_call_inside_control_flow_is_allowed_where_tf_allows_it(devices):
    # Only TF's mirrored replica threads check the graph; TF's default strategy, OneDevice and
    # TPU replica contexts run merge_fn in place (a merge_call in a loop body is traced there).
    def loop(x):
        return jax.lax.fori_loop(0, 2, lambda i, c: _merge(c) + 1.0, x)

    assert float(jax.jit(loop)(1.0)) == 3.0  # default strategy
    one = jaxdist.OneDeviceStrategy(devices[1])
    assert float(one.run(loop, args=(jnp.float32(1.0),))) == 3.0
    tpu = jaxdist.TPUStrategy(devices=devices[:2])
    # a replicated carry: each merge sums it over the 2 replicas, (1 * 2 + 1) * 2 + 1 = 7
    assert float(tpu.run(loop, args=(jnp.float32(1.0),))) == 7.0
    with pytest.raises(RuntimeError, match="defining a new graph"):
        jaxdist.MirroredStrategy(devices[:1]).run(loop, args=(jnp.float32(1.0),))


@pytest.mark.devices(4)
def test_error_while_tracing_a_replica_function_leaves_the_devices_usable(devices):
    s = jaxdist.MirroredStrategy(devices[:4])
    v = s.experimental_distribute_values_from_function(lambda c: jnp.float32(1.0))

    def broken(x):
        jaxdist.get_replica_context().all_reduce("SUM", x)  # a collective traced first
        raise ValueError("bad step")

    for attempt in (broken, jax.jit(broken)):
        with pytest.raises(ValueError, match="bad step"):
            s.run(attempt, args=(v,))
        assert jaxdist.get_replica_context() is not None  # the context stack is unwound
        assert not jaxdist.in_cross_replica_context()
    total = s.run(lambda x: jaxdist.get_replica_context().all_reduce("SUM", x), args=(v,))
    assert float(jax.block_until_ready(total)) == 4.0
