"""Memory for messages: recycled receive buffers and allocator settings for bulk transfers.

Moving a 64 MiB tensor through gRPC allocates and frees many large blocks (gRPC's read buffers,
one bytes object per chunk, the decoded payload). With glibc's defaults those blocks are
returned to the kernel on free and faulted in (zeroed) again on the next transfer, which costs
about as much CPU as the copies themselves. ``RECEIVE_POOL`` recycles the decoded payloads;
``tune_malloc`` keeps glibc from returning the smaller blocks.

Example:
    >>> from jaxdist._src.transport.memory import RECEIVE_POOL, tune_malloc
    >>> tune_malloc()          # once per process; PSClient and ParameterServer call it
    True
    >>> buf = RECEIVE_POOL.take(64 << 20)
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import threading
from typing import Any

import numpy as np


def _free_refs() -> int:
    """The reference count ``BufferPool.take`` sees for a buffer nothing else refers to.

    Measured with the very loop ``take`` runs, so it holds on any CPython version (the list
    entry, the loop variable and getrefcount's argument on 3.11; fewer where the interpreter
    borrows references). Any view of a buffer holds a real reference and raises the count.
    """
    bufs = [np.empty(1, np.uint8)]
    for buf in bufs:
        return sys.getrefcount(buf)
    raise AssertionError("unreachable")


_FREE_REFS = _free_refs()

#: Byte alignment of decoded arrays: XLA's CPU client uses a numpy array aligned like this
#: without copying it (``jax.device_put``, jit arguments), so a pulled parameter or a pushed
#: gradient enters a jitted step or a ps update as is.
ALIGNMENT = 64


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 buffer of ``nbytes`` starting on an ``ALIGNMENT`` boundary.

    Its ``base`` is the owning allocation (``nbytes + ALIGNMENT`` bytes).

    Example:
        >>> from jaxdist._src.transport.memory import ALIGNMENT, aligned_empty
        >>> aligned_empty(1000).ctypes.data % ALIGNMENT
        0
    """
    return _aligned_view(np.empty(nbytes + ALIGNMENT, np.uint8), nbytes)


def _aligned_view(raw: np.ndarray, nbytes: int) -> np.ndarray:
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start:start + nbytes]


def aligned_copy(x: Any) -> np.ndarray:
    """A writable, ``ALIGNMENT``-aligned copy of array-like ``x`` (same dtype and shape).

    Example:
        >>> import numpy as np
        >>> from jaxdist._src.transport.memory import ALIGNMENT, aligned_copy
        >>> aligned_copy(np.arange(3.0)).ctypes.data % ALIGNMENT
        0
    """
    x = np.asarray(x)
    out = aligned_empty(x.nbytes).view(x.dtype).reshape(x.shape)
    out[...] = x
    return out


class BufferPool:
    """Recycles the large buffers messages are decoded into.

    A fresh 64 MiB buffer costs the kernel about as much (page faults, zeroing) as copying
    64 MiB, and a training loop decodes a buffer of the same size every step (pulled
    parameters on a worker, pushed gradients on a ps). The pool keeps a reference to every
    buffer it handed out and gives one out again once nothing else refers to it (its
    reference count shows only the pool's own reference): every decoded array is a view that
    keeps its buffer alive, so a buffer in use is never handed out twice.

    Args:
        min_bytes: smaller buffers are plain ``np.empty`` (not worth tracking).
        max_free_bytes: free buffers beyond this many bytes are released to the allocator.
        max_buffers: the most buffers tracked at once (others are simply not recycled).
    """

    def __init__(self, min_bytes: int = 1 << 20, max_free_bytes: int = 512 << 20,
                 max_buffers: int = 32):
        self.min_bytes = min_bytes
        self.max_free_bytes = max_free_bytes
        self.max_buffers = max_buffers
        self._bufs: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 buffer of ``nbytes``, ``ALIGNMENT``-aligned (recycled when one of
        that size is free)."""
        if nbytes < self.min_bytes:
            return aligned_empty(nbytes)
        with self._lock:
            # The pool tracks the owning allocations (every view's ``base``); a free one's only
            # references are the pool's list and this loop's temporaries.
            for buf in self._bufs:
                if buf.nbytes == nbytes + ALIGNMENT and sys.getrefcount(buf) <= _FREE_REFS:
                    return _aligned_view(buf, nbytes)
            free_bytes = 0
            keep = []
            for buf in reversed(self._bufs):  # newest first; drop the oldest free ones
                if sys.getrefcount(buf) <= _FREE_REFS:
                    free_bytes += buf.nbytes
                    if free_bytes + nbytes > self.max_free_bytes:
                        continue
                keep.append(buf)
            self._bufs = keep[::-1][-(self.max_buffers - 1) :] if self.max_buffers > 1 else []
            out = aligned_empty(nbytes)
            self._bufs.append(out.base)
            return out

    def clear(self) -> None:
        """Forgets every buffer (those in use stay alive through their users)."""
        with self._lock:
            self._bufs = []


RECEIVE_POOL = BufferPool()


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 8 << 20
TRIM_THRESHOLD_BYTES = 64 << 20
_tuned: bool | None = None
_tune_lock = threading.Lock()


def tune_malloc() -> bool:
    """Keeps glibc from unmapping blocks up to 8 MiB and from trimming up to 64 MiB of free
    heap, so the buffers of one transfer are reused by the next; returns whether it applied.

    Called by ``PSClient`` and ``ParameterServer``. It does nothing on other C libraries, when
    ``JAXDIST_MALLOC_TUNING=0``, or when the process already sets ``MALLOC_MMAP_THRESHOLD_``
    or ``MALLOC_TRIM_THRESHOLD_`` (the user's settings win). Measured on a 64 MiB transfer:
    the receiving side spends about a quarter less CPU.

    Example:
        >>> from jaxdist._src.transport.memory import tune_malloc
        >>> tune_malloc()
        True
    """
    global _tuned
    with _tune_lock:
        if _tuned is not None:
            return _tuned
        _tuned = False
        if (os.environ.get("JAXDIST_MALLOC_TUNING", "1") == "0"
                or "MALLOC_MMAP_THRESHOLD_" in os.environ
                or "MALLOC_TRIM_THRESHOLD_" in os.environ
                or not sys.platform.startswith("linux")
                or platform.libc_ver()[0] != "glibc"):
            return False
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):
            return False
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        _tuned = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                      and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
        return _tuned


__all__ = ["ALIGNMENT", "RECEIVE_POOL", "BufferPool", "aligned_copy", "aligned_empty",
           "tune_malloc"]
