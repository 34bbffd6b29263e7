"""``Dataset``: a deterministic ``tf.data``-like pipeline over numpy arrays, without TensorFlow.

The methods TF's tutorials use, with ``tf.data``'s semantics: ``from_tensor_slices``,
``from_tensors``, ``from_generator``, ``range``, ``zip``, ``map``, ``filter``, ``shuffle``,
``batch``, ``unbatch``, ``repeat``, ``take``, ``skip``, ``shard``, ``cache``, ``concatenate``,
``enumerate``, ``prefetch``, ``with_options``, ``as_numpy_iterator`` and ``cardinality``
(``INFINITE_CARDINALITY`` / ``UNKNOWN_CARDINALITY`` as TF counts them). Elements are pytrees
(tuples, dicts) of numpy arrays; as in tf.data a tuple element is unpacked into the positional
arguments of ``map`` / ``filter`` functions (a dict is passed as one argument), Python lists are
arrays (``from_tensor_slices([1, 2, 3])`` has 3 scalar elements), and Python ints and floats
become ``int32`` and ``float32``. Iterating twice gives the same elements in the same order for
the same seed; a ``shuffle`` reshuffles each pass unless ``reshuffle_each_iteration=False``.

Performance: as in TF, ``from_tensor_slices`` takes the arrays' values when it is called: later
writes to the caller's arrays do not reach the dataset. Its elements, and the batches ``batch``
cuts from it, are read-only views of that snapshot, so a batch of consecutive rows costs no copy
(write to a copy: ``x = x.copy()``, or build a new array: ``x = x / 255``). ``shuffle``,
``take``, ``skip``, ``shard``, ``cache`` and a finite ``repeat`` of such a dataset reorder row
indices, not elements: a shuffled batch is one gather of its rows (a read-only copy). After a
``map`` or ``filter``, elements go through Python one at a time and ``batch`` stacks them.

``num_parallel_calls`` and ``deterministic`` are accepted and elements are computed in order in
the caller's thread; ``prefetch`` returns the dataset itself (distributed iterators prefetch to
the devices).

What a dataset is made of lives beside it: ``elements.py`` (tf.data's view of elements, rows
and batches), ``shuffling.py`` (the shuffle buffer), ``signature.py`` (``TensorSpec`` and
``from_generator``'s checks) and ``iterator.py`` (``DatasetIterator``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jaxdist._src.input.elements import (
    RepeatedRange,
    as_element,
    call_on_element,
    frozen,
    gather_rows,
    map_leaves,
    num_rows,
    snapshot,
    stack_elements,
)
from jaxdist._src.input.iterator import DatasetIterator
from jaxdist._src.input.options import Options, as_options
from jaxdist._src.input.shuffling import FreshSeed, reservoir, reservoir_rows
from jaxdist._src.input.signature import conform, np_dtype, signature_from_types

#: ``Dataset.cardinality()`` of an endless dataset (-1).
INFINITE_CARDINALITY = -1
#: ``Dataset.cardinality()`` when it cannot be known (-2).
UNKNOWN_CARDINALITY = -2
#: ``tf.data.AUTOTUNE`` (-1): let the pipeline pick a buffer size.
AUTOTUNE = -1

_INF, _UNK = INFINITE_CARDINALITY, UNKNOWN_CARDINALITY


def _card_add(a: int, b: int) -> int:
    if _INF in (a, b):
        return _INF
    if _UNK in (a, b):
        return _UNK
    return a + b


def _check_count(count: Any, what: str) -> int:
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)):
        raise TypeError(f"{what}: count must be an int, got {count!r}")
    return int(count)


class Dataset:
    """An iterable of elements (pytrees of numpy arrays) with ``tf.data``'s methods.

    Example:
        >>> import jaxdist
        >>> import numpy as np
        >>> x, y = np.zeros((256, 784), np.float32), np.zeros((256,), np.int32)
        >>> ds = (jaxdist.Dataset.from_tensor_slices((x, y))
        ...       .shuffle(1000, seed=0).map(lambda x, y: (x / 255, y)).batch(64))
        >>> for xb, yb in ds:
        ...     assert xb.shape[1:] == (784,)   # batches of 64 rows
    """

    #: Class-level aliases of the module constants (``tf.data.AUTOTUNE`` and friends).
    AUTOTUNE = AUTOTUNE
    INFINITE_CARDINALITY = INFINITE_CARDINALITY
    UNKNOWN_CARDINALITY = UNKNOWN_CARDINALITY

    def __init__(self, make_iter: Callable[[int], Iterator[Any]],
                 cardinality: int | None = None):
        self._make_iter = make_iter
        self._cardinality = _UNK if cardinality is None else int(cardinality)
        self._epoch = 0
        # Row-indexed datasets (from_tensor_slices and reorderings of it): the snapshot, and
        # rows(epoch) -> the row indices of that pass (a range or an int array).
        self._tensors: Any = None
        self._rows: Callable[[int], Any] | None = None
        self._options = Options()
        self._unseeded_shuffle = False  # an unseeded shuffle differs between processes
        self._static_batch: int | None = None  # batch(n, drop_remainder=True): n rows each

    # ------------------------------------------------------------------ construction helpers

    def _derive(self, make_iter: Callable[[int], Iterator[Any]], cardinality: int,
                *parents: Dataset) -> Dataset:
        ds = Dataset(make_iter, cardinality)
        parents = parents or (self,)
        opts = Options()
        for p in parents:
            opts = opts.merge(p._options)
        ds._options = opts
        ds._unseeded_shuffle = any(p._unseeded_shuffle for p in parents)
        return ds

    def _indexed(self, rows: Callable[[int], Any], cardinality: int) -> Dataset:
        """A dataset of this snapshot's rows in the order ``rows(epoch)`` gives."""
        tensors = self._tensors

        def it(epoch: int) -> Iterator[Any]:
            for i in rows(epoch):
                yield jax.tree.map(lambda a, i=i: frozen(a[i]), tensors)

        ds = self._derive(it, cardinality)
        ds._tensors, ds._rows = tensors, rows
        return ds

    # --------------------------------------------------------------------------- sources

    @classmethod
    def from_tensor_slices(cls, tensors: Any, name: str | None = None) -> Dataset:
        """One element per row of ``tensors`` (an array, list, tuple or dict of arrays).

        The values are taken now (a read-only copy of every writeable array, as TF copies
        them into the dataset); each element is a read-only view of that copy.

        Example:
            >>> import jaxdist
            >>> import numpy as np
            >>> x, y = np.zeros((256, 784), np.float32), np.zeros((256,), np.int32)
            >>> ds = jaxdist.Dataset.from_tensor_slices((x, y)).batch(64)
            >>> xb, yb = next(iter(ds))     # read-only views: xb = xb / 255, not xb /= 255
            >>> [int(v) for v in jaxdist.Dataset.from_tensor_slices([1, 2, 3])]
            [1, 2, 3]
        """
        del name
        tensors = jax.tree.map(snapshot, as_element(tensors))
        n = num_rows(tensors)
        ds = cls(lambda epoch: iter(()), n)
        ds._tensors = tensors
        ds._rows = lambda epoch: range(n)
        return ds._indexed(ds._rows, n)

    @classmethod
    def from_tensors(cls, tensors: Any, name: str | None = None) -> Dataset:
        """A dataset of one element, ``tensors`` (values taken now, read-only).

        Example:
            >>> import jaxdist
            >>> [a.tolist() for a in jaxdist.Dataset.from_tensors([1, 2, 3]).repeat(2)]
            [[1, 2, 3], [1, 2, 3]]
        """
        del name
        element = jax.tree.map(snapshot, as_element(tensors))
        return cls(lambda epoch: iter([jax.tree.map(frozen, element)]), 1)

    @classmethod
    def range(cls, *args: int, output_type: Any = np.int64, name: str | None = None
              ) -> Dataset:
        """``range(stop)``, ``range(start, stop)``, ``range(start, stop, step)`` as scalars of
        ``output_type`` (int64 by default, as TF).

        Example:
            >>> import jaxdist
            >>> [int(v) for v in jaxdist.Dataset.range(5, 1, -2)]
            [5, 3]
        """
        del name
        if not 1 <= len(args) <= 3:
            raise TypeError(f"range takes 1 to 3 arguments (start, stop, step), got {args}")
        if len(args) == 3 and args[2] == 0:
            raise ValueError("range: step must not be 0")
        return cls.from_tensor_slices(np.arange(*args).astype(np_dtype(output_type)))

    @classmethod
    def from_iterable(cls, iterable_fn: Callable[[], Iterable[Any]]) -> Dataset:
        """Elements from ``iterable_fn()`` (called once per iteration), taken as they are.

        Example:
            >>> import jaxdist
            >>> import numpy as np
            >>> ds = jaxdist.Dataset.from_iterable(lambda: ({"x": np.ones(3)} for _ in range(2)))
        """
        return cls(lambda epoch: iter(iterable_fn()))

    @classmethod
    def from_generator(cls, generator: Callable[..., Iterable[Any]], output_types: Any = None,
                       output_shapes: Any = None, args: Sequence[Any] | None = None,
                       output_signature: Any = None, name: str | None = None) -> Dataset:
        """Elements from ``generator(*args)`` (called once per iteration), converted to the
        signature as tf.data does.

        Args:
            generator: a callable returning an iterable (a generator function).
            output_types: the elements' dtypes (a structure of dtypes), TF's older spelling.
            output_shapes: their shapes (a structure of shapes; ``None`` dims match any size).
            args: positional arguments for ``generator``.
            output_signature: a structure of ``TensorSpec`` (``jaxdist.data.TensorSpec``,
                ``tf.TensorSpec`` or ``jax.ShapeDtypeStruct``); replaces the two above.
            name: accepted for compatibility.

        Each yielded element must have the signature's structure (a tuple may be yielded as a
        list); its arrays are converted to the signature's dtypes, and a shape that does not
        match raises ``ValueError`` naming both (TF's ``InvalidArgumentError``). Without any
        signature the elements are taken as yielded (jaxdist only; TF requires one).

        Example:
            >>> import jaxdist
            >>> import numpy as np
            >>> def gen():
            ...     for i in range(3):
            ...         yield i, [1.0] * i
            >>> ds = jaxdist.Dataset.from_generator(gen, output_signature=(
            ...     jaxdist.data.TensorSpec((), np.int32),
            ...     jaxdist.data.TensorSpec((None,), np.float32)))
        """
        del name
        if output_signature is not None and (output_types is not None
                                             or output_shapes is not None):
            raise TypeError("from_generator: pass output_signature, or output_types (and "
                            "output_shapes), not both")
        if output_signature is None and output_types is not None:
            output_signature = signature_from_types(output_types, output_shapes)
        elif output_shapes is not None:
            raise TypeError("from_generator: output_shapes needs output_types")
        call_args = tuple(args or ())
        if not callable(generator):
            raise TypeError(f"from_generator needs a callable, got {generator!r}")

        def it(epoch: int) -> Iterator[Any]:
            for element in generator(*call_args):
                if output_signature is None:
                    yield as_element(element)
                else:
                    yield conform(element, output_signature, output_signature)

        return cls(it)

    # ------------------------------------------------------------------------- iteration

    def __iter__(self) -> DatasetIterator:
        epoch = self._epoch
        self._epoch += 1
        return DatasetIterator(self._make_iter(epoch))

    def as_numpy_iterator(self) -> Iterator[Any]:
        """An iterator over the elements as numpy values (``jax.Array`` leaves converted).

        Example:
            >>> import jaxdist
            >>> list(jaxdist.Dataset.range(8).batch(3).as_numpy_iterator())[-1]
            array([6, 7])
        """

        def to_numpy(x: Any) -> Any:
            if x is None or isinstance(x, (np.ndarray, np.generic, int, float, bool, str,
                                           bytes)):
                return x
            return np.asarray(x)

        for element in self:
            yield map_leaves(to_numpy, element)

    def cardinality(self) -> int:
        """The number of elements; ``INFINITE_CARDINALITY`` (-1) for an infinite dataset and
        ``UNKNOWN_CARDINALITY`` (-2) when it cannot be known without reading it (after
        ``filter``, ``unbatch``, ``from_generator``), as tf.data counts.

        Example:
            >>> import jaxdist
            >>> jaxdist.Dataset.range(42).repeat().cardinality()    # INFINITE_CARDINALITY
            -1
        """
        return self._cardinality

    def __len__(self) -> int:
        if self._cardinality == _INF:
            raise TypeError("The dataset is infinite.")
        if self._cardinality == _UNK:
            raise TypeError("The dataset length is unknown.")
        return self._cardinality

    def options(self) -> Options:
        """The options set with ``with_options`` (``tf.data.Dataset.options``).

        Example:
            >>> import jaxdist
            >>> jaxdist.Dataset.range(3).options().experimental_distribute.auto_shard_policy
            <AutoShardPolicy.AUTO: 'AUTO'>
        """
        return self._options

    def with_options(self, options: Any, name: str | None = None) -> Dataset:
        """The same dataset with ``options`` merged into its own (``jaxdist.data.Options`` or
        a ``tf.data.Options``; what ``options`` sets wins).

        Example:
            >>> import jaxdist
            >>> options = jaxdist.data.Options()
            >>> options.experimental_distribute.auto_shard_policy = jaxdist.AutoShardPolicy.OFF
            >>> ds = jaxdist.Dataset.range(8).batch(4).with_options(options)
        """
        del name
        ds = self._derive(self._make_iter, self._cardinality)
        ds._tensors, ds._rows = self._tensors, self._rows
        ds._options = self._options.merge(as_options(options))
        return ds

    # ------------------------------------------------------------------ transformations

    def map(self, map_func: Callable[..., Any], num_parallel_calls: int | None = None,
            deterministic: bool | None = None, name: str | None = None) -> Dataset:
        """``map_func`` applied to each element: a tuple element is unpacked into positional
        arguments, any other element (a dict, an array) is one argument, as in tf.data. A list
        or Python number inside the result is an array, a list returned as the result a tuple
        (TF's conversions).

        Example:
            >>> import jaxdist
            >>> [int(v) for v in jaxdist.Dataset.range(1, 6).map(lambda x: x + 1)]
            [2, 3, 4, 5, 6]
        """
        del num_parallel_calls, deterministic, name
        parent = self

        def it(epoch: int) -> Iterator[Any]:
            for el in parent._make_iter(epoch):
                out = call_on_element(map_func, el)
                yield as_element(tuple(out) if isinstance(out, list) else out)

        return self._derive(it, self._cardinality)

    def filter(self, predicate: Callable[..., Any], name: str | None = None) -> Dataset:
        """The elements for which ``predicate`` (called as ``map`` calls its function) is true.

        Raises:
            ValueError: the predicate returned something other than a scalar boolean.

        Example:
            >>> import jaxdist
            >>> [int(v) for v in jaxdist.Dataset.from_tensor_slices([1, 2, 3]).filter(
            ...     lambda x: x < 3)]
            [1, 2]
        """
        del name
        parent = self

        def it(epoch: int) -> Iterator[Any]:
            for el in parent._make_iter(epoch):
                keep = call_on_element(predicate, el)
                if np.ndim(keep) != 0 or np.asarray(keep).dtype != np.bool_:
                    raise ValueError(
                        f"filter: the predicate must return a scalar boolean, got "
                        f"{type(keep).__name__} of shape {np.shape(keep)} and dtype "
                        f"{np.asarray(keep).dtype}")
                if bool(keep):
                    yield el

        return self._derive(it, _UNK)

    def shuffle(self, buffer_size: int, seed: int | None = None,
                reshuffle_each_iteration: bool = True, name: str | None = None) -> Dataset:
        """Shuffles with a buffer of ``buffer_size`` elements, as tf.data does (a buffer of the
        whole dataset is a uniform shuffle).

        Args:
            buffer_size: elements in the buffer (>= 1).
            seed: the seed: a seeded shuffle gives the same orders in every process and run;
                an unseeded one draws its seed once per process (TF: a random seed).
            reshuffle_each_iteration: a new order for each pass over the data (default), or
                the same order every pass.
            name: accepted for compatibility.

        Example:
            >>> import jaxdist
            >>> ds = jaxdist.Dataset.range(10).shuffle(10, seed=0)
            >>> sorted(int(v) for v in ds) == list(range(10))
            True
        """
        del name
        buffer_size = _check_count(buffer_size, "shuffle")
        if buffer_size < 1:
            raise ValueError(f"shuffle: buffer_size must be >= 1, got {buffer_size}")
        parent = self
        fresh = FreshSeed() if seed is None else None

        def rng_for(epoch: int) -> np.random.Generator:
            base = fresh.value if fresh is not None else int(seed)
            return np.random.default_rng([base, epoch if reshuffle_each_iteration else 0])

        if self._rows is not None:
            rows = self._rows

            def shuffled_rows(epoch: int) -> np.ndarray:
                return reservoir_rows(rows(epoch), buffer_size, rng_for(epoch))

            ds = self._indexed(shuffled_rows, self._cardinality)
        else:
            def it(epoch: int) -> Iterator[Any]:
                return reservoir(parent._make_iter(epoch), buffer_size, rng_for(epoch))

            ds = self._derive(it, self._cardinality)
        ds._unseeded_shuffle = ds._unseeded_shuffle or seed is None
        return ds

    def repeat(self, count: int | None = None, name: str | None = None) -> Dataset:
        """The dataset ``count`` times (forever when ``None`` or -1); each pass reshuffles.

        Example:
            >>> import jaxdist
            >>> [int(v) for v in jaxdist.Dataset.from_tensor_slices([1, 2, 3]).repeat(3)]
            [1, 2, 3, 1, 2, 3, 1, 2, 3]
        """
        del name
        if count is not None:
            count = _check_count(count, "repeat")
            if count < 0:
                count = None
        c = self._cardinality
        if count is None:
            card = 0 if c == 0 else _INF
        else:
            card = 0 if count == 0 or c == 0 else c if c in (_INF, _UNK) else c * count
        parent = self
        if self._rows is not None and count is not None:
            rows = self._rows

            def repeated_rows(epoch: int) -> Any:
                parts = [rows(epoch * 1_000_003 + k) for k in range(count)]
                if all(isinstance(p, range) for p in parts) and len({(p.start, p.stop, p.step)
                                                                      for p in parts}) == 1:
                    return RepeatedRange(parts[0], count)
                return np.concatenate([np.asarray(p, np.int64) for p in parts] or
                                      [np.zeros(0, np.int64)])

            return self._indexed(repeated_rows, card)

        def it(epoch: int) -> Iterator[Any]:
            k = 0
            while count is None or k < count:
                yield from parent._make_iter(epoch * 1_000_003 + k)
                k += 1

        return self._derive(it, card)

    def batch(self, batch_size: int, drop_remainder: bool = False,
              num_parallel_calls: int | None = None, deterministic: bool | None = None,
              name: str | None = None) -> Dataset:
        """Stacks ``batch_size`` consecutive elements into one batch (the last one shorter
        unless ``drop_remainder``). Consecutive rows of ``from_tensor_slices`` arrays are a
        read-only view, other batches a new array.

        Example:
            >>> import jaxdist
            >>> list(jaxdist.Dataset.range(8).batch(3))
            [array([0, 1, 2]), array([3, 4, 5]), array([6, 7])]
        """
        del num_parallel_calls, deterministic, name
        batch_size = _check_count(batch_size, "batch")
        if batch_size < 1:
            raise ValueError(f"batch: batch_size must be >= 1, got {batch_size}")
        c = self._cardinality
        if c < 0:
            card = c
        else:
            card = c // batch_size + (0 if drop_remainder or not c % batch_size else 1)
        parent = self
        if self._rows is not None:
            tensors, rows = self._tensors, self._rows

            def sliced(epoch: int) -> Iterator[Any]:
                idx = rows(epoch)
                m = len(idx)
                stop = m - m % batch_size if drop_remainder else m
                leaves, treedef = jax.tree.flatten(tensors)  # once per epoch, not per batch
                for s in range(0, stop, batch_size):
                    yield treedef.unflatten(gather_rows(leaves, idx[s:s + batch_size]))

            out = self._derive(sliced, card)
            out._static_batch = batch_size if drop_remainder else None
            return out

        def it(epoch: int) -> Iterator[Any]:
            buf: list[Any] = []
            for el in parent._make_iter(epoch):
                buf.append(el)
                if len(buf) == batch_size:
                    yield stack_elements(buf, batch_size)
                    buf = []
            if buf and not drop_remainder:
                yield stack_elements(buf, batch_size)

        out = self._derive(it, card)
        out._static_batch = batch_size if drop_remainder else None
        return out

    def unbatch(self, name: str | None = None) -> Dataset:
        """Splits each element into its rows (the inverse of ``batch``).

        Example:
            >>> import jaxdist
            >>> import numpy as np
            >>> elements = [[1, 2, 3], [1, 2], [1, 2, 3, 4]]
            >>> ds = jaxdist.Dataset.from_generator(lambda: elements, np.int64).unbatch()
            >>> [int(v) for v in ds]
            [1, 2, 3, 1, 2, 1, 2, 3, 4]
        """
        del name
        parent = self

        def it(epoch: int) -> Iterator[Any]:
            for el in parent._make_iter(epoch):
                n = num_rows(el, "unbatch")
                for i in range(n):
                    yield jax.tree.map(lambda a, i=i: a[i], el)

        c, b = self._cardinality, self._static_batch
        return self._derive(it, c if c == _INF else c * b if c >= 0 and b else _UNK)

    def take(self, count: int, name: str | None = None) -> Dataset:
        """The first ``count`` elements (all of them when ``count`` is -1).

        Example:
            >>> import jaxdist
            >>> [int(v) for v in jaxdist.Dataset.range(10).take(3)]
            [0, 1, 2]
        """
        del name
        count = _check_count(count, "take")
        c = self._cardinality
        if count < 0:
            return self._derive(self._make_iter, c) if self._rows is None else self._indexed(
                self._rows, c)
        card = count if c == _INF else _UNK if c == _UNK else min(count, c)
        if self._rows is not None:
            rows = self._rows
            return self._indexed(lambda epoch: rows(epoch)[:count], card)
        parent = self

        def it(epoch: int) -> Iterator[Any]:
            if count == 0:
                return
            for i, el in enumerate(parent._make_iter(epoch)):
                yield el
                if i + 1 >= count:
                    return

        return self._derive(it, card)

    def skip(self, count: int, name: str | None = None) -> Dataset:
        """All but the first ``count`` elements (nothing when ``count`` is -1).

        Example:
            >>> import jaxdist
            >>> [int(v) for v in jaxdist.Dataset.range(10).skip(7)]
            [7, 8, 9]
        """
        del name
        count = _check_count(count, "skip")
        c = self._cardinality
        parent = self
        if count < 0:  # skips everything (an infinite dataset is read forever, as in TF)
            def none(epoch: int) -> Iterator[Any]:
                for _ in parent._make_iter(epoch):
                    pass
                yield from ()

            return self._derive(none, c if c < 0 else 0)
        card = c if c in (_INF, _UNK) else max(0, c - count)
        if self._rows is not None:
            rows = self._rows
            return self._indexed(lambda epoch: rows(epoch)[count:], card)

        def it(epoch: int) -> Iterator[Any]:
            for i, el in enumerate(parent._make_iter(epoch)):
                if i >= count:
                    yield el

        return self._derive(it, card)

    def shard(self, num_shards: int, index: int, name: str | None = None) -> Dataset:
        """Every ``num_shards``-th element from ``index`` on.

        Example:
            >>> import jaxdist
            >>> [int(v) for v in jaxdist.Dataset.range(10).shard(num_shards=3, index=1)]
            [1, 4, 7]
        """
        del name
        num_shards, index = _check_count(num_shards, "shard"), _check_count(index, "shard")
        if num_shards < 1:
            raise ValueError(f"shard: num_shards must be >= 1, got {num_shards}")
        if not 0 <= index < num_shards:
            raise ValueError(f"shard: index must be in [0, {num_shards}), got {index}")
        c = self._cardinality
        card = c if c < 0 else c // num_shards + (index < c % num_shards)
        if self._rows is not None:
            rows = self._rows
            return self._indexed(lambda epoch: rows(epoch)[index::num_shards], card)
        parent = self

        def it(epoch: int) -> Iterator[Any]:
            for i, el in enumerate(parent._make_iter(epoch)):
                if i % num_shards == index:
                    yield el

        return self._derive(it, card)

    def cache(self, filename: str = "", name: str | None = None) -> Dataset:
        """Keeps the elements of the first complete pass and replays them afterwards, as
        tf.data does (a shuffle before ``cache`` is then the same every pass).

        Args:
            filename: ``""`` caches in memory; a path caches in ``<filename>.jaxdist-cache``
                (pickled; written once a pass completes, and read by later passes and runs).
            name: accepted for compatibility.

        Example:
            >>> import jaxdist
            >>> ds = jaxdist.Dataset.range(5).map(lambda x: x ** 2).cache()
            >>> [int(v) for v in ds] == [int(v) for v in ds] == [0, 1, 4, 9, 16]
            True
        """
        del name
        path = f"{os.fspath(filename)}.jaxdist-cache" if filename else None
        if self._rows is not None and path is None:
            rows = self._rows
            memo: dict[str, Any] = {}

            def cached_rows(epoch: int) -> Any:
                if "rows" not in memo:
                    memo["rows"] = rows(epoch)
                return memo["rows"]

            return self._indexed(cached_rows, self._cardinality)
        parent = self
        store: dict[str, list[Any]] = {}

        def it(epoch: int) -> Iterator[Any]:
            if "elements" not in store and path is not None and os.path.exists(path):
                with open(path, "rb") as f:
                    store["elements"] = pickle.load(f)
            if "elements" in store:
                yield from store["elements"]
                return
            buf = []
            for el in parent._make_iter(epoch):
                buf.append(el)
                yield el
            store["elements"] = buf
            if path is not None:
                tmp = f"{path}.tmp{os.getpid()}"
                try:
                    with open(tmp, "wb") as f:
                        pickle.dump(buf, f)
                    os.replace(tmp, path)
                except BaseException:  # a full disk: no half-written cache file is left
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise

        return self._derive(it, self._cardinality)

    def prefetch(self, buffer_size: int | None = None, name: str | None = None) -> Dataset:
        """Accepted for tf.data compatibility: the same elements (distributed iterators
        prefetch batches to the devices, ``InputOptions.experimental_per_replica_buffer_size``).

        Example:
            >>> import jaxdist
            >>> ds = jaxdist.Dataset.range(3).prefetch(jaxdist.data.AUTOTUNE)
        """
        del buffer_size, name
        return self

    def enumerate(self, start: int = 0, name: str | None = None) -> Dataset:
        """``(index, element)`` pairs, the index an int64 counting from ``start``.

        Example:
            >>> import jaxdist
            >>> [(int(i), int(v)) for i, v in
            ...  jaxdist.Dataset.from_tensor_slices([1, 2, 3]).enumerate(start=5)]
            [(5, 1), (6, 2), (7, 3)]
        """
        del name
        parent = self

        def it(epoch: int) -> Iterator[Any]:
            for i, el in enumerate(parent._make_iter(epoch)):
                yield np.int64(start + i), el

        return self._derive(it, self._cardinality)

    def concatenate(self, dataset: Dataset, name: str | None = None) -> Dataset:
        """This dataset's elements, then ``dataset``'s (same structure).

        Example:
            >>> import jaxdist
            >>> a, b = jaxdist.Dataset.range(1, 4), jaxdist.Dataset.range(4, 8)
            >>> [int(v) for v in a.concatenate(b)]
            [1, 2, 3, 4, 5, 6, 7]
        """
        del name
        if not isinstance(dataset, Dataset):
            raise TypeError(f"concatenate needs a jaxdist.Dataset, got {type(dataset).__name__}")
        first, second = self, dataset

        def it(epoch: int) -> Iterator[Any]:
            head = None
            for el in first._make_iter(epoch):
                head = jax.tree.structure(el) if head is None else head
                yield el
            for el in second._make_iter(epoch):
                if head is not None and jax.tree.structure(el) != head:
                    raise TypeError(
                        f"Two datasets to concatenate have different element structures: "
                        f"{head} and {jax.tree.structure(el)}")
                yield el

        return self._derive(it, _card_add(self._cardinality, dataset._cardinality),
                            self, dataset)

    @staticmethod
    def zip(*datasets: Any, name: str | None = None) -> Dataset:
        """Elements of several datasets side by side, in their structure (``Dataset.zip(a, b)``
        or ``Dataset.zip((a, b))`` gives tuples, ``Dataset.zip({"x": a, "y": b})`` dicts);
        as long as the shortest.

        Example:
            >>> import jaxdist
            >>> a, b = jaxdist.Dataset.range(1, 4), jaxdist.Dataset.range(4, 7)
            >>> [(int(i), int(j)) for i, j in jaxdist.Dataset.zip(a, b)]
            [(1, 4), (2, 5), (3, 6)]
        """
        del name
        if not datasets:
            raise TypeError("zip needs at least one dataset")
        struct = datasets[0] if len(datasets) == 1 else datasets
        is_ds = lambda x: isinstance(x, Dataset)  # noqa: E731
        leaves, treedef = jax.tree.flatten(struct, is_leaf=is_ds)
        if not leaves or not all(is_ds(d) for d in leaves):
            raise TypeError(
                f"zip needs datasets (or a tuple / dict of datasets), got "
                f"{[type(d).__name__ for d in leaves]}")
        if len(datasets) == 1 and is_ds(struct):
            raise TypeError("zip needs a tuple or dict of datasets (or several datasets), got "
                            "one dataset")
        card = _INF
        for d in leaves:
            c = d._cardinality
            if c == _UNK:
                card = _UNK
                break
            if c != _INF and (card == _INF or c < card):
                card = c

        def it(epoch: int) -> Iterator[Any]:
            iters = [d._make_iter(epoch) for d in leaves]
            while True:
                try:
                    values = [next(i) for i in iters]
                except StopIteration:
                    return
                yield jax.tree.unflatten(treedef, values)

        return leaves[0]._derive(it, card, *leaves)


