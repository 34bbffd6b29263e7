"""Keras input under jaxdist: the data adapters ``fit`` / ``evaluate`` / ``predict`` read.

``jaxdist._src.keras.partial_batches`` reads every input through ``inner_adapter`` (then pads
and masks its batches). In one process that is Keras's own adapter for the data given, or
``DatasetAdapter`` for a ``jaxdist.Dataset`` / ``tf.data.Dataset``. Across processes
(``MultiWorkerMirroredStrategy``) every process runs the same program on the same input, and
each keeps its share of every global batch, as TF's Keras does, by input kind:

- **arrays** (numpy, jax): every process cuts the same global batches (``batch_size`` rows; a
  ``shuffle`` draws its permutation from a seed broadcast by process 0) and keeps its rows
  (``AutoShardPolicy.DATA``): process ``p`` of ``P`` keeps the ``p``-th of ``P`` consecutive
  parts (``ProcessRowsAdapter``).
- **Python generators, ``keras.utils.PyDataset``** and any other input Keras adapts: each
  process iterates it (it must yield the same global batches on every process, as TF's
  ``DATA`` sharding assumes) and keeps its rows of each batch; a ``PyDataset`` shuffled by
  ``fit`` draws its batch order from the broadcast seed (with ``workers > 1`` or
  ``use_multiprocessing`` that draw happens in Keras's thread, so shuffling is refused there).
- **``tf.data.Dataset``**: its elements are the global batches (as in TF). Its
  ``options().experimental_distribute.auto_shard_policy`` decides, with TF's meanings:
  ``AUTO`` and ``DATA``: each process reads the whole pipeline and keeps its rows of every
  global batch (a ``shuffle`` without a seed shuffles differently on every process, as in TF:
  a warning says so); ``OFF``: no sharding, each process reads its whole pipeline and each
  global batch it reads is fed as ``P`` consecutive steps of ``B/P`` rows (TF rebatches the
  global batch over the replicas), so a pipeline each process already shards itself
  (``dataset.shard(P, p)``) keeps the global batch ``B``; ``FILE``: TF's own file sharding
  (process ``p`` reads files ``p, p+P, ...``), each batch then fed as for ``OFF`` (refused,
  naming the fix, for a pipeline that reads no files or fewer files than processes; every
  process must read as many batches). ``AUTO`` shards by data even when the pipeline reads
  files (TF would shard it by file): exact global batches, the same step count everywhere.
- **``jaxdist.Dataset``** (and ``FileListDataset``, ``with_auto_shard_policy``): jaxdist's
  ``AutoShardPolicy`` (``jaxdist._src.input.autoshard``; ``OFF``: each element is this
  process's share).

A global batch of ``B`` rows thus trains on ``B`` rows in every step, never ``P * B``.

Example:
    >>> adapter = inner_adapter(  # doctest: +SKIP
    ...     "train", x, y, None, batch_size=128, steps=None, shuffle=False, class_weight=None)
"""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from jaxdist._src.compat import keras_internals as ki

_DataAdapter = ki.data_adapter_base()


class JaxBackendAdapter(_DataAdapter):
    """A Keras data adapter that feeds the Keras JAX backend only."""

    def get_tf_dataset(self) -> Any:
        raise NotImplementedError("jaxdist.keras feeds the Keras JAX backend only")

    def get_torch_dataloader(self) -> Any:
        raise NotImplementedError("jaxdist.keras feeds the Keras JAX backend only")


class WrappingAdapter(JaxBackendAdapter):
    """An adapter over another (``self._inner``): its batch count, partial-batch flag and epoch
    hooks are the inner adapter's."""

    _inner: Any

    @property
    def num_batches(self) -> int | None:
        return self._inner.num_batches

    @property
    def has_partial_batch(self) -> bool | None:
        return self._inner.has_partial_batch

    def on_epoch_begin(self) -> None:
        self._inner.on_epoch_begin()

    def on_epoch_end(self) -> None:
        self._inner.on_epoch_end()


def is_tf_dataset(x: Any) -> bool:
    return ki.is_tf_dataset(x)


def is_dataset(x: Any) -> bool:
    """A dataset whose elements are Keras batches: ``jaxdist.Dataset``, ``tf.data.Dataset``, a
    ``FileListDataset`` or a dataset tagged with an ``AutoShardPolicy``."""
    from jaxdist._src.input.autoshard import FileListDataset, PolicyDataset
    from jaxdist._src.input.dataset import Dataset

    return isinstance(x, (Dataset, FileListDataset, PolicyDataset)) or is_tf_dataset(x)


