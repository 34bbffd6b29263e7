"""Sparse embedding tables sharded by rows across ps tasks.

``lookup(ids)`` pulls only the rows the ids touch (each distinct row once); the gradient push
sends only those rows, duplicates summed; the ps applies a row-wise optimizer (sgd, adagrad,
adam: the state of untouched rows is left alone, "lazy" updates).

Example:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import numpy as np
    >>> import jaxdist.ps
    >>> strategy = jaxdist.ParameterServerStrategy()   # no TF_CONFIG: trains locally
    >>> table = strategy.extended.create_embedding(
    ...     "items", vocab_size=10_000, dim=32, optimizer=jaxdist.ps.optimizers.adagrad(0.1))
    >>> ids = np.array([[3, 17], [3, 9_999]])
    >>> look = table.lookup(ids)                  # ids: int array of any shape
    >>> def loss_fn(rows):
    ...     emb = rows[look.inverse]              # ids.shape + (32,)
    ...     return jnp.mean(emb ** 2)
    >>> table.apply_gradients(look, jax.grad(loss_fn)(look.rows))
    {'items': {'version': 1, 'staleness': 0}}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxdist._src.ps.errors import PSInvalidArgumentError
from jaxdist._src.ps.variables import ShardInfo


@dataclass
class EmbeddingLookup:
    """The result of ``EmbeddingTable.lookup``.

    Attributes:
        ids: the ids looked up (original shape).
        unique_ids: the distinct ids, sorted.
        inverse: for every id, its row in ``rows`` (shape of ``ids``).
        rows: ``(len(unique_ids), dim)`` embedding rows.
        versions: versions of the shards the rows came from.
    """

    ids: np.ndarray
    unique_ids: np.ndarray
    inverse: np.ndarray
    rows: np.ndarray
    versions: dict[str, int]

    def embeddings(self) -> np.ndarray:
        """``rows[inverse]``: one embedding per id (``ids.shape + (dim,)``)."""
        return self.rows[self.inverse]


class EmbeddingTable:
    """A ``(vocab_size, dim)`` table whose rows are split over ps tasks (TF's div strategy).

    Create it with ``ParameterServerStrategy.create_embedding``.
    """

    def __init__(self, client: Any, name: str, vocab_size: int, dim: int, dtype: Any,
                 shards: list[ShardInfo], worker_index: int = 0):
        self._client = client
        self.name = name
        self.vocab_size = int(vocab_size)
        self.dim = int(dim)
        self.dtype = np.dtype(dtype)
        self.shards = list(shards)
        self._starts = np.array([s.start for s in shards], np.int64)
        self._worker_index = worker_index
        self.last_push: dict[str, dict[str, int]] = {}

    def _check(self, ids: Any) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise PSInvalidArgumentError(
                f"embedding {self.name!r}: ids must be integers, got dtype {ids.dtype}"
            )
        flat = ids.reshape(-1).astype(np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= self.vocab_size):
            bad = flat[(flat < 0) | (flat >= self.vocab_size)][0]
            raise PSInvalidArgumentError(
                f"embedding {self.name!r}: id {int(bad)} is out of range [0, {self.vocab_size})"
            )
        return ids

    def _by_shard(self, uniq: np.ndarray) -> list[tuple[ShardInfo, np.ndarray]]:
        which = np.searchsorted(self._starts, uniq, side="right") - 1
        return [(s, np.nonzero(which == i)[0]) for i, s in enumerate(self.shards)]

    def lookup(self, ids: Any) -> EmbeddingLookup:
        """Pulls the rows of ``ids`` (each distinct row once, every ps in parallel)."""
        ids = self._check(ids)
        uniq, inverse = np.unique(ids.reshape(-1).astype(np.int64), return_inverse=True)
        groups = [(s, pos) for s, pos in self._by_shard(uniq) if pos.size]
        by_task: dict[int, list[tuple[ShardInfo, np.ndarray]]] = {}
        for s, pos in groups:
            by_task.setdefault(s.task, []).append((s, pos))
        calls = []
        for task, items in sorted(by_task.items()):
            keys = [s.key for s, _ in items]
            arrays = {f"ids/{s.key}": uniq[pos] - s.start for s, pos in items}
            calls.append((task, "PullRows", {"keys": keys}, arrays))
        rows = np.zeros((uniq.size, self.dim), self.dtype)
        versions: dict[str, int] = {}
        results = self._client.call_many(calls)
        for (_task, items), (meta, arrays) in zip(sorted(by_task.items()), results):
            versions.update(meta["versions"])
            for s, pos in items:
                rows[pos] = arrays[f"rows/{s.key}"]
        return EmbeddingLookup(ids, uniq, inverse.reshape(ids.shape), rows, versions)

    def apply_gradients(self, lookup: EmbeddingLookup, row_grads: Any) -> dict:
        """Pushes gradients of ``lookup.rows`` (``(len(unique_ids), dim)``): only those rows."""
        row_grads = np.asarray(row_grads)
        if row_grads.shape != lookup.rows.shape:
            raise PSInvalidArgumentError(
                f"embedding {self.name!r}: row gradients have shape {row_grads.shape}, "
                f"expected {lookup.rows.shape} (one row per unique id of the lookup)"
            )
        return self._push(lookup.unique_ids, row_grads, lookup.versions)

    def push(self, ids: Any, grads: Any, versions: dict[str, int] | None = None) -> dict:
        """Pushes one gradient row per id (``ids.shape + (dim,)``); duplicate ids are summed."""
        ids = self._check(ids).reshape(-1).astype(np.int64)
        grads = np.asarray(grads).reshape(ids.size, self.dim)
        uniq, inv = np.unique(ids, return_inverse=True)
        summed = np.zeros((uniq.size, self.dim), grads.dtype)
        np.add.at(summed, inv, grads)
        return self._push(uniq, summed, versions or {})

    def _push(self, uniq: np.ndarray, grads: np.ndarray, versions: dict[str, int]) -> dict:
        by_task: dict[int, tuple[dict, dict]] = {}
        for s, pos in self._by_shard(uniq):
            if not pos.size:
                continue
            meta, arrays = by_task.setdefault(s.task, ({"versions": {}}, {}))
            meta["versions"][s.key] = versions.get(s.key, 0)
            arrays[f"ids/{s.key}"] = uniq[pos] - s.start
            arrays[f"grads/{s.key}"] = grads[pos]
        calls = [(t, "PushRows", dict(m, worker=self._worker_index), a)
                 for t, (m, a) in sorted(by_task.items())]
        out: dict[str, dict[str, int]] = {}
        for meta, _ in self._client.call_many(calls):
            out.update(meta["results"])
        self.last_push = out
        return out

    def read_value(self) -> np.ndarray:
        """The whole table (pulls every shard; for tests and export)."""
        calls = [(s.task, "Pull", {"keys": [s.key]}, {}) for s in self.shards]
        results = self._client.call_many(calls)
        parts = [arrays[s.key] for s, (_, arrays) in zip(self.shards, results)]
        return np.concatenate(parts, axis=0)

    def __repr__(self) -> str:
        return (f"EmbeddingTable({self.name!r}, vocab_size={self.vocab_size}, dim={self.dim}, "
                f"shards={len(self.shards)})")


__all__ = ["EmbeddingLookup", "EmbeddingTable"]
