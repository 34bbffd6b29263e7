"""``assign_add`` of a ps variable as a numpy add on its host buffer, bit-identical to XLA.

A push to a variable without optimizer adds the gradient to the value. Done as a jitted XLA
computation (``jaxdist._src.ps.service``) that costs a dispatch and a hand-off to XLA's worker
threads (~0.15-0.2 ms for a 1 MiB float32 variable on a quiet machine, far more on a loaded
one) against ~0.03 ms for ``np.add`` into the same buffer. This module does that add in numpy
where it gives the very bits XLA gives:

* only for values of at most ``HOST_ADD_MAX_BYTES`` (checked by ``jaxdist._src.ps.service``), and
  for dtypes whose numpy add is a plain IEEE / wrapping add as fast as XLA's (float32/64 and
  the integers; not bfloat16 / float16, whose numpy loops are scalar and slower);
* 64-bit dtypes without ``jax_enable_x64``: the jitted add would narrow them to 32 bits (the
  variable silently became float32, its small updates lost, and the next float64 push was
  refused); the numpy add keeps them, at any size;
* XLA on CPU flushes float denormals to zero (inputs and results); numpy adds with the
  thread's MXCSR flush-to-zero and denormals-are-zero bits set for the add (x86-64 glibc only);
* each dtype is checked once per process against XLA on probe values (denormals, signed
  zeros, infinities, NaN, integer wrap-around): a dtype whose numpy add differs, in any bit,
  from the jitted add stays on the jitted add.

Example:
    >>> import jax
    >>> import numpy as np
    >>> from jaxdist._src.ps.host_update import host_add, host_add_mode
    >>> jitted_add = jax.jit(lambda value, delta: value + delta)
    >>> value, grad = np.zeros(3, np.float32), np.ones(3, np.float32)
    >>> mode = host_add_mode(np.dtype(np.float32), jitted_add)   # "flush" on x86-64 glibc
    >>> if mode is not None:     # None: no numpy add gives XLA's bits, use jitted_add
    ...     _ = host_add(value, grad, out=value, mode=mode)
"""

from __future__ import annotations

import ctypes
import platform
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

#: Dtypes the host add may serve (each still checked against XLA before its first use).
HOST_ADD_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int8, np.int16,
                                                  np.int32, np.int64, np.uint8, np.uint16,
                                                  np.uint32, np.uint64))

#: Larger values keep the jitted add: a numpy add runs on one thread, XLA may split a large
#: add over several (on 2 cores both take ~3.5 ms for 64 MiB; below a few MiB XLA's dispatch
#: and thread hand-off cost more than the add itself).
HOST_ADD_MAX_BYTES = 4 << 20

_MXCSR_FLUSH = 0x8040  # FTZ (bit 15) and DAZ (bit 6)
_FENV_BYTES = 32  # sizeof(fenv_t) on x86-64 glibc: x87 environment (28 bytes), then MXCSR
_MXCSR_OFFSET = 28


