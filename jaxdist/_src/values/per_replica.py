"""Distributed values: ``PerReplica`` holds one value per replica.

A ``PerReplica`` wraps one global ``jax.Array`` whose leading axis has one entry per replica in
sync (``shape == (num_replicas, *per_replica_shape)``), sharded so that replica ``i``'s entry lives
on replica ``i``'s device. Mirrored (replicated) state is not wrapped: it is a plain ``jax.Array``
with a replicated sharding, one buffer per device and never ``N`` stacked copies.

Per-replica values of different lengths (TF's last partial batch, e.g. ``[[8], []]``: one row on
replica 0, an empty batch on replica 1) are stored padded with zeros to the longest one along
their leading axis, with ``lengths`` recording each replica's real row count. ``values`` and
``experimental_local_results`` give the real (unpadded) arrays, as TF does.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import numpy as np


@jax.tree_util.register_pytree_node_class
class PerReplica:
    """One value per replica, as returned by ``Strategy.run`` or a distributed dataset.

    Args:
        stacked: an array of shape ``(num_replicas, ...)``; entry ``i`` is replica ``i``'s value.
        lengths: ``None`` when every replica's value has the full shape; otherwise, one row
            count per replica: replica ``i``'s value is ``stacked[i][:lengths[i]]`` (the rest is
            zero padding).

    Example:
        >>> import jax, jaxdist
        >>> import jax.numpy as jnp
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])  # doctest: +NEEDS_2_DEVICES
        >>> v = strategy.experimental_distribute_values_from_function(
        ...     lambda ctx: jnp.full((2,), ctx.replica_id_in_sync_group))
        >>> strategy.experimental_local_results(v)[1]
        Array([1, 1], dtype=int32)
    """

    __slots__ = ("stacked", "lengths")

    def __init__(self, stacked: Any, lengths: tuple[int, ...] | None = None):
        self.stacked = stacked
        self.lengths = None if lengths is None else tuple(int(n) for n in lengths)
        if (
            self.lengths is not None
            and hasattr(stacked, "shape")
            and len(self.lengths) != stacked.shape[0]
        ):
            raise ValueError(
                f"PerReplica lengths {self.lengths} must have one entry per replica "
                f"({stacked.shape[0]})"
            )

    @property
    def num_replicas(self) -> int:
        return int(self.stacked.shape[0])

    @property
    def shape(self) -> tuple[int, ...]:
        """The per-replica shape (without the replica axis; padded when ``lengths`` is set)."""
        return tuple(self.stacked.shape[1:])

    @property
    def dtype(self):
        return self.stacked.dtype

    @property
    def values(self) -> tuple[Any, ...]:
        """The per-replica values, in replica order (like TF's ``PerReplica.values``)."""
        return local_components(self.stacked, self.lengths)

    @property
    def spec(self) -> PerReplicaSpec:
        """The type of this value: one ``jax.ShapeDtypeStruct`` per replica (TF's type spec)."""
        dtype = self.stacked.dtype
        if self.lengths is None:
            return PerReplicaSpec(
                *(jax.ShapeDtypeStruct(self.shape, dtype) for _ in range(self.num_replicas))
            )
        rest = self.shape[1:]
        return PerReplicaSpec(*(jax.ShapeDtypeStruct((n, *rest), dtype) for n in self.lengths))

    @property
    def is_partial(self) -> bool:
        """Whether some replica's value is shorter than ``shape`` (a partial batch)."""
        return self.lengths is not None

    def tree_flatten(self):
        return (self.stacked,), self.lengths

    @classmethod
    def tree_unflatten(cls, aux, children):
        if aux is not None:  # lengths: checked against the (maybe mapped) stacked array
            return cls(children[0], aux)
        out = object.__new__(cls)  # nothing to check (every step's outputs pass here)
        out.stacked = children[0]
        out.lengths = aux
        return out

    def __repr__(self) -> str:
        extra = "" if self.lengths is None else f", lengths={self.lengths}"
        return (
            f"PerReplica(num_replicas={self.num_replicas}, shape={self.shape}, "
            f"dtype={self.dtype}{extra})"
        )


class PerReplicaSpec:
    """The type of a ``PerReplica`` value: one ``jax.ShapeDtypeStruct`` per replica.

    ``DistributedDataset.element_spec`` has one of these per array of an element (with one
    replica, the plain ``jax.ShapeDtypeStruct``), as TF's ``PerReplicaSpec`` of ``TensorSpec``s.

    Example:
        >>> import jax, jaxdist
        >>> import numpy as np
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])  # doctest: +NEEDS_2_DEVICES
        >>> x, y = np.ones((32, 784), np.float32), np.zeros((32,), np.int32)
        >>> dist_dataset = strategy.experimental_distribute_dataset(
        ...     jaxdist.Dataset.from_tensor_slices((x, y)).batch(16))
        >>> spec = dist_dataset.element_spec      # (PerReplicaSpec, PerReplicaSpec) for (x, y)
        >>> spec[0].value_specs[0].shape           # replica 0's batch of x
        (8, 784)
    """

    def __init__(self, *value_specs: jax.ShapeDtypeStruct):
        self.value_specs = tuple(value_specs)

    @property
    def num_replicas(self) -> int:
        return len(self.value_specs)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, PerReplicaSpec) and self.value_specs == other.value_specs

    def __hash__(self) -> int:
        return hash(self.value_specs)

    def __repr__(self) -> str:
        return f"PerReplicaSpec({', '.join(repr(v) for v in self.value_specs)})"


def is_per_replica(x: Any) -> bool:
    return isinstance(x, PerReplica)


def local_components(stacked: Any, lengths: tuple[int, ...] | None = None) -> tuple[Any, ...]:
    """Splits a stacked ``(N, ...)`` array into its ``N`` entries, each left on its own device.

    With ``lengths``, entry ``i`` is cut to its first ``lengths[i]`` rows (padding removed).
    """
    if isinstance(stacked, jax.Array) and not isinstance(stacked, jax.core.Tracer):
        # Indexing a shard is a small jit; inside ``strategy.scope()`` (a mesh in context) it
        # would be checked against the scope's mesh, so it runs outside of it.
        with _no_mesh():
            parts = _split_shards(stacked)
            return parts if lengths is None else tuple(p[:n] for p, n in zip(parts, lengths))
    arr = np.asarray(stacked) if not hasattr(stacked, "shape") else stacked
    parts = tuple(arr[i] for i in range(arr.shape[0]))
    return parts if lengths is None else tuple(p[:n] for p, n in zip(parts, lengths))


def _no_mesh():
    try:
        return jax.set_mesh(None)
    except ValueError:  # inside a trace: no mesh context to leave
        return contextlib.nullcontext()


def _split_shards(stacked: jax.Array) -> tuple[Any, ...]:
    shards = sorted(stacked.addressable_shards, key=lambda s: s.index[0].start if s.index else 0)
    out = []
    for s in shards:
        start = s.index[0].start or 0 if s.index else 0
        data = s.data
        for j in range(data.shape[0]):
            out.append((start + j, data[j]))
    seen: dict[int, Any] = {}
    for idx, v in out:
        seen.setdefault(idx, v)
    return tuple(seen[i] for i in sorted(seen))


def regroup(values: list[Any]) -> Any:
    """Turns a list of per-replica pytrees into one pytree of ``PerReplica`` (stacked on host)."""
    return jax.tree.map(lambda *xs: PerReplica(np.stack([np.asarray(x) for x in xs])), *values)
