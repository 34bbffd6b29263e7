"""``AutoShardPolicy`` for multi-process input: which process reads which files or rows.

With several processes (``MultiWorkerMirroredStrategy``) every process runs its own input
pipeline and feeds its own replicas. The policy decides how one dataset is divided, with
``tf.data``'s meanings:

* ``FILE``: a dataset made of files (``FileListDataset``) is split by file: process ``p`` of
  ``P`` reads files ``p, p+P, ...``; each batch it reads is its share of a global batch (the
  global batch is ``P`` times larger). An error when there are fewer files than processes or
  the dataset is not file based.
* ``DATA``: every process reads the whole dataset; of each global batch of ``B`` rows process
  ``p`` keeps rows ``p*B/P`` to ``(p+1)*B/P - 1``, so the replicas (ordered process by process)
  see exactly the rows one process with all the devices would.
* ``AUTO`` (default): ``FILE`` when the dataset is file based with at least ``P`` files, else
  ``DATA``.
* ``OFF``: no sharding: every element is taken as this process's share as is (use it when each
  process already reads its own data).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jaxdist._src.input.dataset import has_unseeded_shuffle, is_foreign_dataset
from jaxdist._src.input.options import AutoShardPolicy, as_policy


class FileListDataset:
    """A dataset read from a list of files, shardable by file.

    Args:
        files: the file paths (in a fixed order: every process must list the same files).
        read_fn: ``read_fn(path)`` -> an iterable of batches (pytrees of arrays with a leading
            batch axis).

    Example:
        >>> import jaxdist
        >>> import numpy as np
        >>> from jaxdist.data import FileListDataset
        >>> import glob
        >>> for i in range(4):
        ...     np.savez(f"part-{i}.npz", x=np.full((2, 3), i, np.float32))
        >>> ds = FileListDataset(sorted(glob.glob("part-*.npz")),
        ...                      lambda f: [dict(np.load(f))])
        >>> strategy = jaxdist.MultiWorkerMirroredStrategy()   # TF_CONFIG unset: one worker
        >>> dist = strategy.experimental_distribute_dataset(ds)   # AUTO -> FILE
    """

    def __init__(self, files: Sequence[str], read_fn: Callable[[str], Iterable[Any]]):
        self.files = [str(f) for f in files]
        self.read_fn = read_fn

    def shard(self, num_shards: int, index: int) -> FileListDataset:
        """The files ``index, index + num_shards, ...``."""
        return FileListDataset(self.files[index::num_shards], self.read_fn)

    def __iter__(self) -> Iterator[Any]:
        for f in self.files:
            yield from self.read_fn(f)

    def __repr__(self) -> str:
        return f"FileListDataset({len(self.files)} files)"


class PolicyDataset:
    def __init__(self, dataset: Any, policy: AutoShardPolicy):
        self.dataset = dataset
        self.auto_shard_policy = policy

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dataset)


def with_auto_shard_policy(dataset: Any, policy: AutoShardPolicy | str) -> Any:
    """Tags ``dataset`` with a policy (TF: ``options.experimental_distribute.auto_shard_policy``).

    Example:
        >>> import jaxdist
        >>> from jaxdist import AutoShardPolicy
        >>> from jaxdist.data import with_auto_shard_policy
        >>> ds = with_auto_shard_policy(jaxdist.Dataset.range(8).batch(2), AutoShardPolicy.DATA)
        >>> ds.auto_shard_policy
        <AutoShardPolicy.DATA: 'DATA'>
    """
    return PolicyDataset(dataset, as_policy(policy))


def policy_of(dataset: Any, default: AutoShardPolicy = AutoShardPolicy.AUTO) -> AutoShardPolicy:
    """The policy a dataset carries (jaxdist tag, or a tf.data dataset's options)."""
    if hasattr(dataset, "auto_shard_policy"):
        return as_policy(dataset.auto_shard_policy)
    options = getattr(dataset, "options", None)
    if callable(options) and hasattr(dataset, "as_numpy_iterator"):
        try:  # tf.data.Dataset
            return as_policy(options().experimental_distribute.auto_shard_policy)
        except Exception:  # noqa: BLE001 - not a tf.data dataset after all
            pass
    return default


def _unwrap(dataset: Any) -> Any:
    return dataset.dataset if isinstance(dataset, PolicyDataset) else dataset


def _rows(element: Any, index: int, count: int, uneven: bool = False) -> Any:
    """Process ``index``'s rows of a global batch: the ``index``-th of ``count`` consecutive
    equal parts; with ``uneven``, a batch that does not divide gives the first ``b % count``
    processes one row more (a batch of fewer rows than processes leaves the last ones empty)."""
    leaves = jax.tree.leaves(element)
    b = int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) else None
    if b is None:
        raise ValueError("AutoShardPolicy.DATA needs batched elements (rank >= 1 arrays)")
    if b % count and not uneven:
        raise ValueError(
            f"AutoShardPolicy.DATA: the global batch of {b} rows does not split across {count} "
            f"processes; use a global batch size that is a multiple of {count}"
        )
    per, extra = divmod(b, count)
    start = index * per + min(index, extra)
    stop = start + per + (index < extra)
    return jax.tree.map(lambda x: np.asarray(x)[start:stop], element)


