"""Distributed values: ``PerReplica`` holds one value per replica.

A ``PerReplica`` wraps one global ``jax.Array`` whose leading axis has one entry per replica in
sync (``shape == (num_replicas, *per_replica_shape)``), sharded so that replica ``i``'s entry lives
on replica ``i``'s device. Mirrored (replicated) state is not wrapped: it is a plain ``jax.Array``
with a replicated sharding, one buffer per device and never ``N`` stacked copies.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


@jax.tree_util.register_pytree_node_class
class PerReplica:
    """One value per replica, as returned by ``Strategy.run`` or a distributed dataset.

    Args:
        stacked: an array of shape ``(num_replicas, ...)``; entry ``i`` is replica ``i``'s value.

    Example:
        >>> v = strategy.experimental_distribute_values_from_function(
        ...     lambda ctx: jnp.full((2,), ctx.replica_id_in_sync_group))
        >>> strategy.experimental_local_results(v)[1]
        Array([1, 1], dtype=int32)
    """

    __slots__ = ("stacked",)

    def __init__(self, stacked: Any):
        self.stacked = stacked

    @property
    def num_replicas(self) -> int:
        return int(self.stacked.shape[0])

    @property
    def shape(self) -> tuple[int, ...]:
        """The per-replica shape (without the replica axis)."""
        return tuple(self.stacked.shape[1:])

    @property
    def dtype(self):
        return self.stacked.dtype

    @property
    def values(self) -> tuple[Any, ...]:
        """The per-replica values, in replica order (like TF's ``PerReplica.values``)."""
        return local_components(self.stacked)

    def tree_flatten(self):
        return (self.stacked,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux
        return cls(children[0])

    def __repr__(self) -> str:
        return (
            f"PerReplica(num_replicas={self.num_replicas}, shape={self.shape}, dtype={self.dtype})"
        )


def is_per_replica(x: Any) -> bool:
    return isinstance(x, PerReplica)


def local_components(stacked: Any) -> tuple[Any, ...]:
    """Splits a stacked ``(N, ...)`` array into its ``N`` entries, each left on its own device."""
    if isinstance(stacked, jax.Array) and not isinstance(stacked, jax.core.Tracer):
        shards = sorted(
            stacked.addressable_shards, key=lambda s: s.index[0].start if s.index else 0
        )
        out = []
        for s in shards:
            start = s.index[0].start or 0 if s.index else 0
            data = s.data
            n = data.shape[0]
            for j in range(n):
                out.append((start + j, data[j]))
        seen: dict[int, Any] = {}
        for idx, v in out:
            seen.setdefault(idx, v)
        return tuple(seen[i] for i in sorted(seen))
    arr = np.asarray(stacked) if not hasattr(stacked, "shape") else stacked
    return tuple(arr[i] for i in range(arr.shape[0]))


def regroup(values: list[Any]) -> Any:
    """Turns a list of per-replica pytrees into one pytree of ``PerReplica`` (stacked on host)."""
    return jax.tree.map(lambda *xs: PerReplica(np.stack([np.asarray(x) for x in xs])), *values)
