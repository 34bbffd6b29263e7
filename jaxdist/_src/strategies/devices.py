"""TF device strings ("/gpu:0", "/job:worker/task:0/device:CPU:0") resolved to JAX devices."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax

_DEVICE_RE = re.compile(
    r"^(?:/job:(?P<job>[^/]+))?(?:/replica:(?P<replica>\d+))?(?:/task:(?P<task>\d+))?"
    r"(?:/?(?:device:)?(?P<type>[A-Za-z_]+):(?P<index>\d+))?$"
)

_PLATFORM_ALIASES = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def _describe(devs: Sequence[Any]) -> str:
    return ", ".join(f"/{d.platform}:{_platform_index(d)} ({d})" for d in devs) or "none"


def _platform_index(device: Any) -> int:
    same = [d for d in jax.local_devices(backend=device.platform)]
    return same.index(device) if device in same else device.id


def available_devices() -> list[Any]:
    """Every local device of every backend JAX can see (default backend first)."""
    out = list(jax.local_devices())
    for platform in ("cpu", "gpu", "tpu"):
        try:
            for d in jax.local_devices(backend=platform):
                if d not in out:
                    out.append(d)
        except RuntimeError:
            continue
    return out


def resolve_device(spec: Any) -> Any:
    """Returns the JAX device named by ``spec``.

    Args:
        spec: a ``jax.Device`` or a TF device string such as ``"/gpu:0"``, ``"GPU:1"``,
            ``"/device:TPU:0"`` or ``"/job:worker/task:0/device:CPU:0"``.

    Raises:
        ValueError: the string is malformed or names a device that does not exist; the message
            lists the devices that do.

    Example:
        >>> from jaxdist._src.strategies.devices import resolve_device
        >>> resolve_device("/cpu:1")  # doctest: +NEEDS_2_DEVICES
        CpuDevice(id=1)
    """
    if isinstance(spec, jax.Device):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"device must be a jax.Device or a TF device string, got {spec!r}")
    m = _DEVICE_RE.match(spec.strip())
    if not m or m.group("type") is None:
        raise ValueError(
            f"Cannot parse device string {spec!r}: expected a form like '/gpu:0', 'CPU:1', "
            f"'/device:TPU:0' or '/job:worker/task:0/device:CPU:0'. "
            f"Available devices: {_describe(available_devices())}"
        )
    kind = m.group("type").lower()
    platform = _PLATFORM_ALIASES.get(kind)
    if platform is None:
        raise ValueError(
            f"Unknown device type {m.group('type')!r} in {spec!r}: expected CPU, GPU or TPU. "
            f"Available devices: {_describe(available_devices())}"
        )
    index = int(m.group("index"))
    task = m.group("task")
    try:
        candidates = jax.devices(platform)
    except RuntimeError:
        candidates = []
    if task is not None:
        candidates = [d for d in candidates if d.process_index == int(task)]
    else:
        candidates = [d for d in candidates if d.process_index == jax.process_index()]
    if index >= len(candidates):
        raise ValueError(
            f"Device {spec!r} does not exist: found {len(candidates)} {platform.upper()} "
            f"device(s) for that task. Available devices: {_describe(available_devices())}"
        )
    return candidates[index]


def resolve_devices(specs: Sequence[Any] | None, default: Sequence[Any] | None = None) -> tuple:
    """Resolves a list of device specs; ``None`` gives ``default`` (all local devices)."""
    if specs is None:
        return tuple(default if default is not None else jax.local_devices())
    if isinstance(specs, (str, jax.Device)):
        specs = [specs]
    devs = tuple(resolve_device(s) for s in specs)
    if not devs:
        raise ValueError("devices must not be empty")
    if len(set(devs)) != len(devs):
        raise ValueError(f"devices contains duplicates: {list(specs)!r}")
    return devs


def device_string(device: Any) -> str:
    """TF-style name of a JAX device, e.g. ``/job:localhost/replica:0/task:0/device:CPU:3``."""
    return (
        f"/job:localhost/replica:0/task:{device.process_index}/device:"
        f"{device.platform.upper()}:{_platform_index(device)}"
    )
