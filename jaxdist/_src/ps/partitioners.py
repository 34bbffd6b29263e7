"""Variable partitioners (``tf.distribute.experimental.partitioners``): split leaves on axis 0.

A partitioner is called as ``partitioner(shape, dtype, axis=0)`` and returns the number of
partitions per axis (a list with 1 everywhere except axis 0), as in TF. ``split_rows`` turns a
shard count into row ranges with TF's division: the first ``rows % n`` shards get one more row
(13 rows over 5 shards -> 3, 3, 3, 2, 2).

Example:
    >>> from jaxdist import FixedShardsPartitioner
    >>> from jaxdist.ps import split_rows
    >>> FixedShardsPartitioner(5)((13, 4), "float32")
    [5, 1]
    >>> split_rows(13, 5)
    [(0, 3), (3, 6), (6, 9), (9, 11), (11, 13)]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def _elem_bytes(dtype: Any, bytes_per_string: int) -> int:
    dt = np.dtype(dtype) if not isinstance(dtype, str) or dtype != "string" else None
    if dt is None or dt.kind in "USO":
        return bytes_per_string
    return dt.itemsize


def _check(shape: Sequence[int], axis: int) -> tuple[int, ...]:
    shape = tuple(int(d) for d in shape)
    if axis != 0:
        raise ValueError(f"jaxdist partitions variables along axis 0 only, got axis={axis}")
    if len(shape) == 0:
        raise ValueError("a rank-0 variable cannot be partitioned")
    return shape


class Partitioner:
    """Base class: ``__call__(shape, dtype, axis=0) -> [num_partitions, 1, ...]``."""

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        raise NotImplementedError


class FixedShardsPartitioner(Partitioner):
    """Splits every variable into ``num_shards`` (fewer if it has fewer rows).

    Example:
        >>> from jaxdist import FixedShardsPartitioner
        >>> FixedShardsPartitioner(num_shards=2)((10, 3), "float32")
        [2, 1]
    """

    def __init__(self, num_shards: int):
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        self._num_shards = int(num_shards)

    def __call__(self, shape, dtype, axis=0):
        shape = _check(shape, axis)
        result = [1] * len(shape)
        result[axis] = max(1, min(self._num_shards, shape[axis]))
        return result

    def __repr__(self):
        return f"FixedShardsPartitioner(num_shards={self._num_shards})"


class MinSizePartitioner(Partitioner):
    """As many shards as keep each at least ``min_shard_bytes``, at most ``max_shards``.

    Example:
        >>> from jaxdist import MinSizePartitioner
        >>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), "float32")
        [2, 1]
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1,
                 bytes_per_string: int = 16):
        if min_shard_bytes < 1:
            raise ValueError(f"min_shard_bytes must be >= 1, got {min_shard_bytes}")
        if max_shards < 1:
            raise ValueError(f"max_shards must be >= 1, got {max_shards}")
        if bytes_per_string < 1:
            raise ValueError(f"bytes_per_string must be >= 1, got {bytes_per_string}")
        self._min_shard_bytes = min_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape, dtype, axis=0):
        shape = _check(shape, axis)
        total = math.prod(shape) * _elem_bytes(dtype, self._bytes_per_string)
        partitions = total / self._min_shard_bytes
        result = [1] * len(shape)
        result[axis] = max(1, min(shape[axis], self._max_shards, int(math.ceil(partitions))))
        return result

    def __repr__(self):
        return (f"MinSizePartitioner(min_shard_bytes={self._min_shard_bytes}, "
                f"max_shards={self._max_shards})")


class MaxSizePartitioner(Partitioner):
    """As few shards as keep each at most ``max_shard_bytes`` (at most ``max_shards``).

    Example:
        >>> from jaxdist import MaxSizePartitioner
        >>> MaxSizePartitioner(max_shard_bytes=4)((6, 1), "float32")
        [6, 1]
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None,
                 bytes_per_string: int = 16):
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
        if max_shards is not None and max_shards < 1:
            raise ValueError(f"max_shards must be >= 1 or None, got {max_shards}")
        if bytes_per_string < 1:
            raise ValueError(f"bytes_per_string must be >= 1, got {bytes_per_string}")
        self._max_shard_bytes = max_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape, dtype, axis=0):
        shape = _check(shape, axis)
        elem = _elem_bytes(dtype, self._bytes_per_string)
        rows = shape[axis]
        result = [1] * len(shape)
        if rows == 0:
            return result
        bytes_per_slice = 1.0 * (math.prod(shape) / rows) * elem
        slices_per_shard = max(1, math.floor(self._max_shard_bytes / bytes_per_slice))
        axis_shards = int(math.ceil(1.0 * rows / slices_per_shard))
        if self._max_shards:
            axis_shards = min(self._max_shards, axis_shards)
        result[axis] = axis_shards
        return result

    def __repr__(self):
        return (f"MaxSizePartitioner(max_shard_bytes={self._max_shard_bytes}, "
                f"max_shards={self._max_shards})")


def split_rows(num_rows: int, num_shards: int) -> list[tuple[int, int]]:
    """Row ranges ``[(start, stop), ...]`` of ``num_shards`` shards, TF's division.

    Example:
        >>> from jaxdist.ps import split_rows
        >>> [b - a for a, b in split_rows(13, 5)]
        [3, 3, 3, 2, 2]
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    base, extra = divmod(num_rows, num_shards)
    out, start = [], 0
    for i in range(num_shards):
        size = base + (1 if i < extra else 0)
        out.append((start, start + size))
        start += size
    return out


def num_shards_for(partitioner: Any, shape: Sequence[int], dtype: Any) -> int:
    """The number of axis-0 shards ``partitioner`` asks for (1 for rank-0 leaves or None).

    Raises:
        ValueError: the partitioner splits another axis or returns a bad count.
    """
    if partitioner is None or len(shape) == 0:
        return 1
    parts = list(partitioner(tuple(shape), dtype))
    if len(parts) != len(shape) or any(int(p) != 1 for p in parts[1:]) or int(parts[0]) < 1:
        raise ValueError(
            f"partitioner {partitioner!r} returned {parts} for shape {tuple(shape)}: expected "
            f"[n >= 1] + [1] * {len(shape) - 1} (jaxdist splits axis 0 only)"
        )
    return min(int(parts[0]), max(1, int(shape[0])))


__all__ = [
    "FixedShardsPartitioner",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "Partitioner",
    "num_shards_for",
    "split_rows",
]