__all__ = [
    "AUTOTUNE",
    "INFINITE_CARDINALITY",
    "UNKNOWN_CARDINALITY",
    "Dataset",
]


def is_foreign_dataset(obj: Any) -> bool:
    """Whether ``obj`` is a tf.data-like dataset (it has ``as_numpy_iterator``) rather than a
    jaxdist ``Dataset``: its elements are read through ``as_numpy_iterator()``.

    Example:
        >>> from jaxdist._src.input.dataset import Dataset, is_foreign_dataset
        >>> is_foreign_dataset(Dataset.range(3)), is_foreign_dataset([1, 2])
        (False, False)
    """
    return hasattr(obj, "as_numpy_iterator") and not isinstance(obj, Dataset)


def has_unseeded_shuffle(obj: Any) -> bool:
    """Whether ``obj`` is a jaxdist ``Dataset`` with a shuffle without a seed anywhere in its
    pipeline (such a shuffle differs between processes).

    Example:
        >>> from jaxdist._src.input.dataset import Dataset, has_unseeded_shuffle
        >>> has_unseeded_shuffle(Dataset.range(4).shuffle(4).batch(2))
        True
        >>> has_unseeded_shuffle(Dataset.range(4).shuffle(4, seed=0))
        False
    """
    return isinstance(obj, Dataset) and bool(obj._unseeded_shuffle)
