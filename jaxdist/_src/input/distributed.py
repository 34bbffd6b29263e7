"""Distributed datasets: split global batches across replicas and prefetch them to devices.

A global batch of ``B`` rows is split in order over the ``N`` replicas: replica ``i`` gets rows
``i*B/N`` to ``(i+1)*B/N - 1``, as TF does. With several processes, each process feeds its own
share of the global batch (its local replicas' rows) and the pieces are assembled into one global
array with ``jax.make_array_from_process_local_data``.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import jax
import numpy as np

from jaxdist._src.input import transfer
from jaxdist._src.input.dataset import is_foreign_dataset
from jaxdist._src.input.optional import Optional, empty_with_lazy_spec
from jaxdist._src.input.options import InputContext, InputOptions
from jaxdist._src.values.per_replica import PerReplica, PerReplicaSpec


class ReplicaLayout(Protocol):
    """What distributed input needs of a strategy's ``extended`` (``StrategyExtended`` has it).

    ``_src.input`` sits below ``_src.strategies``: it reads these public properties and
    imports nothing of the strategies.
    """

    @property
    def worker_devices(self) -> tuple[Any, ...]: ...

    @property
    def num_replicas_in_mesh(self) -> int: ...

    @property
    def per_replica_sharding(self) -> jax.sharding.Sharding: ...

    @property
    def replicated_sharding(self) -> jax.sharding.Sharding: ...

_END = object()


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "numpy") and not isinstance(x, (np.ndarray, jax.Array)):
        x = x.numpy()  # tf.Tensor
    return np.asarray(x)


def _as_numpy_tree(element: Any) -> Any:
    leaves = jax.tree.leaves(element)
    for leaf in leaves:
        if isinstance(leaf, str):
            raise TypeError(
                f"dataset elements must be arrays (or tuples/dicts of arrays), got the string "
                f"{leaf!r}; to distribute a dict of full arrays use "
                f"jaxdist.Dataset.from_tensor_slices(d).batch(global_batch_size)"
            )
    return jax.tree.map(_to_numpy, element)


def _iterate(dataset: Any) -> Iterator[Any]:
    if is_foreign_dataset(dataset):
        return iter(dataset.as_numpy_iterator())  # tf.data.Dataset
    try:
        return iter(dataset)
    except TypeError:
        raise TypeError(
            f"dataset must be an iterable of batches (or a tf.data.Dataset), got "
            f"{type(dataset).__name__}"
        ) from None


class _Sharder:
    """Turns host batches into per-replica device arrays for one strategy."""

    def __init__(self, extended: ReplicaLayout, options: InputOptions):
        self.ext = extended
        self.options = options
        self.sharding = extended.per_replica_sharding
        self.num_replicas = extended.num_replicas_in_mesh
        local = [d for d in extended.worker_devices if d.process_index == jax.process_index()]
        self.num_local = len(local)
        self.multi_process = jax.process_count() > 1
        self.declared_rows: int | None = None  # the first global batch's size (TF's split)

    def split(self, element: Any, what: str = "global batch") -> Any:
        """Splits a host batch (leading axis = this process's rows) into PerReplica values.

        A batch that divides by ``k`` is split evenly. Otherwise, as TF's rebatching: the first
        batch fixes each replica's share (``B // k``, the first ``B % k`` replicas one more) and
        a shorter batch fills the shares in order, so ``range(9).batch(2)`` on 2 replicas ends
        with ``[[8], []]`` and a last batch of 29 rows after batches of 64 on 4 replicas is split
        16, 13, 0, 0.
        """
        element = _as_numpy_tree(element)
        leaves = jax.tree.leaves(element)
        if not leaves:
            raise ValueError("a dataset element has no arrays")
        rows = {x.shape[0] if x.ndim else None for x in leaves}
        k = self.num_local
        if None in rows:
            if k == 1 and not self.multi_process:
                # One replica: an unbatched element is that replica's value (TF does the same).
                return jax.tree.map(lambda x: self._place(x[None]), element)
            raise ValueError(
                f"dataset elements must be batched arrays (rank >= 1) to split across {k} "
                f"replicas; got a scalar. Batch the dataset (Dataset.batch(global_batch_size))"
            )
        if len(rows) != 1:
            raise ValueError(f"arrays in one {what} have different batch sizes: {sorted(rows)}")
        b = rows.pop()
        if self.declared_rows is None:
            self.declared_rows = b
        if b % k == 0:
            # An even split whenever one exists: batches of legitimately different sizes (a
            # Trainer's k-step chunks, a generator) are not forced into the first batch's shares.
            sizes = (b // k,) * k
        else:
            sizes = split_sizes(b, self.declared_rows, k)
        if len(set(sizes)) == 1 and sum(sizes) == b:
            mask = np.ones(b, np.float32) if self.options.partial_batch == "pad" else None
            flat, tree = jax.tree.flatten(element)
            out = tree.unflatten(self._place_all([x.reshape(k, b // k, *x.shape[1:])
                                                  for x in flat]))
            return out if mask is None else (out, self._place(mask.reshape(k, b // k)))
        policy = self.options.partial_batch
        if policy == "error":
            raise ValueError(
                f"The {what} of {b} rows does not split evenly across {k} replicas "
                f"(per-replica rows {list(sizes)}). Use a batch size that is a multiple of {k}, "
                f"drop_remainder=True, or InputOptions(partial_batch='split'|'drop'|'pad')"
            )
        if policy == "drop":
            return None
        if policy == "pad":
            padded = -(-b // k) * k
            element = jax.tree.map(
                lambda x: np.concatenate([x, np.zeros((padded - b, *x.shape[1:]), x.dtype)]),
                element,
            )
            mask = np.concatenate([np.ones(b, np.float32), np.zeros(padded - b, np.float32)])
            out = jax.tree.map(
                lambda x: self._place(x.reshape(k, padded // k, *x.shape[1:])), element
            )
            return out, self._place(mask.reshape(k, padded // k))
        starts = np.cumsum([0, *sizes[:-1]])
        parts = [jax.tree.map(lambda x, s=s, n=n: x[s : s + n], element)
                 for s, n in zip(starts, sizes)]
        return self._stack_ragged(parts, what)

    def stack(self, elements: list[Any]) -> Any:
        """One element per local replica -> PerReplica values (an incomplete group: TF's empty
        batches for the replicas without an element)."""
        elements = [_as_numpy_tree(e) for e in elements]
        k = self.num_local
        rows = [{x.shape[0] if x.ndim else None for x in jax.tree.leaves(e)} for e in elements]
        full_shapes = len(elements) == k and all(
            len({x.shape for x in xs}) == 1
            for xs in zip(*(jax.tree.leaves(e) for e in elements))
        )
        if full_shapes:
            # jax.tree.map checks the elements share one structure (and names both if not).
            flat, tree = jax.tree.flatten(jax.tree.map(lambda *xs: np.stack(xs), *elements))
            return tree.unflatten(self._place_all(flat))
        policy = self.options.partial_batch
        what = (
            f"last group of {len(elements)} per-replica elements for {k} replicas"
            if len(elements) < k else "group of per-replica elements of different batch sizes"
        )
        if any(None in r for r in rows):
            if policy == "drop":
                return None
            raise ValueError(
                f"The {what} cannot be distributed: the elements are unbatched (scalars), so "
                f"a replica without data cannot get an empty batch. Batch the per-replica "
                f"datasets, or use InputOptions(partial_batch='drop')"
            )
        if policy == "error":
            raise ValueError(
                f"The {what} does not fill every replica. Use drop_remainder=True, or "
                f"InputOptions(partial_batch='split'|'drop')"
            )
        if policy == "drop":
            return None
        empty = jax.tree.map(lambda x: x[:0], elements[0])
        parts = list(elements) + [empty] * (k - len(elements))
        return self._stack_ragged(parts, what)

    def _stack_ragged(self, parts: list[Any], what: str) -> Any:
        """Per-replica pieces of different lengths -> PerReplica(padded, lengths)."""
        if self.multi_process:
            raise ValueError(
                f"The {what} gives the replicas different numbers of rows, which jaxdist cannot "
                f"yet assemble across processes. Use drop_remainder=True or "
                f"InputOptions(partial_batch='drop')"
            )
        lengths = tuple(int(jax.tree.leaves(p)[0].shape[0]) for p in parts)
        longest = max(lengths)

        def pad_stack(*xs):
            out = np.zeros((len(xs), longest, *xs[0].shape[1:]), xs[0].dtype)
            for i, x in enumerate(xs):
                out[i, : x.shape[0]] = x
            return self._place(out, lengths)

        return jax.tree.map(pad_stack, *parts)

    def _place_all(self, locals_: list[np.ndarray]) -> list[Any]:
        """``_place`` of several full batches in one transfer (``transfer.put``: a
        ``device_put`` per array costs more than the arrays of a small batch)."""
        if self.multi_process or not self.options.experimental_fetch_to_device:
            return [self._place(x) for x in locals_]
        if self.num_replicas == 1:  # one replica: plain arrays (as _place)
            return transfer.put([x[0] for x in locals_], self.ext.replicated_sharding)
        return [PerReplica(a) for a in transfer.put(locals_, self.sharding)]

    def _place(self, local: np.ndarray, lengths: tuple[int, ...] | None = None) -> Any:
        if self.num_replicas == 1 and not self.multi_process:
            # One replica: TF's regroup of one value is the value itself (a plain array).
            if not self.options.experimental_fetch_to_device:
                return local[0]
            return transfer.put([local[0]], self.ext.replicated_sharding)[0]
        if not self.options.experimental_fetch_to_device:
            if self.multi_process:
                raise ValueError("experimental_fetch_to_device=False needs a single process")
            return PerReplica(local, lengths)
        if self.multi_process:
            global_shape = (self.num_replicas, *local.shape[1:])
            arr = jax.make_array_from_process_local_data(self.sharding, local, global_shape)
        else:
            arr = transfer.put([local], self.sharding)[0]
        return PerReplica(arr, lengths)


def split_sizes(rows: int, declared_rows: int, num_replicas: int) -> tuple[int, ...]:
    """Each replica's rows of a batch of ``rows``, as TF's rebatching splits it.

    ``declared_rows`` (the dataset's batch size) gives replica ``i`` a share of
    ``declared // n + (i < declared % n)`` rows; a shorter batch fills the shares in order.

    Example:
        >>> from jaxdist._src.input.distributed import split_sizes
        >>> split_sizes(1, 2, 2)      # range(9).batch(2), last batch, 2 replicas
        (1, 0)
        >>> split_sizes(29, 64, 4)
        (16, 13, 0, 0)
    """
    n = num_replicas
    declared = max(declared_rows, rows)
    shares = [declared // n + (i < declared % n) for i in range(n)]
    out, left = [], rows
    for share in shares:
        take = min(share, left)
        out.append(take)
        left -= take
    return tuple(out)


def _spec_tree(element: Any, rows_per_replica: list[int | None]) -> Any:
    """TF's element_spec: per array, one ShapeDtypeStruct per replica (plain with one)."""

    def one(x: np.ndarray) -> Any:
        specs = [
            jax.ShapeDtypeStruct(
                x.shape if r is None else (r, *x.shape[1:]), jax.dtypes.canonicalize_dtype(x.dtype)
            )
            for r in rows_per_replica
        ]
        return specs[0] if len(specs) == 1 else PerReplicaSpec(*specs)

    return jax.tree.map(one, element)


def _first_element(dataset: Any) -> Any:
    if iter(dataset) is dataset if not hasattr(dataset, "as_numpy_iterator") else False:
        raise ValueError(
            "element_spec needs a dataset that can be iterated again (a jaxdist.Dataset, a list, "
            "a tf.data.Dataset); reading the first element of a one-shot iterator would lose it"
        )
    try:
        return _as_numpy_tree(next(_iterate(dataset)))
    except StopIteration:
        raise ValueError("element_spec of an empty dataset is unknown") from None


class _AheadPrefetcher:
    """Keeps ``buffer`` elements produced ahead of the one returned, in the caller's thread
    (as flax's ``prefetch_to_device``): their device copies run while the steps before them
    compute. An error of the source (or ``produce``) is raised at the element it stopped.
    """

    def __init__(self, source: Iterator[Any], produce: Callable[[Any], Any], buffer: int):
        self._source = source
        self._produce = produce
        self._buffer = buffer
        self._queue: collections.deque = collections.deque()
        self._ended = False  # the source ended or failed: that outcome is queued last

    def _fill(self) -> None:
        while not self._ended and len(self._queue) <= self._buffer:
            try:
                out = None
                while out is None:  # produce() returns None for a dropped batch
                    out = self._produce(next(self._source))
                self._queue.append(("ok", out))
            except StopIteration:
                self._ended = True
                self._queue.append(("end", None))
            except Exception as e:  # noqa: BLE001 - raised at its place in the sequence
                self._ended = True
                self._queue.append(("err", e))

    def get(self) -> Any:
        self._fill()
        kind, value = self._queue[0]
        if kind == "end":
            raise StopIteration
        self._queue.popleft()
        if kind == "err":
            self._queue.append(("end", None))  # a failed source is finished
            raise value
        return value

    def close(self, wait: bool = True) -> None:  # no thread: nothing to wait for
        self._queue.clear()
        self._ended = True
        self._queue.append(("end", None))


class _Prefetcher:
    """Runs ``produce`` in a background thread, ``buffer`` elements ahead
    (``InputOptions(prefetch_thread=True)``)."""

    def __init__(self, source: Iterator[Any], produce: Callable[[Any], Any], buffer: int):
        self._source = source
        self._produce = produce
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, buffer))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name="jaxdist-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self) -> None:
        try:
            for element in self._source:
                if self._stop.is_set():
                    return
                out = self._produce(element)
                if out is None:
                    continue
                if not self._put(("ok", out)):
                    return
            self._put(("end", None))
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            self._put(("err", e))

    def get(self) -> Any:
        while True:
            try:
                kind, value = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise StopIteration from None
        if kind == "end":
            self._stop.set()
            raise StopIteration
        if kind == "err":
            self._stop.set()
            raise value
        return value

    def close(self, wait: bool = True) -> None:
        """Stops the thread; with ``wait``, waits for it (at most 5 s)."""
        self._stop.set()
        if wait:
            self._thread.join(timeout=5.0)


