"""``Dataset``: a small, deterministic ``tf.data``-like pipeline over numpy arrays.

It covers what distributed training needs without TensorFlow: ``from_tensor_slices``,
``shuffle`` (seeded, reshuffled per epoch), ``repeat``, ``batch``, ``map``, ``take``, ``skip``.
Iterating twice gives the same elements in the same order for the same seed.

As in TF, ``from_tensor_slices`` takes the arrays' values when it is called: later writes to
the caller's arrays do not reach the dataset. Its elements (and the batches ``batch`` cuts
from it) are read-only views of that snapshot, so a batch costs no copy; write to a copy
(``x = x.copy()``, or build a new array: ``x = x / 255``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np


def _snapshot(x: Any) -> np.ndarray:
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


def _frozen(view: Any) -> Any:
    """A read-only view (a snapshot unpickled on another task is writeable again); a row of
    a 1-D array is a numpy scalar, immutable already."""
    if isinstance(view, np.ndarray):
        view.flags.writeable = False
    return view


def _num_rows(struct: Any) -> int:
    leaves = jax.tree.leaves(struct)
    if not leaves:
        raise ValueError("from_tensor_slices needs at least one array")
    sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
    if None in sizes:
        raise ValueError("from_tensor_slices needs arrays of rank >= 1, got a scalar")
    if len(sizes) != 1:
        raise ValueError(f"from_tensor_slices needs arrays with one leading size, got {sizes}")
    return sizes.pop()


class _FreshSeed:
    """An unseeded shuffle's entropy, drawn anew in every process that unpickles it.

    TF: each worker's copy of an unseeded dataset (``create_per_worker_dataset(dataset)``)
    shuffles differently; within one process, iterating again is repeatable.
    """

    def __init__(self):
        self.value = np.random.SeedSequence().entropy

    def __reduce__(self):
        return (_FreshSeed, ())


class Dataset:
    """An iterable of elements (pytrees of numpy arrays) with ``tf.data``-style methods.

    Example:
        >>> ds = jaxdist.Dataset.from_tensor_slices((x, y)).shuffle(1000, seed=0).batch(64)
        >>> for xb, yb in ds:
        ...     ...
    """

    def __init__(self, make_iter: Callable[[int], Iterator[Any]], cardinality: int | None = None):
        self._make_iter = make_iter
        self._cardinality = cardinality
        self._epoch = 0
        self._tensors: Any = None  # from_tensor_slices' arrays (batch() slices them directly)

    @classmethod
    def from_tensor_slices(cls, tensors: Any) -> Dataset:
        """One element per row of ``tensors`` (an array, tuple or dict of arrays).

        The values are taken now (a read-only copy of every writeable array, as TF copies
        them into the dataset); each element is a read-only view of that copy.

        Example:
            >>> ds = jaxdist.Dataset.from_tensor_slices((x, y)).batch(64)
            >>> xb, yb = next(iter(ds))     # read-only views: xb = xb / 255, not xb /= 255
        """
        n = _num_rows(tensors)
        tensors = jax.tree.map(_snapshot, tensors)

        def it(epoch: int) -> Iterator[Any]:
            for i in range(n):
                yield jax.tree.map(lambda a, i=i: _frozen(a[i]), tensors)

        ds = cls(it, n)
        ds._tensors = tensors
        return ds

    @classmethod
    def from_iterable(cls, iterable_fn: Callable[[], Iterable[Any]]) -> Dataset:
        """Elements from ``iterable_fn()`` (called once per iteration)."""
        return cls(lambda epoch: iter(iterable_fn()))

    def __iter__(self) -> Iterator[Any]:
        epoch = self._epoch
        self._epoch += 1
        return self._make_iter(epoch)

    def cardinality(self) -> int | None:
        """Number of elements, or ``None`` when unknown or infinite."""
        return self._cardinality

    def __len__(self) -> int:
        if self._cardinality is None:
            raise TypeError("this Dataset's length is unknown or infinite")
        return self._cardinality

    def as_numpy_iterator(self) -> Iterator[Any]:
        return iter(self)

    def map(self, fn: Callable[..., Any]) -> Dataset:
        """Applies ``fn`` to each element (tuples are unpacked into arguments, as in tf.data)."""
        parent = self

        def it(epoch):
            for el in parent._make_iter(epoch):
                yield fn(*el) if isinstance(el, tuple) else fn(el)

        return Dataset(it, self._cardinality)

    def shuffle(
        self, buffer_size: int, seed: int | None = None, reshuffle_each_iteration: bool = True
    ) -> Dataset:
        """Shuffles with a buffer of ``buffer_size`` elements; seeded runs are repeatable."""
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        parent = self
        fresh = _FreshSeed() if seed is None else None

        def it(epoch):
            base = fresh.value if fresh is not None else seed
            rng = np.random.default_rng([base, epoch if reshuffle_each_iteration else 0])
            buf: list[Any] = []
            for el in parent._make_iter(epoch):
                if len(buf) < buffer_size:
                    buf.append(el)
                    continue
                j = int(rng.integers(len(buf)))
                yield buf[j]
                buf[j] = el
            rng.shuffle(buf)
            yield from buf

        return Dataset(it, self._cardinality)

    def repeat(self, count: int | None = None) -> Dataset:
        """Repeats the dataset ``count`` times (forever when ``None``); each pass reshuffles."""
        parent = self

        def it(epoch):
            k = 0
            while count is None or k < count:
                yield from parent._make_iter(epoch * 1_000_003 + k)
                k += 1

        card = None if count is None or self._cardinality is None else self._cardinality * count
        return Dataset(it, card)

    def batch(self, batch_size: int, drop_remainder: bool = False) -> Dataset:
        """Stacks ``batch_size`` consecutive elements into one batch."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        parent = self
        tensors = self._tensors
        if tensors is not None:
            # Straight from from_tensor_slices: a batch is a read-only view of consecutive rows
            # of the snapshot (the same values as stacking the rows one by one, without a
            # Python loop per row, and without a copy).
            n = self._cardinality

            def sliced(epoch):
                stop = n - n % batch_size if drop_remainder else n
                for s in range(0, stop, batch_size):
                    yield jax.tree.map(lambda a, s=s: _frozen(a[s:s + batch_size]), tensors)

            card = n // batch_size + (0 if drop_remainder or not n % batch_size else 1)
            return Dataset(sliced, card)

        def it(epoch):
            buf: list[Any] = []
            for el in parent._make_iter(epoch):
                buf.append(el)
                if len(buf) == batch_size:
                    yield jax.tree.map(lambda *xs: np.stack(xs), *buf)
                    buf = []
            if buf and not drop_remainder:
                yield jax.tree.map(lambda *xs: np.stack(xs), *buf)

        card = None
        if self._cardinality is not None:
            card = self._cardinality // batch_size
            if not drop_remainder and self._cardinality % batch_size:
                card += 1
        return Dataset(it, card)

    def take(self, count: int) -> Dataset:
        parent = self

        def it(epoch):
            for i, el in enumerate(parent._make_iter(epoch)):
                if i >= count:
                    return
                yield el

        card = count if self._cardinality is None else min(count, self._cardinality)
        return Dataset(it, card)

    def skip(self, count: int) -> Dataset:
        parent = self

        def it(epoch):
            for i, el in enumerate(parent._make_iter(epoch)):
                if i >= count:
                    yield el

        card = None if self._cardinality is None else max(0, self._cardinality - count)
        return Dataset(it, card)

    def prefetch(self, buffer_size: int | None = None) -> Dataset:
        """Accepted for tf.data compatibility (distributed iterators prefetch to devices)."""
        del buffer_size
        return self
