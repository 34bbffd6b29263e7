"""How a test states the devices it needs (see tests/conftest.py): skip, with the reason,
when they are absent; never assume CPU or a device count silently."""

import os
import re

import jax
import pytest

_PLATFORM_ALIASES = {"cuda": "gpu", "rocm": "gpu"}


# A test whose claim includes a wall-clock bound (a call at most 1 s slower, a timeout within a
# second of its deadline) runs as two cases: the plain one checks what happened (the call
# succeeded, the typed error came, the socket closed), under a generous hang guard; the
# `timing` one (deselected by default, see pyproject.toml) holds the bound too:
#     @pytest.mark.parametrize("precise", PRECISE)
#     def test_x(precise): ... ; if precise: assert took < 1.0
PRECISE = [False, pytest.param(True, marks=pytest.mark.timing, id="precise")]


def xla_flags(devices: int | None = None) -> str:
    """``XLA_FLAGS`` for a process a test starts: the suite's optimisation level (level 0 on
    CPU, see tests/conftest.py), so the process compiles as the suite does, and with
    ``devices``, that many forced host CPU devices (without it, the process's own count)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if f.startswith("--xla_backend_optimization_level")]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)


def restore_environ(saved: dict[str, str]) -> None:
    """Puts ``os.environ`` back to ``saved``, touching only the variables that differ.

    Clearing and refilling it would unset and set every variable while C++ threads of this
    process (XLA's, gRPC's) may read the environment: glibc's environment is not thread-safe,
    and such a read during the rebuild can crash the process (seen once: a segfault in a pytest
    process between two docstring modules)."""
    for key in [k for k in os.environ if k not in saved]:
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def require_devices(n: int) -> None:
    """Skips the calling test when the default backend has fewer than ``n`` devices."""
    have = len(jax.devices())
    if have < n:
        on_cpu = jax.default_backend() == "cpu"
        hint = f" (JAX_NUM_CPU_DEVICES={max(n, 8)} gives more)" if on_cpu else ""
        pytest.skip(f"needs {n} devices, {have} available{hint}")


def require_platform(name: str) -> None:
    """Skips the calling test unless the default backend is ``name`` ('cpu', 'gpu', 'tpu')."""
    want = _PLATFORM_ALIASES.get(name, name)
    have = _PLATFORM_ALIASES.get(jax.default_backend(), jax.default_backend())
    if have != want:
        pytest.skip(f"needs the {want} platform, the default backend is {have}")


def first_devices(n: int) -> list:
    """The first ``n`` devices of the default backend (the test is skipped if fewer exist)."""
    require_devices(n)
    return jax.devices()[:n]


def cpu_devices(n: int | None = None) -> list:
    """The first ``n`` host CPU devices, all of them if ``n`` is None (the test is skipped if
    the CPU backend is not initialised, e.g. under JAX_PLATFORMS=cuda, or has fewer devices)."""
    try:
        cpus = jax.devices("cpu")
    except RuntimeError as e:
        pytest.skip(f"needs the host CPU backend ({e}); run with JAX_PLATFORMS=<platform>,cpu")
    if n is None:
        return cpus
    if len(cpus) < n:
        pytest.skip(f"needs {n} CPU devices, {len(cpus)} available "
                    f"(JAX_NUM_CPU_DEVICES={max(n, 8)} gives more)")
    return cpus[:n]


def device_string(index: int) -> str:
    """The TF device string (``"/cpu:3"``, ``"/gpu:3"``) of the default backend's device
    ``index`` (the test is skipped if it does not exist)."""
    require_devices(index + 1)
    platform = _PLATFORM_ALIASES.get(jax.default_backend(), jax.default_backend())
    return f"/{platform}:{index}"


_TF_DEVICE = re.compile(r"^/cpu:(\d+)$")


def tf_test_device(spec):
    """A device as TF's ported tests (tests/tf_compat) name it: ``"/cpu:0"`` is TF's CPU and
    ``"/cpu:k"`` (k > 0) TF's GPU k-1, i.e. the default backend's device k; the test is skipped
    when that device does not exist (as TF skips a combination whose GPUs are absent). Any other
    spec (a ``jax.Device``, ``"/device:CPU:0"``) is returned as it is."""
    m = _TF_DEVICE.match(spec) if isinstance(spec, str) else None
    if m is None:
        return spec
    index = int(m.group(1))
    require_devices(index + 1)
    return jax.devices()[index]


def tf_test_devices(specs) -> list:
    """:func:`tf_test_device` of each spec."""
    return [tf_test_device(s) for s in specs]


class DocstringExamplesSkipped(UserWarning):
    """Some docstrings' examples did not run here (they need more devices, or libtpu).

    Defined here, not in the test module: pytest-xdist re-creates a worker's warning in the
    controlling process by importing the module of its class, and test modules are not
    importable there (``tests/`` is, through the conftest).
    """
