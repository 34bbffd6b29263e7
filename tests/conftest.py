"""Test configuration: force 8 CPU host devices before JAX initialises its backend."""

import os

os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Older spelling, honoured by every jaxlib; harmless when JAX_NUM_CPU_DEVICES is read.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

NUM_DEVICES = 8


@pytest.fixture(scope="session")
def devices():
    """The 8 forced CPU devices (the test is skipped, with the reason, if they are missing)."""
    require_devices(NUM_DEVICES)
    return jax.devices()[:NUM_DEVICES]


def require_devices(n: int):
    """Skips the calling test when fewer than ``n`` devices exist."""
    have = len(jax.devices())
    if have < n:
        pytest.skip(f"needs {n} devices, {have} available")


@pytest.fixture(autouse=True, scope="module")
def _restore_environment():
    """Each test module starts from the same os.environ: cluster helpers put a task's TLS paths
    and tokens there (as a real task has them), and those files go with their cluster."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