def untagged(x: Any) -> Any:
    """The dataset under an ``AutoShardPolicy`` tag (its length is the data's)."""
    from jaxdist._src.input.autoshard import PolicyDataset

    return x.dataset if isinstance(x, PolicyDataset) else x


class DatasetAdapter(JaxBackendAdapter):
    """A ``jaxdist.Dataset`` or ``tf.data.Dataset`` as Keras input: its elements are the global
    batches (this process's rows of them once ``source`` is sharded across processes).

    Elements are ``(x, y)`` or ``(x, y, sample_weight)`` tuples (a list is read as a tuple, any
    other element as ``x`` alone), as Keras reads a ``tf.data.Dataset``. Each pass over the
    data iterates the dataset once (a shuffled dataset reshuffles, as ``tf.data`` does).

    Args:
        dataset: a batched ``jaxdist.Dataset`` or ``tf.data.Dataset`` (read for its length).
        class_weight: Keras's ``class_weight`` (sample weights from ``y``), or ``None``.
        source: what is iterated each epoch (default ``dataset``): this process's share of it
            under several processes (``jaxdist._src.input.autoshard.auto_shard``).
        pieces: steps per element of ``dataset`` (``OFF`` on a ``tf.data.Dataset`` across
            ``P`` processes feeds each global batch as ``P`` steps); scales ``num_batches``
            (``None``: the step count is not known, as for ``FILE``'s share of the files).

    Example:
        >>> import jaxdist
        >>> import numpy as np
        >>> from jaxdist._src.keras.input_adapters import DatasetAdapter
        >>> x, y = np.ones((70, 5), np.float32), np.ones((70, 1), np.float32)
        >>> adapter = DatasetAdapter(jaxdist.Dataset.from_tensor_slices((x, y)).batch(32))
        >>> adapter.num_batches
        3
    """

    def __init__(self, dataset: Any, class_weight: dict | None = None, source: Any = None,
                 pieces: int | None = 1):
        self._dataset = dataset
        self._pieces = pieces
        self._source = dataset if source is None else source
        self._class_weight = class_weight
        # (iterator, first element) of a pass abandoned after its first element: Keras reads
        # one batch to build the model before the first epoch; that pass is then resumed, so
        # the first epoch is the dataset's next pass (a shuffle's next order), not the one after.
        # Not for a tf.data dataset, which Keras reads with a new iterator each time.
        self._peeked: tuple[Iterator[Any], Any] | None = None

    def _elements(self) -> Iterator[Any]:
        if self._peeked is not None:
            iterator, first = self._peeked
            self._peeked = None
            yield first
            yield from iterator
            return
        src = self._source
        iterator = iter(src.as_numpy_iterator()) if is_tf_dataset(src) else iter(src)
        if is_tf_dataset(self._dataset):
            # As Keras reads a tf.data dataset: every read is a new iterator, the peek included
            # (a seeded shuffle's order depends on how many iterators were made before).
            yield from iterator
            return
        for i, element in enumerate(iterator):
            if i == 0:
                self._peeked = (iterator, element)
            elif i == 1:
                self._peeked = None
            yield element
        self._peeked = None

    def _batches(self) -> Iterator[tuple]:
        for element in self._elements():
            if isinstance(element, list):
                element = tuple(element)
            if not isinstance(element, tuple):
                element = (element,)
            if self._class_weight is not None:
                if len(element) != 2:
                    raise ValueError(
                        f"class_weight needs (x, y) batches, got a tuple of {len(element)}")
                x, y = element
                element = (x, y, ki.class_weight_to_sample_weights(y, self._class_weight))
            yield element

    def get_numpy_iterator(self) -> Iterator[Any]:
        return ki.numpy_batches(self._batches())

    def get_jax_iterator(self) -> Iterator[Any]:
        return ki.jax_batches(self._batches())

    @property
    def num_batches(self) -> int | None:
        cardinality = getattr(self._dataset, "cardinality", None)
        if cardinality is None or self._pieces is None:
            return None
        n = int(cardinality())  # a tf.data dataset returns a scalar tensor
        return n * self._pieces if n >= 0 else None  # INFINITE / UNKNOWN_CARDINALITY

    @property
    def batch_size(self) -> int | None:
        return None

    @property
    def has_partial_batch(self) -> bool | None:
        return None

    @property
    def partial_batch_size(self) -> int | None:
        return None


