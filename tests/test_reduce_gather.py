"""reduce, gather, experimental_local_results, value functions, ReduceOp."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from devutil import device_string, first_devices

import jaxdist
from jaxdist import PerReplica, ReduceOp


@pytest.fixture
def strategy():
    return jaxdist.MirroredStrategy(first_devices(4))  # the tests' numbers are for 4 replicas


def _values(strategy):
    # replica i holds [[i, i+1, i+2], [10*i, 10*i, 10*i]] (shape (2, 3))
    def value_fn(ctx):
        i = ctx.replica_id_in_sync_group
        return np.array([[i, i + 1, i + 2], [10 * i] * 3], np.float32)

    return strategy.experimental_distribute_values_from_function(value_fn)


def _stack(strategy, v):
    return np.stack([np.asarray(p) for p in strategy.experimental_local_results(v)])


def test_reduce_op_accepts_strings():
    assert ReduceOp.from_value("SUM") is ReduceOp.SUM
    assert ReduceOp.from_value("mean") is ReduceOp.MEAN
    with pytest.raises(ValueError, match="Unknown reduce op 'MAX'"):
        ReduceOp.from_value("MAX")


def test_value_function_gets_context(strategy):
    seen = []
    v = strategy.experimental_distribute_values_from_function(
        lambda ctx: (
            seen.append((ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync))
            or jnp.float32(ctx.replica_id_in_sync_group)
        )
    )
    assert seen == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert isinstance(v, PerReplica)
    locals_ = strategy.experimental_local_results(v)
    assert [float(x) for x in locals_] == [0.0, 1.0, 2.0, 3.0]
    # each replica's value lives on that replica's device
    assert [list(x.devices())[0] for x in locals_] == list(strategy.extended.worker_devices)


@pytest.mark.parametrize("op", ["SUM", "MEAN", ReduceOp.SUM, ReduceOp.MEAN])
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_reduce(strategy, op, axis):
    v = _values(strategy)
    ref = _stack(strategy, v)
    op = ReduceOp.from_value(op)
    got = strategy.reduce(op, v, axis=axis)
    axes = (0,) if axis is None else (0, 1 + axis % 2)
    want = ref.sum(axis=axes) if op is ReduceOp.SUM else ref.mean(axis=axes)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got.sharding.is_fully_replicated


def test_reduce_pytree_and_mirrored(strategy):
    v = _values(strategy)
    with strategy.scope():
        m = jnp.float32(3.0)
    out = strategy.reduce("SUM", {"v": v, "m": m})
    assert float(out["m"]) == 12.0  # a mirrored value counts once per replica
    assert float(strategy.reduce("MEAN", m)) == 3.0


def test_reduce_non_distributed_value_follows_tf(strategy):
    assert strategy.reduce("MEAN", 5.0) == 5.0
    with pytest.raises(ValueError, match="non-distributed value"):
        strategy.reduce("SUM", np.float32(5.0))
    one = jaxdist.OneDeviceStrategy(device_string(0))
    assert float(one.reduce("SUM", np.float32(5.0))) == 5.0


def test_reduce_axis_out_of_range(strategy):
    with pytest.raises(ValueError, match="out of range"):
        strategy.reduce("SUM", _values(strategy), axis=2)


@pytest.mark.parametrize("axis", [0, 1])
def test_gather(strategy, axis):
    v = _values(strategy)
    ref = _stack(strategy, v)
    got = strategy.gather(v, axis=axis)
    want = np.concatenate(list(ref), axis=axis)
    np.testing.assert_allclose(got, want)


def test_gather_scalar_per_replica_is_an_error(strategy):
    v = strategy.experimental_distribute_values_from_function(lambda c: jnp.float32(1.0))
    with pytest.raises(ValueError, match="rank >= 1"):
        strategy.gather(v, axis=0)


def test_all_gather_in_replica_context(strategy):
    v = _values(strategy)
    out = strategy.run(lambda x: jaxdist.get_replica_context().all_gather(x, axis=0), args=(v,))
    assert isinstance(out, jax.Array)  # identical on every replica
    np.testing.assert_allclose(out, np.concatenate(list(_stack(strategy, v)), axis=0))


def test_local_results(strategy):
    with strategy.scope():
        m = jnp.arange(3.0)
    parts = strategy.experimental_local_results(m)
    assert len(parts) == 4
    assert {list(p.devices())[0] for p in parts} == set(strategy.extended.worker_devices)
    for p in parts:
        np.testing.assert_allclose(p, np.arange(3.0))
    assert strategy.experimental_local_results(np.float32(2.0)) == (np.float32(2.0),)
    tree = strategy.experimental_local_results({"a": _values(strategy), "b": m})
    assert len(tree) == 4 and set(tree[0]) == {"a", "b"}


def test_extended_reduce_to_and_batch_reduce_to(strategy):
    v = _values(strategy)
    ref = _stack(strategy, v)
    out = strategy.extended.reduce_to("SUM", v, destinations=device_string(0))
    assert out.devices() == {jax.devices()[0]}
    np.testing.assert_allclose(out, ref.sum(0))
    a, b = strategy.extended.batch_reduce_to("MEAN", [(v, None), (v, device_string(1))])
    np.testing.assert_allclose(a, ref.mean(0))
    assert b.devices() == {jax.devices()[1]}


def _cpu_outside(devices):
    """A CPU device that is not one of ``devices`` (the host CPU when they are accelerators)."""
    outside = [d for d in jax.devices("cpu") if d not in devices]
    if not outside:
        pytest.skip("needs a CPU device outside the strategy's devices")
    return outside[-1]


@pytest.mark.parametrize("cdo", ["default", "one_device_outside"])
@pytest.mark.devices(2)
def test_reduce_to_a_cpu_device_outside_the_mesh_in_the_cross_replica_context(cdo):
    # TF: the result of reduce_to lands on the destination, whichever device it is. Inside
    # scope() (the replica mesh is JAX's context mesh) this used to fail with "incompatible
    # devices" wherever the reduction computed on a device outside the mesh.
    devs = jax.devices()[:2]
    dest = _cpu_outside(devs)
    ops = None if cdo == "default" else jaxdist.ReductionToOneDevice(reduce_to_device=dest)
    s = jaxdist.MirroredStrategy(devs, cross_device_ops=ops)
    v = s.experimental_distribute_values_from_function(
        lambda c: np.arange(3, dtype=np.float32) + c.replica_id_in_sync_group)
    host = jax.device_put(np.arange(3, dtype=np.float32), dest)  # a non-distributed value
    with s.scope():
        m = jnp.ones(3)
        for op, want in (("SUM", [1.0, 3.0, 5.0]), ("MEAN", [0.5, 1.5, 2.5])):
            for d in (dest, f"/cpu:{dest.id}", [dest]):
                out = s.extended.reduce_to(op, v, destinations=d)
                assert out.devices() == {dest}, (op, d)
                np.testing.assert_allclose(out, want)
            out = s.extended.reduce_to(op, {"v": v, "m": m}, destinations=dest)
            assert {x.devices().pop() for x in jax.tree.leaves(out)} == {dest}
            np.testing.assert_allclose(out["m"], np.ones(3) * (2 if op == "SUM" else 1))
            (a,) = s.extended.batch_reduce_to(op, [(v, dest)])
            np.testing.assert_allclose(a, want)
            np.testing.assert_allclose(s.reduce(op, v, axis=0), sum(want) / (
                1 if op == "SUM" else 3))
        assert float(s.reduce("MEAN", host, axis=0)) == 1.0
        out = s.extended.reduce_to("SUM", v, destinations=None)  # replicated on the replicas
        assert out.devices() == set(devs) and out.sharding.is_fully_replicated
        # TF's CrossDeviceOps API in the cross-replica context
        cross = s.extended.cross_device_ops.reduce("SUM", v, destinations=dest)
        np.testing.assert_allclose(cross, [1.0, 3.0, 5.0])
        assert cross.devices() == {dest}


def test_extended_update_and_call_for_each_replica(strategy):
    with strategy.scope():
        w = jnp.ones(3)
    new = strategy.extended.update(w, lambda w, g: w - 0.5 * g, args=(jnp.ones(3),))
    np.testing.assert_allclose(new, 0.5 * np.ones(3))
    assert new.sharding.is_fully_replicated
    with pytest.raises(ValueError, match="PerReplica"):
        strategy.extended.update(w, lambda w, g: w - g, args=(_values(strategy),))
    out = strategy.extended.call_for_each_replica(
        lambda: jaxdist.get_replica_context().replica_id_in_sync_group
    )
    assert [int(x) for x in out.values] == [0, 1, 2, 3]
    with strategy.extended.colocate_vars_with(w):
        with strategy.scope():
            z = jnp.zeros(2)
    assert z.sharding.is_fully_replicated
