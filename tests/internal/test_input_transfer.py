"""transfer.put gives what jax.device_put gives: the same values, dtypes, shardings, and arrays
that do not follow later writes to the host array."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jaxdist._src.input import transfer
from tests.devutil import first_devices


def _arrays():
    rng = np.random.default_rng(0)
    return [
        rng.normal(size=(8, 3, 5)).astype(np.float32),
        rng.normal(size=(8, 2)),  # float64: canonicalised as device_put does
        rng.integers(0, 9, (8,)).astype(np.int64),
        rng.integers(0, 2, (8, 4)).astype(bool),
        np.zeros((8, 0), np.float32),  # an empty trailing axis
    ]


def _shardings(n):
    devices = first_devices(n)
    mesh = Mesh(np.array(devices), ("replica",))
    return {
        "split": NamedSharding(mesh, P("replica")),
        "replicated": NamedSharding(mesh, P()),
    }


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["split", "replicated"])
def test_put_matches_device_put(n, kind):
    sharding = _shardings(n)[kind]
    arrays = _arrays()
    got = transfer.put(arrays, sharding)
    want = jax.device_put(arrays, sharding)
    assert len(got) == len(arrays)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (g.sharding, w.sharding)
        assert g.committed
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        for shard_g, shard_w in zip(sorted(g.addressable_shards, key=lambda s: s.device.id),
                                    sorted(w.addressable_shards, key=lambda s: s.device.id)):
            assert shard_g.device == shard_w.device and shard_g.index == shard_w.index
            np.testing.assert_array_equal(np.asarray(shard_g.data), np.asarray(shard_w.data))


@pytest.mark.parametrize("n", [1, 2])
def test_later_writes_to_the_host_array_do_not_reach_the_device_array(n):
    sharding = _shardings(n)["split"]
    host = np.ones((8, 16), np.float32)
    view = host[:4]  # a view into a larger buffer, as a dataset's batch slices are
    (a, b) = transfer.put([host, view], sharding)
    host[...] = 7.0
    assert float(np.asarray(a).max()) == 1.0 and float(np.asarray(b).max()) == 1.0


def test_single_device_sharding_and_empty_list():
    device = first_devices(1)[0]
    (x,) = transfer.put([np.arange(5, dtype=np.int32)], SingleDeviceSharding(device))
    assert x.devices() == {device} and x.tolist() == [0, 1, 2, 3, 4]
    assert transfer.put([], SingleDeviceSharding(device)) == []