def process_rows(batch: Any, index: int, count: int) -> Any:
    """Process ``index``'s rows of a global ``batch`` under ``AutoShardPolicy.DATA``: the
    ``index``-th of ``count`` consecutive parts, the first ``rows % count`` one row longer.

    Example:
        >>> import numpy as np
        >>> from jaxdist._src.input.autoshard import process_rows
        >>> process_rows(np.arange(6), 1, 4).tolist()
        [2, 3]
    """
    return _rows(batch, index, count, uneven=True)


class _RowShard:
    def __init__(self, dataset: Any, count: int, index: int, uneven: bool = False):
        self.dataset, self.count, self.index, self.uneven = dataset, count, index, uneven

    def __iter__(self) -> Iterator[Any]:
        source = self.dataset
        if is_foreign_dataset(source):
            source = source.as_numpy_iterator()
        for element in source:
            yield _rows(element, self.index, self.count, self.uneven)


def auto_shard(dataset: Any, num_workers: int, worker_index: int,
               policy: AutoShardPolicy | str | None = None, uneven: bool = False) -> Any:
    """This process's part of ``dataset``; each element it yields is this process's rows.

    Args:
        dataset: an iterable of global batches, a ``FileListDataset``, or a tf.data dataset.
        num_workers: how many processes feed the replicas.
        worker_index: this process's index.
        policy: the ``AutoShardPolicy`` (default: the dataset's own, else ``AUTO``).
        uneven: ``DATA`` splits a batch that does not divide across the processes (the first
            ones get a row more) instead of raising (Keras pads each process's rows).

    Raises:
        ValueError: ``FILE`` on a dataset that is not file based or has fewer files than
            processes, ``DATA`` on a ``jaxdist.Dataset`` with an unseeded ``shuffle`` (each
            process would shuffle differently, so the global batches would repeat and miss
            rows), or an unsupported policy.

    Example:
        >>> import jaxdist
        >>> from jaxdist._src.input.autoshard import auto_shard
        >>> mine = auto_shard(jaxdist.Dataset.range(16).batch(8), num_workers=2, worker_index=1)
        >>> [b.tolist() for b in mine]
        [[4, 5, 6, 7], [12, 13, 14, 15]]
    """
    policy = as_policy(policy) if policy is not None else policy_of(dataset)
    data = _unwrap(dataset)
    files = getattr(data, "files", None) if isinstance(data, FileListDataset) else None
    if policy is AutoShardPolicy.AUTO:
        policy = (AutoShardPolicy.FILE if files is not None and len(files) >= num_workers
                  else AutoShardPolicy.DATA)
    if policy is AutoShardPolicy.OFF or num_workers == 1:
        return data
    if policy is AutoShardPolicy.FILE:
        if files is None:
            raise ValueError(
                f"AutoShardPolicy.FILE needs a file-based dataset (jaxdist._src.input."
                f"FileListDataset), got {type(data).__name__}; use AutoShardPolicy.DATA to "
                f"split rows instead"
            )
        if len(files) < num_workers:
            raise ValueError(
                f"AutoShardPolicy.FILE: {len(files)} file(s) {files[:4]} cannot be split "
                f"across {num_workers} processes; provide at least {num_workers} files or use "
                f"AutoShardPolicy.DATA"
            )
        return data.shard(num_workers, worker_index)
    if policy is AutoShardPolicy.DATA:
        if has_unseeded_shuffle(data):
            raise ValueError(
                f"AutoShardPolicy.DATA across {num_workers} processes: the dataset has a "
                f"shuffle without a seed, which shuffles differently in every process, so the "
                f"processes' rows would not form the global batches (rows repeated, others "
                f"missed). Pass shuffle(..., seed=<the same int on every process>)")
        return _RowShard(data, num_workers, worker_index, uneven)
    raise ValueError(
        f"AutoShardPolicy.{policy.name} is not supported; use OFF, AUTO, FILE or DATA"
    )


def shard_files(files: Sequence[str], input_context: Any) -> list[str]:
    """The files one input pipeline reads (for ``distribute_datasets_from_function``).

    Example:
        >>> import jaxdist
        >>> import numpy as np
        >>> from jaxdist._src.input.autoshard import shard_files
        >>> from jaxdist.data import FileListDataset
        >>> all_files, read = [f"part-{i}.npz" for i in range(4)], lambda f: [dict(np.load(f))]
        >>> def dataset_fn(ctx):
        ...     return FileListDataset(shard_files(all_files, ctx), read)
        >>> shard_files(all_files, jaxdist.InputContext(2, 1, 4))  # pipeline 1 of 2
        ['part-1.npz', 'part-3.npz']
    """
    n, i = input_context.num_input_pipelines, input_context.input_pipeline_id
    if len(files) < n:
        raise ValueError(
            f"{len(files)} file(s) cannot be split across {n} input pipelines"
        )
    return list(files)[i::n]


__all__ = [
    "FileListDataset",
    "as_policy",
    "auto_shard",
    "policy_of",
    "process_rows",
    "shard_files",
    "with_auto_shard_policy",
]
