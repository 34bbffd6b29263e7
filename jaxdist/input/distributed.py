"""Distributed datasets: split global batches across replicas and prefetch them to devices.

A global batch of ``B`` rows is split in order over the ``N`` replicas: replica ``i`` gets rows
``i*B/N`` to ``(i+1)*B/N - 1``, as TF does. With several processes, each process feeds its own
share of the global batch (its local replicas' rows) and the pieces are assembled into one global
array with ``jax.make_array_from_process_local_data``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxdist.input.options import InputContext, InputOptions
from jaxdist.strategies.values import PerReplica

if TYPE_CHECKING:
    from jaxdist.strategies.strategy import StrategyExtended

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
    if hasattr(dataset, "as_numpy_iterator") and not hasattr(dataset, "_make_iter"):
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

    def __init__(self, extended: StrategyExtended, options: InputOptions):
        self.ext = extended
        self.options = options
        self.sharding = extended._data_sharding
        self.num_replicas = extended._num_replicas
        local = [d for d in extended._devices if d.process_index == jax.process_index()]
        self.num_local = len(local)
        self.multi_process = jax.process_count() > 1

    def split(self, element: Any, what: str = "global batch") -> Any:
        """Splits a host batch (leading axis = this process's rows) into PerReplica values."""
        element = _as_numpy_tree(element)
        leaves = jax.tree.leaves(element)
        if not leaves:
            raise ValueError("a dataset element has no arrays")
        rows = {x.shape[0] if x.ndim else None for x in leaves}
        if None in rows:
            raise ValueError("dataset elements must be batched arrays (rank >= 1); got a scalar")
        if len(rows) != 1:
            raise ValueError(f"arrays in one {what} have different batch sizes: {sorted(rows)}")
        b = rows.pop()
        k = self.num_local
        mask = None
        if b % k:
            policy = self.options.partial_batch
            if policy == "error":
                raise ValueError(
                    f"The {what} of {b} rows does not divide across {k} replicas. Use a batch "
                    f"size that is a multiple of {k}, drop_remainder=True, or "
                    f"InputOptions(partial_batch='drop'|'pad')"
                )
            if policy == "drop":
                return None
            padded = -(-b // k) * k
            element = jax.tree.map(
                lambda x: np.concatenate([x, np.zeros((padded - b, *x.shape[1:]), x.dtype)]),
                element,
            )
            mask = np.concatenate([np.ones(b, np.float32), np.zeros(padded - b, np.float32)])
            b = padded
        elif self.options.partial_batch == "pad":
            mask = np.ones(b, np.float32)
        out = jax.tree.map(lambda x: self._place(x.reshape(k, b // k, *x.shape[1:])), element)
        if self.options.partial_batch == "pad":
            return out, self._place(mask.reshape(k, b // k))
        return out

    def stack(self, elements: list[Any]) -> Any:
        """One element per local replica -> PerReplica values."""
        elements = [_as_numpy_tree(e) for e in elements]
        stacked = jax.tree.map(lambda *xs: np.stack(xs), *elements)
        return jax.tree.map(self._place, stacked)

    def _place(self, local: np.ndarray) -> PerReplica:
        if not self.options.experimental_fetch_to_device:
            if self.multi_process:
                raise ValueError("experimental_fetch_to_device=False needs a single process")
            return PerReplica(local)
        if self.multi_process:
            global_shape = (self.num_replicas, *local.shape[1:])
            arr = jax.make_array_from_process_local_data(self.sharding, local, global_shape)
        else:
            arr = jax.device_put(local, self.sharding)
        return PerReplica(arr)


class _Prefetcher:
    """Runs ``produce`` in a background thread, ``buffer`` elements ahead."""

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

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


class DistributedIterator:
    """Iterator over per-replica batches (``tf.distribute.DistributedIterator``).

    Example:
        >>> it = iter(strategy.experimental_distribute_dataset(batches))
        >>> x = it.get_next()                  # a PerReplica batch
        >>> maybe = it.get_next_as_optional()  # None at the end of the data
    """

    def __init__(self, source: Iterator[Any], produce: Callable[[Any], Any], options: InputOptions):
        buffer = options.experimental_per_replica_buffer_size
        self._produce = produce
        self._source = source
        self._prefetcher = _Prefetcher(source, produce, buffer) if buffer > 0 else None

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        if self._prefetcher is not None:
            return self._prefetcher.get()
        while True:
            out = self._produce(next(self._source))
            if out is not None:
                return out

    def get_next(self) -> Any:
        """The next per-replica batch (raises ``StopIteration`` at the end)."""
        return next(self)

    def get_next_as_optional(self) -> Any:
        """The next batch, or ``None`` at the end of the data."""
        try:
            return next(self)
        except StopIteration:
            return None

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


class DistributedDataset:
    """A dataset whose global batches are split across the replicas of a strategy.

    Iterating gives pytrees of ``PerReplica`` values to pass to ``strategy.run``.

    Example:
        >>> dist = strategy.experimental_distribute_dataset(
        ...     jaxdist.Dataset.from_tensor_slices((x, y)).batch(64))
        >>> for xb, yb in dist:
        ...     strategy.run(step, args=(state, xb, yb))
    """

    def __init__(
        self, extended: StrategyExtended, dataset: Any, options: InputOptions | None = None
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
        return DistributedIterator(_iterate(self._dataset), self._sharder.split, self._options)

    @property
    def options(self) -> InputOptions:
        return self._options


class DistributedDatasetsFromFunction:
    """Per-pipeline datasets from ``dataset_fn(InputContext)``; each element feeds one replica."""

    def __init__(
        self,
        extended: StrategyExtended,
        dataset_fn: Callable[[InputContext], Any],
        options: InputOptions | None = None,
    ):
        self._ext = extended
        self._options = options or InputOptions()
        self._sharder = _Sharder(extended, self._options)
        self.input_context = InputContext(
            num_input_pipelines=jax.process_count(),
            input_pipeline_id=jax.process_index(),
            num_replicas_in_sync=extended._num_replicas,
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
                        return
                yield group

        return DistributedIterator(grouped(), self._sharder.stack, self._options)
