"""Gradients through ReplicaContext.all_reduce are TF's, and double reductions fail loudly.

TF's expected values come from tensorflow/python/distribute/strategy_test_lib.py
(``_test_all_reduce_{sum,mean}_gradient_tape`` of ``TwoDeviceDistributionTestBase``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from devutil import first_devices

import jaxdist
from jaxdist import DoubleReductionError


@pytest.fixture(scope="module")
def two():
    return jaxdist.MirroredStrategy(first_devices(2))  # TF's TwoDeviceDistributionTestBase


def _per_replica(strategy, values):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(values[ctx.replica_id_in_sync_group])
    )


@pytest.mark.parametrize("op,expected", [("SUM", [4.0, 4.0]), ("MEAN", [2.0, 2.0])])
def test_gradient_tape_through_all_reduce_matches_tf(two, op, expected):
    c = _per_replica(two, [1.0, 3.0])

    def step(c):
        ctx = jaxdist.get_replica_context()
        x = jnp.float32(42.0)  # created inside the replica fn, as TF's array_ops.identity(42.)
        return jax.grad(lambda x: ctx.all_reduce(op, x) * c)(x)

    got = [float(v) for v in two.experimental_local_results(two.run(step, args=(c,)))]
    assert got == expected


@pytest.mark.parametrize("op,expected", [("SUM", [4.0, 4.0]), ("MEAN", [2.0, 2.0])])
def test_gradient_of_reduced_per_replica_value_matches_tf(two, op, expected):
    """x varies per replica, the upstream gradient is the same constant on each replica."""
    v = _per_replica(two, [1.0, 3.0])

    def step(v):
        ctx = jaxdist.get_replica_context()
        return jax.grad(lambda x: ctx.all_reduce(op, x) * 2.0)(v)

    got = [float(g) for g in two.experimental_local_results(two.run(step, args=(v,)))]
    assert got == expected


def test_gradient_of_all_reduced_loss_is_tfs(two):
    """TF: d all_reduce(SUM, x*x)/dx = all_reduce(SUM, 1) * 2x = 2 * 2x on 2 replicas."""
    v = _per_replica(two, [1.0, 3.0])

    def step(v):
        ctx = jaxdist.get_replica_context()
        loss, g = jax.value_and_grad(lambda x: ctx.all_reduce("SUM", x * x))(v)
        return loss, g

    loss, g = two.run(step, args=(v,))
    assert [float(x) for x in two.experimental_local_results(g)] == [4.0, 12.0]
    assert [float(x) for x in two.experimental_local_results(loss)] == [10.0, 10.0]


def test_forward_all_reduce_of_constants_and_values_as_tf(two):
    """TF's _test_all_reduce_sum/_mean: constants (same on every replica) count once per replica."""
    c = _per_replica(two, [1.0, 3.0])

    def step(op):
        def fn(c):
            ctx = jaxdist.get_replica_context()
            return ctx.all_reduce(op, c), ctx.all_reduce(op, jnp.float32(4.0))

        return fn

    assert [float(x) for x in two.run(step("SUM"), args=(c,))] == [4.0, 8.0]
    assert [float(x) for x in two.run(step("MEAN"), args=(c,))] == [2.0, 4.0]


def _double(op):
    def step(params, x):
        ctx = jaxdist.get_replica_context()
        grads = jax.grad(lambda p: jnp.sum(x @ p["w"]))(params)  # already summed by JAX
        grads = jax.tree.map(lambda g: 0.5 * g, grads)
        return ctx.all_reduce(op, grads)

    return step


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_all_reduce_of_grad_wrt_replicated_state_raises(two, op):
    params = two.place({"w": jnp.ones(3)})
    x = two.experimental_distribute_values_from_function(
        lambda ctx: np.full((2, 3), ctx.replica_id_in_sync_group + 1.0, np.float32)
    )
    with pytest.raises(DoubleReductionError) as err:
        two.run(_double(op), args=(params, x))
    msg = str(err.value)
    assert "double reduction" in msg and "['w']" in msg
    assert "drop the all_reduce" in msg and "ctx.local(params)" in msg


def test_both_fixes_give_the_same_gradient(two):
    params = two.place({"w": jnp.ones(3)})
    x = two.experimental_distribute_values_from_function(
        lambda ctx: np.full((2, 3), ctx.replica_id_in_sync_group + 1.0, np.float32)
    )

    def local(params, x):
        ctx = jaxdist.get_replica_context()
        g = jax.grad(lambda p: jnp.sum(x @ p["w"]))(ctx.local(params))
        return ctx.all_reduce("SUM", g)

    def summed(params, x):
        return jax.grad(lambda p: jnp.sum(x @ p["w"]))(params)

    a, b = two.run(local, args=(params, x)), two.run(summed, args=(params, x))
    np.testing.assert_allclose(a["w"], [6.0, 6.0, 6.0])
    np.testing.assert_allclose(b["w"], [6.0, 6.0, 6.0])


def test_all_reduce_of_reduced_value_made_of_all_reduce_keeps_tf_meaning(two):
    """all_reduce(all_reduce(x)) is not a hidden double reduction: TF gives N * sum."""
    c = _per_replica(two, [1.0, 3.0])

    def step(c):
        ctx = jaxdist.get_replica_context()
        return ctx.all_reduce("SUM", ctx.all_reduce("SUM", c))

    assert float(two.run(step, args=(c,))) == 8.0


def test_forward_mode_through_all_reduce(two):
    """jax.jvp: the tangent of an all-reduce is the all-reduce of the tangents."""
    v = _per_replica(two, [1.0, 3.0])

    def step(v):
        ctx = jaxdist.get_replica_context()
        f = lambda x: ctx.all_reduce("SUM", x * x)  # noqa: E731
        return jax.jvp(f, (v,), (jnp.ones_like(v),))[1]

    assert float(two.run(step, args=(v,))) == 8.0  # 2*1 + 2*3
