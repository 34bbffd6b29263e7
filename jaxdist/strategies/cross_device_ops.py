"""Cross-device reductions: NcclAllReduce, HierarchicalCopyAllReduce, ReductionToOneDevice.

Each class is a different, real communication pattern over the replicas of a strategy's mesh
(the same numbers come out of all of them):

* ``NcclAllReduce``: one-level all-reduce (``lax.psum``) of the values packed into ``num_packs``
  flat buffers: what NCCL does on GPUs, and XLA's all-reduce everywhere else.
* ``HierarchicalCopyAllReduce``: the replicas are split into groups (a 2-D mesh
  ``("replica_outer", "replica_inner")``); values are first reduced inside each group, then across
  groups: two levels of smaller all-reduces, as TF does on DGX-like machines.
* ``ReductionToOneDevice``: every replica sends its value to one device (point-to-point
  ``ppermute``), that device accumulates them with ``accumulation_fn``, and the result is
  broadcast back.

All methods here run inside a replica context (inside ``shard_map``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdist.strategies.reduce_util import ReduceOp

REPLICA_AXIS = "replica"


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes ``x`` varies over inside ``shard_map`` (empty outside it)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None and hasattr(mat, "varying"):
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def all_gather_invariant(x: Any, axes: tuple[str, ...], axis: int = 0) -> Any:
    """Concatenates every replica's ``x`` along ``axis``; typed as identical on all replicas."""
    if not _varies(x, axes):
        x = lax.pcast(x, axes, to="varying")
    try:
        from jax._src.lax.parallel import all_gather_invariant as _agi
    except ImportError:  # pragma: no cover - older/newer JAX without the private helper
        n = lax.axis_size(axes)
        idx = lax.axis_index(axes)
        parts = jnp.zeros((n, *x.shape), x.dtype).at[idx].set(x)
        return jnp.concatenate(list(lax.psum(parts, axes)), axis=axis)
    return _agi(x, axes, axis=axis, tiled=True)


def _varies(x: Any, axes: tuple[str, ...]) -> bool:
    return bool(set(axes) & varying_axes(x))


