"""The ps RPC methods: each maps a request ``(meta, arrays)`` to a response ``(meta, arrays)``.

One table serves both transports: ``jaxdist._src.ps.server`` decodes gRPC chunks into
``(meta, arrays)`` and calls ``handle``; ``jaxdist._src.ps.client.LocalClient`` calls ``handle``
directly. Requests and responses are JSON metadata plus named arrays (see
``jaxdist._src.transport.wire``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from jaxdist._src.ps.errors import PSInvalidArgumentError
from jaxdist._src.ps.service import ParameterService

SERVICE_NAME = "jaxdist.ps.ParameterService"

Message = tuple[dict[str, Any], dict[str, np.ndarray]]

# Methods that may be retried after a lost connection (a retry changes nothing).
IDEMPOTENT = frozenset(
    {"Create", "Pull", "PullRows", "Status", "SetMarker", "Clock", "Save", "Restore", "Ping",
     "LearningRate"}
)


def _bad(field: str, value: Any, expected: str) -> PSInvalidArgumentError:
    return PSInvalidArgumentError(f"request field {field!r} is {str(value)[:100]!r}: expected "
                                  f"{expected}")


def _keys(meta: dict) -> list[str]:
    keys = meta.get("keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise _bad("keys", keys, "a list of variable names")
    if len(set(keys)) != len(keys):
        seen: set[str] = set()
        for key in keys:
            if key in seen:
                raise PSInvalidArgumentError(f"request field 'keys' names variable "
                                             f"{key[:100]!r} twice: expected each variable once")
            seen.add(key)
    return keys


def _int(meta: dict, field: str, default: Any = None, optional: bool = False) -> Any:
    value = meta.get(field, default)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(field, value, "an integer")
    return value


def _versions(meta: dict) -> dict[str, int]:
    versions = meta.get("versions", {})
    if not isinstance(versions, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in versions.values()):
        raise _bad("versions", versions, "an object of variable name -> integer version")
    return versions


def _create(svc: ParameterService, meta, arrays) -> Message:
    specs = meta.get("specs", {})
    if not isinstance(specs, dict) or not all(isinstance(v, dict) for v in specs.values()):
        raise _bad("specs", specs, "an object of variable name -> spec object")
    return {"versions": svc.create(arrays, specs)}, {}


def _pull(svc, meta, arrays) -> Message:
    got = svc.pull(_keys(meta))
    return {"versions": {k: v for k, (_, v) in got.items()}}, {k: a for k, (a, _) in got.items()}


def _pull_rows(svc, meta, arrays) -> Message:
    versions, out = {}, {}
    for key in _keys(meta):
        rows, version = svc.pull_rows(key, arrays[f"ids/{key}"])
        versions[key] = version
        out[f"rows/{key}"] = rows
    return {"versions": versions}, out


def _push(svc, meta, arrays) -> Message:
    results = svc.push(arrays, _versions(meta), _int(meta, "worker", 0))
    return {"results": results}, {}


def _push_rows(svc, meta, arrays) -> Message:
    results = {}
    worker = _int(meta, "worker", 0)
    for key, version in _versions(meta).items():
        results[key] = svc.push_rows(
            key, arrays[f"ids/{key}"], arrays[f"grads/{key}"], version, worker
        )
    return {"results": results}, {}


def _status(svc, meta, arrays) -> Message:
    return svc.status(), {}


def _ping(svc, meta, arrays) -> Message:
    return {"task": svc.task, "incarnation": svc.incarnation}, {}


def _set_marker(svc, meta, arrays) -> Message:
    svc.set_marker(meta["name"])
    return {}, {}


MAX_WORKERS = 1 << 16


def _number(meta: dict, field: str, default: Any, low: float, high: float) -> float:
    value = meta.get(field, default)
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not low <= value <= high):
        raise _bad(field, value, f"a number in [{low:g}, {high:g}]")
    return float(value)


def _clock(svc, meta, arrays) -> Message:
    clock = meta.get("clock")
    num_workers = _int(meta, "num_workers")
    if not 0 < num_workers <= MAX_WORKERS:
        raise _bad("num_workers", num_workers, f"an integer in [1, {MAX_WORKERS}]")
    return svc.clock(
        _int(meta, "worker"),
        float("inf") if clock is None else _number(meta, "clock", None, 0, float("inf")),
        num_workers,
        _int(meta, "max_staleness", optional=True),
        _number(meta, "wait_s", 1.0, 0.0, 86400.0),
    ), {}


def _save(svc, meta, arrays) -> Message:
    return {"path": svc.save(meta.get("directory"), _int(meta, "step"),
                             _int(meta, "keep", optional=True))}, {}


def _restore(svc, meta, arrays) -> Message:
    return {"step": svc.restore(meta.get("directory"), _int(meta, "step", optional=True))}, {}


def _assign(svc, meta, arrays) -> Message:
    return {"versions": svc.assign(arrays)}, {}


MAX_LEARNING_RATE = 1e6


def _learning_rate(svc, meta, arrays) -> Message:
    prefix = meta.get("prefix", "")
    if not isinstance(prefix, str):
        raise _bad("prefix", prefix, "a variable name prefix (string)")
    value = meta.get("value")
    if value is not None:
        value = _number(meta, "value", None, 0.0, MAX_LEARNING_RATE)
    return svc.learning_rate(prefix, value), {}


def _stop(svc, meta, arrays) -> Message:
    svc.stopped.set()
    return {}, {}


METHODS: dict[str, Callable[[ParameterService, dict, dict], Message]] = {
    "Create": _create,
    "Pull": _pull,
    "PullRows": _pull_rows,
    "Push": _push,
    "PushRows": _push_rows,
    "Status": _status,
    "Ping": _ping,
    "SetMarker": _set_marker,
    "Clock": _clock,
    "Save": _save,
    "Restore": _restore,
    "Assign": _assign,
    "LearningRate": _learning_rate,
    "Stop": _stop,
}


def handle(svc: ParameterService, method: str, meta: dict, arrays: dict) -> Message:
    """Runs ``method`` on ``svc``.

    Raises:
        KeyError: unknown method.
    """
    return METHODS[method](svc, meta, arrays)


__all__ = ["IDEMPOTENT", "METHODS", "SERVICE_NAME", "handle"]