class DistributedIterator:
    """Iterator over per-replica batches (``tf.distribute.DistributedIterator``).

    Example:
        >>> import jax, jaxdist
        >>> import numpy as np
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
        >>> batches = jaxdist.Dataset.from_tensor_slices(np.ones((16, 3), np.float32)).batch(8)
        >>> it = iter(strategy.experimental_distribute_dataset(batches))
        >>> x = it.get_next()                  # a PerReplica batch
        >>> maybe = it.get_next_as_optional()  # an Optional: no value at the end of the data
        >>> maybe.has_value()
        True
        >>> it.get_next_as_optional().has_value()
        False
    """

    def __init__(
        self,
        source: Iterator[Any],
        produce: Callable[[Any], Any],
        options: InputOptions,
        spec: Callable[[], Any] | None = None,
    ):
        self._spec = spec
        buffer = options.experimental_per_replica_buffer_size
        self._produce = produce
        self._source = source
        if buffer == 0:
            self._prefetcher: _Prefetcher | _AheadPrefetcher | None = None
        elif options.prefetch_thread:
            self._prefetcher = _Prefetcher(source, produce, buffer)
        else:
            self._prefetcher = _AheadPrefetcher(source, produce, buffer)

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        if self._prefetcher is not None:
            return self._prefetcher.get()
        while True:
            out = self._produce(next(self._source))
            if out is not None:
                return out

    @property
    def element_spec(self) -> Any:
        """The type of each element (see ``DistributedDataset.element_spec``)."""
        if self._spec is None:
            raise ValueError("this iterator does not know its element_spec")
        return self._spec()

    def get_next(self) -> Any:
        """The next per-replica batch (raises ``StopIteration`` at the end)."""
        return next(self)

    def get_next_as_optional(self) -> Optional:
        """The next batch as an ``Optional`` (``tf.experimental.Optional``): ``has_value()``
        is False at the end of the data, ``get_value()`` gives the batch."""
        try:
            return Optional.from_value(next(self))
        except StopIteration:
            return empty_with_lazy_spec(self._spec)

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()

    def __del__(self):
        # Only tells a prefetch thread to stop: a finalizer runs wherever the collector does,
        # maybe while this thread holds a lock that the prefetch thread waits for, and a
        # source that blocks (a stream waiting for data) holds the thread too: joining there
        # stalls the program for the join's timeout. The thread ends at its next element, or
        # within 0.1 s when its queue is full.
        try:
            if self._prefetcher is not None:
                self._prefetcher.close(wait=False)
        except Exception:  # noqa: BLE001
            pass


