"""OneDeviceStrategy, TPUStrategy (on CPU devices), TPU entry points."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from devutil import device_string

import jaxdist
from jaxdist.cluster_resolver import TPUClusterResolver, TPUNotFoundError


def test_one_device_places_state_and_runs():
    last = len(jax.devices()) - 1  # not the default device where there are several
    s = jaxdist.OneDeviceStrategy(device_string(last))
    assert s.num_replicas_in_sync == 1
    with s.scope():
        w = jnp.ones(3)
    assert w.devices() == {jax.devices()[last]}
    xd = next(iter(s.experimental_distribute_dataset([np.ones((4, 3), np.float32)])))
    out = s.run(lambda w, x: x @ w, args=(w, xd))
    np.testing.assert_allclose(
        np.concatenate([np.asarray(p) for p in s.experimental_local_results(out)]), 3.0
    )
    assert float(s.reduce("SUM", out, axis=0)) == 12.0


@pytest.mark.platform("cpu")  # no GPU there
def test_one_device_unknown_device():
    with pytest.raises(ValueError, match="Available devices"):
        jaxdist.OneDeviceStrategy("/gpu:0")


def test_tpu_strategy_without_tpu_says_what_was_found():
    if jax.default_backend() == "tpu":
        pytest.skip("needs a machine without a TPU")
    with pytest.raises(TPUNotFoundError) as e:
        jaxdist.TPUStrategy()
    assert "No TPU found" in str(e.value) and jax.default_backend() in str(e.value)
    with pytest.raises(TPUNotFoundError):
        jaxdist.tpu.initialize_tpu_system()
    with pytest.raises(TPUNotFoundError):
        jaxdist.experimental_connect_to_cluster(TPUClusterResolver(tpu="local"))
    assert TPUClusterResolver().num_accelerators() == {}


@pytest.mark.devices(4)
def test_tpu_strategy_on_cpu_devices():
    resolver = TPUClusterResolver(tpu="local")
    devs = jax.devices()[:4]  # 4, or fewer where fewer devices exist
    n = len(devs)
    s = jaxdist.TPUStrategy(resolver, devices=devs)
    assert s.cluster_resolver is resolver
    assert s.num_replicas_in_sync == n
    with s.scope():
        w = jnp.ones(2)
    assert w.sharding.is_fully_replicated and len(w.addressable_shards) == n
    v = s.experimental_distribute_values_from_function(
        lambda c: np.float32(c.replica_id_in_sync_group)
    )
    total = s.run(lambda v: jaxdist.get_replica_context().all_reduce("SUM", v), args=(v,))
    assert float(total) == n * (n - 1) / 2


def test_one_replica_run_returns_plain_arrays_like_tf_regroup():
    last = len(jax.devices()) - 1
    s = jaxdist.OneDeviceStrategy(device_string(last))
    xd = next(iter(s.experimental_distribute_dataset([np.arange(4.0, dtype=np.float32)])))
    out = s.run(
        lambda x: (x * 2, jaxdist.get_replica_context().replica_id_in_sync_group), args=(xd,)
    )
    assert not isinstance(out[0], jaxdist.PerReplica)
    np.testing.assert_allclose(out[0], [0.0, 2.0, 4.0, 6.0])
    assert int(out[1]) == 0
    assert out[0].devices() == {jax.devices()[last]}
