"""Each cross-device op is a different communication pattern giving the same numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from devutil import device_string

import jaxdist

OPS = {
    "nccl": lambda: jaxdist.NcclAllReduce(),
    "nccl_packs3": lambda: jaxdist.NcclAllReduce(num_packs=3),
    "nccl_nopack": lambda: jaxdist.NcclAllReduce(num_packs=0),
    "hierarchical": lambda: jaxdist.HierarchicalCopyAllReduce(),
    "hierarchical_packs2": lambda: jaxdist.HierarchicalCopyAllReduce(num_packs=2),
    "one_device": lambda: jaxdist.ReductionToOneDevice(),
    "one_device_last": lambda: jaxdist.ReductionToOneDevice(
        reduce_to_device=device_string(len(jax.devices()) - 1)),
}


def _values(s):
    def fn(ctx):
        i = ctx.replica_id_in_sync_group
        return {
            "a": np.full((3, 2), i + 1, np.float32),
            "b": np.arange(5, dtype=np.float32) * i,
            "c": np.int32(i),
        }

    return s.experimental_distribute_values_from_function(fn)


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_all_reduce_same_numbers(name, op):
    s = jaxdist.MirroredStrategy(cross_device_ops=OPS[name]())
    v = _values(s)
    out = s.run(lambda t: jaxdist.get_replica_context().all_reduce(op, t), args=(v,))
    n = s.num_replicas_in_sync  # every device
    sums = {
        "a": np.full((3, 2), n * (n + 1) / 2),
        "b": np.arange(5) * (n * (n - 1) / 2),
        "c": n * (n - 1) / 2,
    }
    for k, want in sums.items():
        assert isinstance(out[k], jax.Array), f"{k} should be one replicated array"
        want = np.asarray(want) / (n if op == "MEAN" else 1)
        if k == "c":  # integer values keep their dtype: the mean truncates
            want = np.trunc(want)
        np.testing.assert_allclose(np.asarray(out[k], np.float64), want, rtol=1e-6)
    assert out["c"].dtype == jnp.int32
    red = s.reduce(op, v["a"], axis=None)
    np.testing.assert_allclose(red, np.asarray(sums["a"]) / (n if op == "MEAN" else 1))


def _hlo(s):
    v = _values(s)
    fn = lambda t: jaxdist.get_replica_context().all_reduce("SUM", t)  # noqa: E731
    s.run(fn, args=(v,))
    compiled = next(iter(s.extended._run_cache.values()))
    stacked = [x.stacked for x in jax.tree.leaves(v, is_leaf=lambda x: hasattr(x, "stacked"))]
    return compiled.jitted.lower(*stacked).as_text()


@pytest.mark.devices(8)
def test_patterns_differ():
    nccl = _hlo(jaxdist.MirroredStrategy(cross_device_ops=jaxdist.NcclAllReduce(num_packs=1)))
    hier = _hlo(jaxdist.MirroredStrategy(cross_device_ops=jaxdist.HierarchicalCopyAllReduce()))
    one = _hlo(jaxdist.MirroredStrategy(cross_device_ops=jaxdist.ReductionToOneDevice()))
    # NcclAllReduce packs same-dtype leaves: one all-reduce for the f32 pack, one for int32.
    assert nccl.count("all_reduce") == 2 and "collective_permute" not in nccl
    # Hierarchical: two levels, twice as many (smaller-group) all-reduces.
    assert hier.count("all_reduce") == 4
    # ReductionToOneDevice: point-to-point sends to the target, then a broadcast.
    assert one.count("collective_permute") == 3 * 7


@pytest.mark.devices(8)
def test_hierarchical_mesh_is_two_level():
    s = jaxdist.MirroredStrategy(cross_device_ops=jaxdist.HierarchicalCopyAllReduce())
    assert s.extended.mesh.shape == {"replica_outer": 2, "replica_inner": 4}
    assert s.num_replicas_in_sync == 8
    small = jaxdist.MirroredStrategy(jax.devices()[:2], jaxdist.HierarchicalCopyAllReduce())
    assert small.extended.mesh.shape == {"replica_outer": 1, "replica_inner": 2}


@pytest.mark.devices(4)
def test_reduction_to_one_device_accumulation_fn():
    calls = []

    def acc(values):
        calls.append(len(values))
        return sum(values[1:], values[0])

    s = jaxdist.MirroredStrategy(
        jax.devices()[:4], jaxdist.ReductionToOneDevice(accumulation_fn=acc)
    )
    v = s.experimental_distribute_values_from_function(
        lambda c: np.float32(c.replica_id_in_sync_group)
    )
    out = s.run(lambda x: jaxdist.get_replica_context().all_reduce("SUM", x), args=(v,))
    assert float(out) == 6.0
    assert calls and all(c == 4 for c in calls)


@pytest.mark.devices(7)
def test_reduce_to_device_outside_the_strategy_devices():
    # As in TF, the accumulating device may be outside the compute devices (the host CPU while
    # the replicas run elsewhere): cross-replica reductions really gather there.
    s = jaxdist.MirroredStrategy(
        jax.devices()[:2], jaxdist.ReductionToOneDevice(reduce_to_device=device_string(5))
    )
    v = s.experimental_distribute_values_from_function(
        lambda c: np.float32(c.replica_id_in_sync_group + 1)
    )
    assert float(s.reduce("SUM", v, axis=None)) == 3.0
    assert float(s.reduce("MEAN", v, axis=None)) == 1.5
    out = s.extended.reduce_to("SUM", v, device_string(6))
    assert float(out) == 3.0 and out.sharding.device_set == {jax.devices()[6]}
    inside = s.run(lambda x: jaxdist.get_replica_context().all_reduce("MEAN", x), args=(v,))
    assert float(inside) == 1.5


def test_invalid_arguments():
    with pytest.raises(ValueError, match="does not exist"):
        jaxdist.ReductionToOneDevice(reduce_to_device="/cpu:99")
    with pytest.raises(ValueError, match="num_packs"):
        jaxdist.NcclAllReduce(num_packs=-1)
    with pytest.raises(TypeError, match="cross_device_ops must be"):
        jaxdist.MirroredStrategy(cross_device_ops="nccl")


@pytest.mark.devices(8)
def test_reduce_to_every_tf_destination():
    devs = jax.devices()[:2]
    s = jaxdist.MirroredStrategy(devs)
    v = s.experimental_distribute_values_from_function(
        lambda c: np.float32(c.replica_id_in_sync_group + 1)
    )
    cases = {
        "string": (device_string(5), {jax.devices()[5]}),
        "device": (jax.devices()[6], {jax.devices()[6]}),
        "list": ([device_string(3), device_string(4)], {jax.devices()[3], jax.devices()[4]}),
        "mirrored": (s.place(jnp.zeros(())), set(devs)),
        "per_replica": (v, set(devs)),
        "none": (None, set(devs)),
    }
    for name, (dest, want) in cases.items():
        out = s.extended.reduce_to("SUM", v, dest)
        assert float(out) == 3.0, name
        assert out.sharding.device_set == want, name
        assert out.sharding.is_fully_replicated, name
    a, b = s.extended.batch_reduce_to(
        "MEAN", [(v, device_string(7)), (v, [device_string(0), device_string(1)])])
    assert float(a) == float(b) == 1.5
    with pytest.raises(ValueError, match="can not be empty"):
        s.extended.reduce_to("SUM", v, [])
    with pytest.raises(ValueError, match="destinations must be"):
        s.extended.reduce_to("SUM", v, {"bad": 1})
    with pytest.raises(ValueError, match="pairs"):
        s.extended.batch_reduce_to("SUM", [v])


@pytest.mark.devices(4)
def test_broadcast_to():
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    # Python numbers as they are (TF)
    assert s.extended.broadcast_to(1.5, [device_string(0)]) == 1.5
    out = s.extended.broadcast_to(jnp.arange(3.0), [device_string(2), device_string(3)])
    assert out.sharding.device_set == {jax.devices()[2], jax.devices()[3]}
    np.testing.assert_array_equal(out, [0.0, 1.0, 2.0])
    out = s.extended.broadcast_to(jnp.ones(2), None)
    assert out.sharding.device_set == set(jax.devices()[:2])


@pytest.mark.devices(8)
def test_reduce_to_outside_device_with_axis():
    s = jaxdist.MirroredStrategy(
        jax.devices()[:2], jaxdist.ReductionToOneDevice(reduce_to_device=device_string(7))
    )
    v = s.experimental_distribute_values_from_function(
        lambda c: np.arange(3, dtype=np.float32) + c.replica_id_in_sync_group
    )
    assert float(s.reduce("SUM", v, axis=0)) == 3.0 + 6.0
    assert float(s.reduce("MEAN", v, axis=0)) == 9.0 / 6