def broadcast_seed() -> int:
    """A seed drawn by process 0 (from numpy's global generator, which
    ``keras.utils.set_random_seed`` seeds) and known to every process."""
    from jax.experimental import multihost_utils

    seed = np.int64(np.random.randint(0, 2**31 - 1)) if jax.process_index() == 0 else np.int64(0)
    return int(multihost_utils.broadcast_one_to_all(seed))


class ProcessRowsAdapter(WrappingAdapter):
    """Keras's adapter for arrays, generators or a ``PyDataset`` under several processes: every
    process reads the same global batches and keeps its own rows of each
    (``AutoShardPolicy.DATA``, as TF shards in-memory data). Keras's shuffle draws its
    permutations (arrays: numpy's global generator; ``PyDataset``: Python's ``random``) from
    generators seeded alike on every process, so all processes cut the same global batches.

    Args:
        inner: Keras's adapter over the whole input.
        count: the number of processes.
        index: this process's index.
        seed: the shuffle seed, the same on every process (``None`` when not shuffling).

    Example:
        >>> ProcessRowsAdapter(  # doctest: +SKIP
        ...     inner, jax.process_count(), jax.process_index(), seed=7)
    """

    def __init__(self, inner: Any, count: int, index: int, seed: int | None):
        self._inner, self._count, self._index = inner, count, index
        self._rng_state = None if seed is None else (np.random.RandomState(seed).get_state(),
                                                     random.Random(seed).getstate())

    def _share(self, rows: int | None) -> int | None:
        return None if rows is None else math.ceil(rows / self._count)

    def _rows(self, iterator: Iterator[Any]) -> Iterator[Any]:
        from jaxdist._src.input.autoshard import process_rows

        while True:
            saved = None
            if self._rng_state is not None:  # Keras shuffles with the global generators
                saved = np.random.get_state(), random.getstate()
                np.random.set_state(self._rng_state[0])
                random.setstate(self._rng_state[1])
            try:
                batch = next(iterator)
            except StopIteration:
                return
            finally:
                if saved is not None:
                    self._rng_state = np.random.get_state(), random.getstate()
                    np.random.set_state(saved[0])
                    random.setstate(saved[1])
            yield process_rows(batch, self._index, self._count)

    def get_numpy_iterator(self) -> Iterator[Any]:
        return self._rows(self._inner.get_numpy_iterator())

    def get_jax_iterator(self) -> Iterator[Any]:
        return self._rows(self._inner.get_numpy_iterator())

    @property
    def batch_size(self) -> int | None:
        return self._share(self._inner.batch_size)

    @property
    def partial_batch_size(self) -> int | None:
        return self._share(self._inner.partial_batch_size)


class _Pieces:
    """``OFF`` (and ``FILE``, on this process's files) on a ``tf.data.Dataset`` across
    ``count`` processes: each global batch it yields is fed as ``count`` consecutive steps of
    its consecutive parts (TF rebatches a global batch over the replicas and shards nothing);
    an empty part (a batch of fewer rows than processes) is skipped."""

    def __init__(self, dataset: Any, count: int):
        self.dataset, self.count = dataset, count

    def __iter__(self) -> Iterator[Any]:
        from jaxdist._src.input.autoshard import process_rows

        for element in self.dataset.as_numpy_iterator():
            for j in range(self.count):
                piece = process_rows(element, j, self.count)
                leaves = jax.tree.leaves(piece)
                if leaves and np.shape(leaves[0])[0] == 0:
                    continue
                yield piece


def _tf_data_nodes(dataset: Any) -> dict[str, Any]:
    """The nodes of a ``tf.data.Dataset``'s graph (its functions' included), by name; empty
    when TF cannot serialise the pipeline."""
    import tensorflow as tf

    try:
        variant = tf.data.experimental.to_variant(dataset)
        serialized = tf.raw_ops.DatasetToGraphV2(input_dataset=variant, external_state_policy=1)
        graph = tf.compat.v1.GraphDef()
        graph.ParseFromString(serialized.numpy())
    except Exception:  # noqa: BLE001 - a pipeline TF cannot serialise: not known
        return {}
    nodes = {n.name: n for n in graph.node}
    for fn in graph.library.function:
        nodes.update({n.name: n for n in fn.node_def})
    return nodes


_READERS = ("TFRecordDataset", "TFRecordDatasetV2", "TextLineDataset",
            "FixedLengthRecordDataset", "FixedLengthRecordDatasetV2")