class _Flush:
    """Sets flush-to-zero / denormals-are-zero on the calling thread for a block (x86-64)."""

    def __init__(self):
        self.available = False
        if (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")
                and platform.libc_ver()[0] == "glibc"):
            try:
                libc = ctypes.CDLL(None)
                self._get, self._set = libc.fegetenv, libc.fesetenv
            except (OSError, AttributeError):
                return
            self._get.argtypes = self._set.argtypes = [ctypes.c_void_p]
            self._get.restype = self._set.restype = ctypes.c_int
            self.available = True

    def run(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` with denormals flushed on this thread; the previous mode is restored."""
        saved = (ctypes.c_char * _FENV_BYTES)()
        if self._get(saved) != 0:
            raise OSError("fegetenv failed")
        flushed = (ctypes.c_char * _FENV_BYTES).from_buffer_copy(saved)
        mxcsr = int.from_bytes(bytes(saved[_MXCSR_OFFSET:_FENV_BYTES]), "little")
        flushed[_MXCSR_OFFSET:_FENV_BYTES] = (mxcsr | _MXCSR_FLUSH).to_bytes(4, "little")
        if self._set(flushed) != 0:
            raise OSError("fesetenv failed")
        try:
            return fn()
        finally:
            self._set(saved)


_FLUSH = _Flush()
_MODES: dict[np.dtype, str | None] = {}
_MODES_LOCK = threading.Lock()


def host_add(value: np.ndarray, grad: np.ndarray, out: np.ndarray, mode: str) -> np.ndarray:
    """``out = value + grad`` in numpy (``mode``: ``"plain"``, ``"exact"`` (the same add) or
    ``"flush"``, from ``host_add_mode``); ``out`` may be ``value`` itself."""
    with np.errstate(all="ignore"):  # inf / overflow are results, as in XLA: no warnings
        if mode == "flush":
            return _FLUSH.run(lambda: np.add(value, grad, out=out))
        return np.add(value, grad, out=out)


def _probe(dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    if dtype.kind == "f":
        info = np.finfo(dtype)
        sub = info.smallest_subnormal
        special = np.array(
            [sub, -sub, sub * 3, info.tiny, -info.tiny, info.tiny, 0.0, -0.0, -0.0, 1.0, np.inf,
             -np.inf, np.inf, np.nan, info.max, -info.max, 1e-30, 1e-39, 0.1, 1.0 + info.eps],
            dtype)
        other = np.array(
            [sub, sub * 2, 0.0, -sub, sub, -info.tiny * 0.5, -0.0, 0.0, -0.0, -1.0, -np.inf, 1.0,
             np.inf, 2.0, info.max, -info.max, -1e-30, 1e-39, 0.2, info.eps / 2], dtype)
        a = np.concatenate([special, rng.normal(size=1000).astype(dtype),
                            (rng.normal(size=1000) * 1e-37).astype(dtype)])
        b = np.concatenate([other, rng.normal(size=1000).astype(dtype),
                            (rng.normal(size=1000) * 1e-37).astype(dtype)])
        return a, b
    info = np.iinfo(dtype)
    edge = np.array([info.min, info.max, info.max, -1 if info.min else 0, 0, 1], dtype)
    a = np.concatenate([edge, rng.integers(info.min, info.max, 1000, dtype, endpoint=True)])
    b = np.concatenate([np.array([info.min if info.min else info.max, 1, info.max, info.min,
                                  0, info.max], dtype),
                        rng.integers(info.min, info.max, 1000, dtype, endpoint=True)])
    return a, b


def _bits(x: Any) -> bytes:
    x = np.ascontiguousarray(x)
    return x.view(np.uint8).tobytes() + str(x.dtype).encode()


def host_add_mode(dtype: np.dtype, jitted_add: Callable[[Any, Any], Any]) -> str | None:
    """How ``host_add`` matches ``jitted_add`` (the ps's jitted ``value + delta``) for
    ``dtype``: ``"plain"``, ``"flush"``, or ``None`` (no numpy add gives XLA's bits: use
    ``jitted_add``); ``"exact"`` when ``jitted_add`` returns another dtype (JAX without
    ``jax_enable_x64`` narrows float64 / int64 / uint64 to 32 bits, which would lose the
    variable's values and dtype): then only the numpy add (IEEE, or wrapping) is right, at any
    size. Probed once per dtype and process (one small compile).
    """
    dtype = np.dtype(dtype)
    if dtype not in HOST_ADD_DTYPES:
        return None
    with _MODES_LOCK:
        if dtype in _MODES:
            return _MODES[dtype]
        mode = None
        try:
            a, b = _probe(dtype)
            with warnings.catch_warnings():  # JAX warns when it narrows a 64-bit dtype
                warnings.simplefilter("ignore")
                got = np.asarray(jitted_add(a.copy(), b))
            if got.dtype != dtype:  # XLA cannot hold the dtype (64-bit without x64)
                _MODES[dtype] = "exact"
                return "exact"
            want = _bits(got)
            modes = ["plain", "flush"] if _FLUSH.available and dtype.kind == "f" else ["plain"]
            for m in modes:
                if _bits(host_add(a, b, np.empty_like(a), m)) == want:
                    mode = m
                    break
            if mode == "flush":  # the thread's mode came back: a plain add keeps denormals
                sub = np.finfo(dtype).smallest_subnormal
                if np.add(np.array([sub], dtype), np.array([sub], dtype))[0] == 0:
                    mode = None
        except Exception:  # noqa: BLE001 - any doubt: stay on the jitted add
            mode = None
        _MODES[dtype] = mode
        return mode


__all__ = ["HOST_ADD_DTYPES", "HOST_ADD_MAX_BYTES", "host_add", "host_add_mode"]