class CrossDeviceOps:
    """Base class: how a strategy reduces values across its replicas.

    Subclasses implement ``_sum_varying`` (and ``mesh_layout`` if they need another mesh).

    Example:
        >>> class Psum(jaxdist.CrossDeviceOps):
        ...     def _sum_varying(self, xs, axes, n):
        ...         return [jax.lax.psum(x, axes) for x in xs]
        >>> strategy = jaxdist.MirroredStrategy(cross_device_ops=Psum())
    """

    def mesh_layout(self, num_replicas: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Returns the mesh shape and axis names this pattern needs for ``num_replicas``."""
        return (num_replicas,), (REPLICA_AXIS,)

    def bind(self, devices: Sequence[Any]) -> None:
        """Called once by the strategy with its devices (in replica order)."""
        self._devices = tuple(devices)

    # Subclasses implement the reduction of a list of varying arrays (SUM).
    def _sum_varying(self, xs: list[Any], axes: tuple[str, ...], n: int) -> list[Any]:
        raise NotImplementedError

    def all_reduce(self, op: ReduceOp | str, value: Any, axes: tuple[str, ...], n: int) -> Any:
        """Reduces every leaf of ``value`` across replicas; the result is identical on all."""
        op = ReduceOp.from_value(op)
        leaves, treedef = jax.tree.flatten(value)
        leaves = [jnp.asarray(x) for x in leaves]
        varying = [i for i, x in enumerate(leaves) if _varies(x, axes)]
        out = list(leaves)
        for i, x in enumerate(leaves):
            if i not in varying and op is ReduceOp.SUM:
                # The same value on every replica: the sum is n times it (no communication).
                out[i] = x * n
        if varying:
            chosen = [leaves[i] for i in varying]
            if n == 1:  # one replica: a plain psum types the result, XLA elides it
                summed = [lax.psum(x, axes) for x in chosen]
            else:
                summed = self._sum_varying(chosen, axes, n)
            for i, s in zip(varying, summed):
                out[i] = s
        if op is ReduceOp.MEAN:
            out = [(x / n).astype(x.dtype) if i in varying else x for i, x in enumerate(out)]
        return treedef.unflatten(out)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _by_dtype(xs: list[Any]) -> list[list[int]]:
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(xs):
        groups.setdefault(x.dtype, []).append(i)
    return list(groups.values())


def _unflatten(xs: list[Any], idx: list[int], flat: Any, out: list[Any]) -> None:
    """Cuts ``flat`` back into the arrays ``xs[i] for i in idx`` (their shapes), into ``out``."""
    offset = 0
    for i in idx:
        size = int(np.prod(xs[i].shape))
        out[i] = flat[offset : offset + size].reshape(xs[i].shape)
        offset += size


def _pack(xs: list[Any], num_packs: int) -> tuple[list[Any], Callable[[list[Any]], list[Any]]]:
    """Concatenates same-dtype arrays into ``num_packs`` flat buffers; returns an unpack fn."""
    if num_packs <= 0:
        return xs, lambda ys: ys
    packs: list[Any] = []
    plan: list[tuple[list[int], int]] = []
    for idx in _by_dtype(xs):
        flat = jnp.concatenate([xs[i].reshape(-1) for i in idx])
        size = flat.shape[0]
        k = max(1, min(num_packs, size))
        bounds = [(size * j) // k for j in range(k + 1)]
        plan.append((idx, k))
        packs.extend(flat[bounds[j] : bounds[j + 1]] for j in range(k))

    def unpack(ys: list[Any]) -> list[Any]:
        out: list[Any] = [None] * len(xs)
        pos = 0
        for idx, k in plan:
            _unflatten(xs, idx, jnp.concatenate(ys[pos : pos + k]) if k > 1 else ys[pos], out)
            pos += k
        return out

    return packs, unpack


def pack_by_bytes(xs: list[Any], bytes_per_pack: int) -> tuple[list[Any], Callable]:
    """Packs same-dtype arrays into flat buckets of at most ``bytes_per_pack`` bytes.

    An array larger than a bucket gets a bucket of its own. Returns the buckets and a function
    that turns reduced buckets back into arrays of the original shapes.
    """
    plan: list[list[int]] = []
    for idx in _by_dtype(xs):
        bucket: list[int] = []
        size = 0
        for i in idx:
            nbytes = int(np.prod(xs[i].shape)) * xs[i].dtype.itemsize
            if bucket and size + nbytes > bytes_per_pack:
                plan.append(bucket)
                bucket, size = [], 0
            bucket.append(i)
            size += nbytes
        if bucket:
            plan.append(bucket)
    packs = [jnp.concatenate([xs[i].reshape(-1) for i in b]) for b in plan]

    def unpack(ys: list[Any]) -> list[Any]:
        out: list[Any] = [None] * len(xs)
        for b, flat in zip(plan, ys):
            _unflatten(xs, b, flat, out)
        return out

    return packs, unpack


class NcclAllReduce(CrossDeviceOps):
    """One-level all-reduce of values packed into ``num_packs`` buffers.

    Args:
        num_packs: how many flat buffers the values are concatenated into before the
            all-reduce (TF's gradient packing); ``0`` reduces each value on its own.

    Example:
        >>> strategy = jaxdist.MirroredStrategy(cross_device_ops=jaxdist.NcclAllReduce(2))
    """

    def __init__(self, num_packs: int = 1):
        if num_packs < 0:
            raise ValueError(f"num_packs must be >= 0, got {num_packs}")
        self.num_packs = num_packs

    def _sum_varying(self, xs, axes, n):
        packs, unpack = _pack(xs, self.num_packs)
        return unpack([lax.psum(p, axes) for p in packs])

    def __repr__(self) -> str:
        return f"NcclAllReduce(num_packs={self.num_packs})"


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """Two-level all-reduce: inside groups of replicas, then across the groups.

    The replicas are laid out on a 2-D mesh ``(num_groups, group_size)`` with axes
    ``("replica_outer", "replica_inner")``; with 8 replicas that is 2 groups of 4, as TF's
    hierarchical copy does for DGX-1 machines. Fewer than 4 (or an odd number of) replicas form
    one group.

    Args:
        num_packs: number of flat buffers the values are packed into first.

    Example:
        >>> strategy = jaxdist.MirroredStrategy(
        ...     cross_device_ops=jaxdist.HierarchicalCopyAllReduce(num_packs=1))
    """

    OUTER, INNER = "replica_outer", "replica_inner"

    def __init__(self, num_packs: int = 1):
        if num_packs < 0:
            raise ValueError(f"num_packs must be >= 0, got {num_packs}")
        self.num_packs = num_packs

    def mesh_layout(self, num_replicas):
        groups = 2 if num_replicas >= 4 and num_replicas % 2 == 0 else 1
        return (groups, num_replicas // groups), (self.OUTER, self.INNER)

    def _sum_varying(self, xs, axes, n):
        packs, unpack = _pack(xs, self.num_packs)
        inner = [lax.psum(p, self.INNER) for p in packs]
        return unpack([lax.psum(p, self.OUTER) for p in inner])

    def __repr__(self) -> str:
        return f"HierarchicalCopyAllReduce(num_packs={self.num_packs})"


def _add_n(values: list[Any]) -> Any:
    return functools.reduce(jnp.add, values)


class ReductionToOneDevice(CrossDeviceOps):
    """Gathers every replica's value on one device, reduces there, broadcasts the result.

    Args:
        reduce_to_device: the device (JAX device or TF string) that accumulates; it must be one
            of the strategy's devices. ``None`` means the first replica's device.
        accumulation_fn: combines the list of gathered values (default: their sum, like
            ``tf.math.add_n``).

    Example:
        >>> ops = jaxdist.ReductionToOneDevice(reduce_to_device="/cpu:0")
        >>> strategy = jaxdist.MirroredStrategy(cross_device_ops=ops)
    """

    def __init__(self, reduce_to_device: Any = None, accumulation_fn: Callable | None = None):
        self.reduce_to_device = reduce_to_device
        self.accumulation_fn = accumulation_fn or _add_n
        self._target = 0

    def bind(self, devices):
        super().bind(devices)
        if self.reduce_to_device is None:
            self._target = 0
            return
        from jaxdist.strategies.devices import resolve_device

        dev = resolve_device(self.reduce_to_device)
        if dev not in self._devices:
            raise ValueError(
                f"reduce_to_device {self.reduce_to_device!r} resolves to {dev}, which is not one "
                f"of the strategy's devices {list(self._devices)}"
            )
        self._target = self._devices.index(dev)

    def _sum_varying(self, xs, axes, n):
        target = self._target
        idx = lax.axis_index(axes)
        out = []
        for x in xs:
            gathered = [x]
            for src in range(n):
                if src == target:
                    continue
                # Point-to-point: replica ``src`` sends its value to ``target`` only.
                gathered.append(lax.ppermute(x, axes, perm=[(src, target)]))
            acc = self.accumulation_fn(gathered)
            # Broadcast from the target (JAX's pbroadcast is defined as this masked psum).
            out.append(lax.psum(jnp.where(idx == target, acc, jnp.zeros_like(acc)), axes))
        return out

    def __repr__(self) -> str:
        return f"ReductionToOneDevice(reduce_to_device={self.reduce_to_device!r})"
