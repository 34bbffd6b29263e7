"""The elements of a ``Dataset`` as tf.data sees them: conversion of Python values, leaves,
rows, stacking into batches, and the read-only snapshots and views rows are cut from.

Example:
    >>> import numpy as np
    >>> from jaxdist._src.input.elements import as_element, stack_elements
    >>> element = as_element(([1, 2], 3.0))   # lists are arrays, Python floats float32
    >>> element[0].dtype, element[1].dtype
    (dtype('int32'), dtype('float32'))
    >>> stack_elements([element, element], 2)[0].shape
    (2, 2)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _tf_array(x: Any) -> Any:
    """A Python scalar or list as tf.constant converts it (ints -> int32, floats -> float32);
    numpy and other arrays unchanged."""
    kind = type(x)  # Python's own scalars only (np.float64 is a float subclass: kept)
    if kind is bool:
        return np.bool_(x)
    if kind is int:
        return np.int32(x) if -2**31 <= x < 2**31 else np.int64(x)
    if kind is float:
        return np.float32(x)
    if isinstance(x, list):
        a = np.asarray(x)
        if a.dtype == np.int64 and a.size and -2**31 <= a.min() and a.max() < 2**31:
            a = a.astype(np.int32)
        elif a.dtype == np.int64 and not a.size:
            a = a.astype(np.int32)
        elif a.dtype == np.float64 and not _has_numpy_float64(x):
            a = a.astype(np.float32)
        return a
    return x


def _has_numpy_float64(x: Any) -> bool:
    """Whether a (nested) list holds numpy float64 values (kept float64, as TF keeps them)."""
    if isinstance(x, list):
        return any(_has_numpy_float64(v) for v in x)
    return isinstance(x, (np.ndarray, np.floating)) and np.asarray(x).dtype == np.float64


def as_element(struct: Any) -> Any:
    """An element structure as tf.data sees it: tuples (named too) and dicts are structure,
    lists and Python scalars are arrays."""
    if isinstance(struct, dict):
        return type(struct)((k, as_element(v)) for k, v in struct.items())
    if _is_namedtuple(struct):
        return type(struct)(*(as_element(v) for v in struct))
    if isinstance(struct, tuple):
        return tuple(as_element(v) for v in struct)
    return _tf_array(struct)


def map_leaves(fn: Callable[..., Any], *structs: Any) -> Any:
    """``jax.tree.map`` with ``None`` as a leaf (an element may hold one)."""
    return jax.tree.map(fn, *structs, is_leaf=lambda x: x is None)


def snapshot(x: Any) -> np.ndarray:
    """``x`` as a read-only array nobody can write to: the array itself when it and every
    array under it are read-only already (e.g. ``np.asarray`` of a ``jax.Array``), else a
    read-only copy."""
    arr = np.asarray(x)
    base: Any = arr
    while isinstance(base, np.ndarray):
        if base.flags.writeable:
            arr = np.array(arr, copy=True)
            arr.flags.writeable = False
            return arr
        base = base.base
    return arr


def frozen(view: Any) -> Any:
    """A read-only view (a snapshot unpickled on another task is writeable again); a row of
    a 1-D array is a numpy scalar, immutable already."""
    if isinstance(view, np.ndarray):
        view.flags.writeable = False
    return view


def num_rows(struct: Any, what: str = "from_tensor_slices") -> int:
    leaves = jax.tree.leaves(struct)
    if not leaves:
        raise ValueError(f"{what} needs at least one array")
    sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
    if None in sizes:
        raise ValueError(f"{what} needs arrays of rank >= 1, got a scalar")
    if len(sizes) != 1:
        raise ValueError(f"{what} needs arrays with one leading size, got {sorted(sizes)}")
    return sizes.pop()


def call_on_element(fn: Callable[..., Any], element: Any) -> Any:
    """``fn`` applied to an element as tf.data applies it: a tuple (not a named tuple) is
    unpacked into positional arguments, anything else is one argument."""
    return fn(*element) if type(element) is tuple else fn(element)


def stack_elements(elements: list[Any], batch_size: int) -> Any:
    try:
        return map_leaves(lambda *xs: np.stack([np.asarray(x) for x in xs]), *elements)
    except ValueError as e:
        shapes = [[np.shape(x) for x in jax.tree.leaves(el)] for el in elements[:4]]
        raise ValueError(
            f"batch({batch_size}) cannot stack elements of different shapes or structures "
            f"(first elements' array shapes: {shapes}): {e}") from None


class RepeatedRange:
    """``range(...)`` ``count`` times, sliceable like the row arrays (keeps batches views)."""

    def __init__(self, rng: range, count: int):
        self._rng, self._count = rng, count
        self._len = len(rng) * count

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        for _ in range(self._count):
            yield from self._rng

    def __getitem__(self, key: slice) -> Any:
        start, stop, step = key.indices(self._len)
        n = len(self._rng)
        if step == 1 and n and start // n == (stop - 1) // n and stop > start:
            base = (start // n) * n
            return self._rng[start - base:stop - base]
        return np.asarray(list(self), np.int64)[key]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(list(self), dtype or np.int64)


def gather_rows(leaves: list[Any], idx: Any) -> list[Any]:
    """The rows ``idx`` of every array of ``leaves``: a read-only view when they are
    consecutive, else a read-only copy."""
    if isinstance(idx, range) and idx.step == 1:
        start, stop = idx.start, idx.stop
        return [frozen(a[start:stop]) for a in leaves]
    idx = np.asarray(idx, np.int64)
    if len(idx) and idx[-1] - idx[0] == len(idx) - 1 and np.all(np.diff(idx) == 1):
        start, stop = int(idx[0]), int(idx[-1]) + 1
        return [frozen(a[start:stop]) for a in leaves]
    out = []
    for a in leaves:
        taken = a[idx]
        taken.flags.writeable = False
        out.append(taken)
    return out


__all__ = ["RepeatedRange", "as_element", "call_on_element", "frozen", "gather_rows",
           "map_leaves", "num_rows", "snapshot", "stack_elements"]