class DistributedDataset:
    """A dataset whose global batches are split across the replicas of a strategy.

    Iterating gives pytrees of ``PerReplica`` values to pass to ``strategy.run``.

    Example:
        >>> import jax, jaxdist
        >>> import jax.numpy as jnp
        >>> import numpy as np
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
        >>> x, y = np.ones((128, 3), np.float32), np.zeros((128,), np.float32)
        >>> step = lambda w, xb, yb: jnp.mean((xb @ w - yb) ** 2)
        >>> dist = strategy.experimental_distribute_dataset(
        ...     jaxdist.Dataset.from_tensor_slices((x, y)).batch(64))
        >>> for xb, yb in dist:
        ...     loss = strategy.run(step, args=(jnp.zeros(3), xb, yb))
    """

    def __init__(
        self, extended: ReplicaLayout, dataset: Any, options: InputOptions | None = None
    ):
        self._ext = extended
        self._dataset = dataset
        self._options = options or InputOptions()
        if not isinstance(self._options, InputOptions):
            raise TypeError(f"options must be jaxdist.InputOptions, got {options!r}")
        if isinstance(dataset, dict):
            raise TypeError(
                "experimental_distribute_dataset got a dict, not an iterable of batches; use "
                "jaxdist.Dataset.from_tensor_slices(d).batch(global_batch_size)"
            )
        self._sharder = _Sharder(extended, self._options)

    def __iter__(self) -> DistributedIterator:
        return DistributedIterator(
            _iterate(self._dataset), self._sharder.split, self._options,
            lambda: self.element_spec,
        )

    @property
    def element_spec(self) -> Any:
        """The type of each element: per array, one ``jax.ShapeDtypeStruct`` per replica.

        With several replicas each array's spec is a ``PerReplicaSpec`` (TF's type of a
        ``PerReplica``), with one replica the plain ``jax.ShapeDtypeStruct``. The row count is a
        full batch's share (TF's split of the first batch); the last batch may be shorter.

        Example:
            >>> import jax, jaxdist
            >>> import numpy as np
            >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])  # doctest: +NEEDS_2_DEVICES
            >>> x = np.ones((16, 3), np.float32)
            >>> dist = strategy.experimental_distribute_dataset(
            ...     jaxdist.Dataset.from_tensor_slices(x).batch(8))
            >>> dist.element_spec          # 2 replicas: 4 rows each
            PerReplicaSpec(ShapeDtypeStruct(shape=(4, 3), ...), ShapeDtypeStruct(shape=(4, 3), ...))
        """
        if not hasattr(self, "_element_spec"):
            first = _first_element(self._dataset)
            k = self._sharder.num_local
            leaves = jax.tree.leaves(first)
            if leaves and leaves[0].ndim == 0:
                rows: list[int | None] = [None] * k
            else:
                rows = list(split_sizes(leaves[0].shape[0], leaves[0].shape[0], k))
            self._element_spec = _spec_tree(first, rows)
        return self._element_spec

    @property
    def options(self) -> InputOptions:
        return self._options


