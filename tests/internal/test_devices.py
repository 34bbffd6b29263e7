"""TF device strings resolve to JAX devices; unknown devices list what exists."""

import jax
import pytest
from devutil import cpu_devices
from devutil import device_string as default_device_string

import jaxdist
from jaxdist._src.strategies.devices import device_string, resolve_device


@pytest.mark.parametrize(
    "spec,index",
    [
        ("/cpu:0", 0),
        ("/cpu:3", 3),
        ("CPU:1", 1),
        ("/device:CPU:2", 2),
        ("/job:worker/task:0/device:CPU:5", 5),
        ("/job:localhost/replica:0/task:0/device:CPU:7", 7),
    ],
)
def test_tf_strings(spec, index):
    want = cpu_devices(index + 1)[index]
    assert resolve_device(spec) == want


def test_jax_device_passes_through():
    d = jax.devices()[-1]
    assert resolve_device(d) is d


@pytest.mark.parametrize(
    "spec", ["/gpu:0", "/device:TPU:0", "/cpu:99", "/job:worker/task:3/device:CPU:0"]
)
@pytest.mark.platform("cpu")  # no GPU or TPU, and the CPU devices are listed
def test_absent_device_lists_available(spec):
    with pytest.raises(ValueError) as e:
        jaxdist.MirroredStrategy([spec])
    msg = str(e.value)
    assert spec in msg and "Available devices" in msg and "/cpu:0" in msg


@pytest.mark.parametrize("spec", ["gpu0", "/xpu:0", "/cpu"])
def test_malformed_or_unknown_type(spec):
    with pytest.raises(ValueError, match="Available devices"):
        resolve_device(spec)


def test_duplicates_rejected():
    with pytest.raises(ValueError, match="duplicates"):
        jaxdist.MirroredStrategy([default_device_string(0), default_device_string(0)])


def test_device_string_round_trip():
    for d in jax.devices():
        assert resolve_device(device_string(d)) == d


def test_mirrored_default_uses_all_local_devices(devices):
    s = jaxdist.MirroredStrategy()
    assert s.num_replicas_in_sync == len(devices)
    assert s.extended.worker_devices == tuple(devices)