_DT_STRING = 7


def tf_data_files(dataset: Any) -> tuple[bool, int | None]:
    """``(whether the pipeline reads files, how many when the list is a constant)``: what TF's
    ``AutoShardPolicy.FILE`` shards.

    Example:
        >>> import tensorflow as tf  # doctest: +NEEDS_TF
        >>> from jaxdist._src.keras.input_adapters import tf_data_files
        >>> tf_data_files(tf.data.TFRecordDataset(["a", "b"]))
        (True, 2)
    """
    nodes = _tf_data_nodes(dataset)
    if not any(n.op in _READERS for n in nodes.values()):
        return False, None
    counts = []
    for node in nodes.values():
        if node.op != "TensorSliceDataset":
            continue
        for name in node.input:
            src = nodes.get(name.split(":")[0].lstrip("^"))
            tensor = src.attr["value"].tensor if src is not None and src.op == "Const" else None
            if tensor is not None and tensor.dtype == _DT_STRING:
                counts.append(int(np.prod([d.size for d in tensor.tensor_shape.dim])))
    return True, (counts[0] if len(counts) == 1 else None)


def _tf_data_file_shard(dataset: Any, count: int, index: int) -> Any:
    """TF's own ``FILE`` rewrite (``AutoShardDataset``): this process's files, ``index``,
    ``index + count``, ..."""
    import tensorflow as tf

    file_based, files = tf_data_files(dataset)
    if not file_based:
        raise ValueError(
            "AutoShardPolicy.FILE on a tf.data.Dataset that reads no files (TFRecordDataset, "
            "TextLineDataset, FixedLengthRecordDataset): use AutoShardPolicy.DATA (or AUTO)")
    if files is not None and files < count:
        raise ValueError(
            f"AutoShardPolicy.FILE: {files} file(s) cannot be split across {count} processes; "
            f"provide at least {count} files or use AutoShardPolicy.DATA")
    flat = tf.nest.flatten(dataset.element_spec)
    sharded = tf.raw_ops.AutoShardDataset(
        input_dataset=tf.data.experimental.to_variant(dataset), num_workers=count, index=index,
        auto_shard_policy=1, output_types=[s.dtype for s in flat],
        output_shapes=[s.shape for s in flat])
    return tf.data.experimental.from_variant(sharded, dataset.element_spec)


def tf_data_has_unseeded_shuffle(dataset: Any) -> bool:
    """Whether a ``tf.data.Dataset``'s pipeline shuffles without a seed (``seed`` and ``seed2``
    both 0: each process, and each run, draws its own order). Read from the dataset's graph
    with TF's public API; ``False`` when the graph cannot be read.

    Example:
        >>> import tensorflow as tf  # doctest: +NEEDS_TF
        >>> from jaxdist._src.keras.input_adapters import tf_data_has_unseeded_shuffle
        >>> tf.random.set_seed(None)  # no global seed either (keras.utils.set_random_seed sets one)
        >>> tf_data_has_unseeded_shuffle(tf.data.Dataset.range(8).shuffle(8))
        True
        >>> tf_data_has_unseeded_shuffle(tf.data.Dataset.range(8).shuffle(8, seed=1))
        False
    """
    nodes = _tf_data_nodes(dataset)

    def const(name: str) -> int | None:
        node = nodes.get(name.split(":")[0].lstrip("^"))
        if node is None or node.op != "Const":
            return None
        values = list(node.attr["value"].tensor.int64_val)
        return int(values[0]) if values else None

    for node in nodes.values():
        if node.op in ("ShuffleDataset", "ShuffleDatasetV3", "ShuffleAndRepeatDataset",
                       "ShuffleAndRepeatDatasetV2"):
            if const(node.input[2]) == 0 and const(node.input[3]) == 0:  # seed, seed2
                return True
    return False


def _warn_unseeded_shuffle(dataset: Any, count: int) -> None:
    if tf_data_has_unseeded_shuffle(dataset):
        warnings.warn(
            f"a tf.data.Dataset with a shuffle without a seed is sharded by data across "
            f"{count} processes: each process shuffles differently, so the rows the processes "
            f"train on in one step are not one global batch of the dataset (rows repeat and "
            f"others are skipped within an epoch, as under TF). For exact global batches "
            f"shuffle with a seed (shuffle(buffer_size, seed=...)) or call "
            f"keras.utils.set_random_seed(...) before building the dataset",
            RuntimeWarning, stacklevel=4)