class DistributedDatasetsFromFunction:
    """Per-pipeline datasets from ``dataset_fn(InputContext)``; each element feeds one replica."""

    def __init__(
        self,
        extended: ReplicaLayout,
        dataset_fn: Callable[[InputContext], Any],
        options: InputOptions | None = None,
    ):
        self._ext = extended
        self._options = options or InputOptions()
        self._sharder = _Sharder(extended, self._options)
        self.input_context = InputContext(
            num_input_pipelines=jax.process_count(),
            input_pipeline_id=jax.process_index(),
            num_replicas_in_sync=extended.num_replicas_in_mesh,
        )
        self._dataset = dataset_fn(self.input_context)

    def __iter__(self) -> DistributedIterator:
        k = self._sharder.num_local
        source = _iterate(self._dataset)

        def grouped() -> Iterator[list[Any]]:
            while True:
                group = []
                for _ in range(k):
                    try:
                        group.append(next(source))
                    except StopIteration:
                        if group:  # TF: the last group gives the other replicas empty batches
                            yield group
                        return
                yield group

        return DistributedIterator(
            grouped(), self._sharder.stack, self._options, lambda: self.element_spec
        )

    @property
    def element_spec(self) -> Any:
        """The type of each element: per array, one ``jax.ShapeDtypeStruct`` per replica.

        Each replica gets whole elements of the dataset ``dataset_fn`` returned, so every
        replica's spec is that dataset's element type (``PerReplicaSpec`` with several replicas).

        Example:
            >>> import jax, jaxdist
            >>> import numpy as np
            >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])  # doctest: +NEEDS_2_DEVICES
            >>> def dataset_fn(ctx):
            ...     return jaxdist.Dataset.from_tensor_slices(np.ones((16, 3), np.float32)).batch(4)
            >>> dist = strategy.distribute_datasets_from_function(dataset_fn)
            >>> dist.element_spec
            PerReplicaSpec(ShapeDtypeStruct(shape=(4, 3), ...), ShapeDtypeStruct(shape=(4, 3), ...))
        """
        if not hasattr(self, "_element_spec"):
            first = _first_element(self._dataset)
            self._element_spec = _spec_tree(first, [None] * self._sharder.num_local)
        return self._element_spec

    @property
    def options(self) -> InputOptions:
        return self._options


def source_dataset(dist: DistributedDataset | DistributedDatasetsFromFunction) -> Any:
    """The dataset ``dist`` splits over the replicas: the one given to
    ``experimental_distribute_dataset``, or the one ``dataset_fn`` returned on this process
    (``ClusterCoordinator.create_per_worker_dataset`` distributes it again on each worker)."""
    return dist._dataset