def tf_data_source(dataset: Any, count: int, index: int) -> tuple[Any, int | None]:
    """``(what this process iterates, steps per element of the dataset)`` for a
    ``tf.data.Dataset`` across ``count`` processes, by its ``AutoShardPolicy`` (see the module
    docstring); ``None`` steps: not known (``FILE``: this process's share of the files).

    Raises:
        ValueError: ``FILE`` on a pipeline that reads no files or fewer files than processes,
            or ``HINT`` (naming what to use instead).

    Example:
        >>> source, pieces = tf_data_source(ds, 2, 0)  # doctest: +SKIP
    """
    from jaxdist._src.input.autoshard import auto_shard, policy_of
    from jaxdist._src.input.options import AutoShardPolicy

    policy = policy_of(dataset)
    if policy in (AutoShardPolicy.AUTO, AutoShardPolicy.DATA):
        _warn_unseeded_shuffle(dataset, count)
        return auto_shard(dataset, count, index, policy=AutoShardPolicy.DATA, uneven=True), 1
    if policy is AutoShardPolicy.OFF:
        return _Pieces(dataset, count), count
    if policy is AutoShardPolicy.FILE:
        return _Pieces(_tf_data_file_shard(dataset, count, index), count), None
    raise ValueError(
        f"AutoShardPolicy.{policy.name} on a tf.data.Dataset given to Keras across {count} "
        f"processes is not supported by jaxdist.keras: use AUTO / DATA (every process reads the "
        f"whole pipeline and keeps its rows of each global batch), FILE, or OFF")


def _refuse_threaded_shuffle(x: Any, shuffle: bool, count: int) -> None:
    import keras

    if (shuffle and isinstance(x, keras.utils.PyDataset)
            and (x.workers > 1 or x.use_multiprocessing)):
        raise ValueError(
            f"fit(shuffle=True) on a keras.utils.PyDataset with workers={x.workers}, "
            f"use_multiprocessing={x.use_multiprocessing} in a job of {count} processes: Keras "
            f"draws the batch order in its own thread, so the processes would read different "
            f"global batches. Pass shuffle=False (shuffling inside the PyDataset with a seed "
            f"the same on every process) or workers=1")


def inner_adapter(kind: str, x: Any, y: Any = None, sample_weight: Any = None,
                  batch_size: int | None = None, steps: int | None = None,
                  shuffle: bool = False, class_weight: dict | None = None) -> Any:
    """The adapter that reads ``fit`` / ``evaluate`` / ``predict``'s input (``kind``:
    ``"train"``, ``"test"``, ``"predict"``): this process's share of every global batch when
    there are several processes (see the module docstring).

    Raises:
        ValueError: ``y`` or ``sample_weight`` with a dataset, or an input that cannot be
            sharded as asked (the message names the fix).

    Example:
        >>> import numpy as np
        >>> from jaxdist._src.keras.input_adapters import inner_adapter
        >>> adapter = inner_adapter("test", np.ones((8, 2)), np.ones((8, 1)), batch_size=4)
        >>> adapter.num_batches
        2
    """
    from jaxdist._src.input.autoshard import auto_shard

    count, index = jax.process_count(), jax.process_index()
    if is_dataset(x):
        for name, value in (("y", y), ("sample_weight", sample_weight)):
            if value is not None:
                kind_name = "tf.data.Dataset" if is_tf_dataset(x) else (
                    f"jaxdist.{type(x).__name__}")
                raise ValueError(
                    f"When providing `x` as a {kind_name}, `{name}` should not be passed: its "
                    f"elements are (x, y) or (x, y, sample_weight) batches")
        if count == 1:
            return DatasetAdapter(untagged(x), class_weight)
        if is_tf_dataset(x):
            source, pieces = tf_data_source(x, count, index)
            return DatasetAdapter(x, class_weight, source, pieces)
        # this process's share, by the dataset's AutoShardPolicy
        return DatasetAdapter(untagged(x), class_weight, auto_shard(x, count, index, uneven=True))
    if count > 1:
        _refuse_threaded_shuffle(x, shuffle, count)
    inner = ki.get_data_adapter(
        x, y, sample_weight=sample_weight, batch_size=batch_size, steps_per_epoch=steps,
        shuffle=shuffle, class_weight=class_weight)
    if count == 1:
        return inner
    seed = broadcast_seed() if shuffle and kind == "train" else None
    return ProcessRowsAdapter(inner, count, index, seed)
