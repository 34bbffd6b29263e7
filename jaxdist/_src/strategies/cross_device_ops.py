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

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdist._src.compat import jax_internals
from jaxdist._src.strategies.reduce_util import ReduceOp

REPLICA_AXIS = "replica"


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes ``x`` varies over inside ``shard_map`` (empty outside it)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None and hasattr(mat, "varying"):
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


@contextlib.contextmanager
def outside_context_mesh() -> Iterator[None]:
    """Leaves the context mesh (``strategy.scope()`` sets the replica mesh) for eager work.

    Under a context mesh JAX refuses computations on arrays placed elsewhere ("incompatible
    devices"), such as a reduction accumulated on a device outside the strategy's devices.
    Inside a trace there is no context to leave, and nothing changes.

    Example:
        >>> import jax, jaxdist
        >>> import jax.numpy as jnp
        >>> from jaxdist._src.strategies.cross_device_ops import outside_context_mesh
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[1:3])  # doctest: +NEEDS_4_DEVICES
        >>> with strategy.scope(), outside_context_mesh():
        ...     y = jax.device_put(jnp.ones(2), jax.devices()[0]) * 2  # a device not in the mesh
    """
    try:
        ctx = jax.set_mesh(None)
    except ValueError:  # inside a trace: no mesh context to leave
        ctx = contextlib.nullcontext()
    with ctx:
        yield


def all_gather_invariant(x: Any, axes: tuple[str, ...], axis: int = 0) -> Any:
    """Concatenates every replica's ``x`` along ``axis``; typed as identical on all replicas."""
    if not _varies(x, axes):
        x = lax.pcast(x, axes, to="varying")
    _agi = jax_internals.all_gather_invariant()
    if _agi is None:  # pragma: no cover - a JAX without the helper
        n = lax.axis_size(axes)
        idx = lax.axis_index(axes)
        parts = jnp.zeros((n, *x.shape), x.dtype).at[idx].set(x)
        return jnp.concatenate(list(lax.psum(parts, axes)), axis=axis)
    return _agi(x, axes, axis=axis, tiled=True)


def _varies(x: Any, axes: tuple[str, ...]) -> bool:
    return bool(set(axes) & varying_axes(x))


def _is_per_replica(x: Any) -> bool:
    from jaxdist._src.values.per_replica import PerReplica

    return isinstance(x, PerReplica)


def per_replica_devices(stacked: Any) -> tuple[Any, ...]:
    """The devices of a stacked ``(num_replicas, ...)`` array, in replica order."""
    by_start: dict[int, Any] = {}
    for sh in stacked.addressable_shards:
        start = (sh.index[0].start or 0) if sh.index else 0
        by_start.setdefault(start, sh.device)
    return tuple(by_start[k] for k in sorted(by_start))


def _first_device(sharding: jax.sharding.Sharding) -> Any:
    if isinstance(sharding, jax.sharding.NamedSharding):
        return sharding.mesh.devices.flat[0]
    return min(sharding.device_set, key=lambda d: d.id)


def _replicated_over(devices: Sequence[Any]) -> jax.sharding.Sharding:
    devices = list(devices)
    if len(devices) == 1:
        return jax.sharding.SingleDeviceSharding(devices[0])
    mesh = jax.sharding.Mesh(np.array(devices), ("destinations",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def destination_sharding(destinations: Any) -> jax.sharding.Sharding | None:
    """Where a reduction's result goes, for every destination TF accepts.

    Args:
        destinations: ``None`` (returns ``None``: the caller's default), a device or TF device
            string, a list/tuple of them (the result is replicated on each), a
            ``jax.sharding.Sharding``, an array (a replicated array gives its own sharding, any
            other array a copy on each of its devices), or a ``PerReplica`` (a copy on each
            replica's device).

    Raises:
        ValueError: an empty list, or a value that names no device.

    Example:
        >>> from jaxdist._src.strategies.cross_device_ops import destination_sharding
        >>> sharding = destination_sharding(["/cpu:0", "/cpu:1"])  # doctest: +NEEDS_2_DEVICES
        >>> sorted(d.id for d in sharding.device_set)
        [0, 1]
    """
    from jaxdist._src.strategies.devices import resolve_device

    if destinations is None:
        return None
    if isinstance(destinations, jax.sharding.Sharding):
        return destinations
    if _is_per_replica(destinations):
        if isinstance(destinations.stacked, jax.core.Tracer):
            return None
        return _replicated_over(per_replica_devices(destinations.stacked))
    if isinstance(destinations, jax.core.Tracer):
        return None
    if isinstance(destinations, jax.Array):
        sh = destinations.sharding
        if sh.is_fully_replicated:
            return sh
        return _replicated_over(sorted(sh.device_set, key=lambda d: d.id))
    if isinstance(destinations, (str, jax.Device)):
        return jax.sharding.SingleDeviceSharding(resolve_device(destinations))
    if isinstance(destinations, (list, tuple)):
        if not destinations:
            raise ValueError("destinations can not be empty")
        devs: list[Any] = []
        for d in destinations:
            if not isinstance(d, (str, jax.Device)):
                raise ValueError(
                    f"a destinations list must hold devices or device strings, got {d!r}"
                )
            dev = resolve_device(d)
            if dev not in devs:
                devs.append(dev)
        return _replicated_over(devs)
    if isinstance(destinations, (np.ndarray, np.generic, float, int)):
        # A host value (TF: a tensor on the host CPU).
        return jax.sharding.SingleDeviceSharding(_host_device())
    raise ValueError(
        f"destinations must be a device or device string, a list of them, an array, a "
        f"PerReplica or a jax.sharding.Sharding, got {destinations!r} of type "
        f"{type(destinations).__name__}"
    )


def _host_device() -> Any:
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:  # pragma: no cover - no CPU backend
        return jax.local_devices()[0]


class CrossDeviceOps:
    """Base class: how a strategy reduces values across its replicas.

    Subclasses implement ``_sum_varying`` (and ``mesh_layout`` if they need another mesh).

    Example:
        >>> import jax, jaxdist
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

    # ------------------------------------------------------------ cross-replica API (TF's)
    def reduce(
        self, reduce_op: ReduceOp | str, per_replica_value: Any, destinations: Any, options=None
    ) -> Any:
        """Reduces ``per_replica_value`` across its replicas and puts the result on
        ``destinations`` (TF's ``CrossDeviceOps.reduce``), outside any ``run``.

        ``per_replica_value`` is a pytree of ``PerReplica`` values (reduced with this pattern
        over their devices), of replicated arrays (one copy per device, as a TF ``Mirrored``:
        ``SUM`` gives copies x value) or of single-device arrays (one value: returned as is).

        Raises:
            ValueError: ``destinations`` is ``None`` or empty or names no device.

        Example:
            >>> import jax, jaxdist
            >>> import jax.numpy as jnp
            >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])  # doctest: +NEEDS_2_DEVICES
            >>> per_replica = strategy.run(lambda: jnp.ones(()))
            >>> total = jaxdist.NcclAllReduce().reduce("SUM", per_replica, ["/cpu:0", "/cpu:1"])
            >>> float(total)
            2.0
        """
        del options
        op = ReduceOp.from_value(reduce_op)
        if destinations is None:
            raise ValueError("destinations can not be None")
        target = destination_sharding(destinations)
        with outside_context_mesh():
            out = jax.tree.map(
                lambda v: self._reduce_value(op, v, target), per_replica_value,
                is_leaf=_is_per_replica,
            )
            return jax.tree.map(lambda x: jax.device_put(x, target), out)

    def batch_reduce(
        self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[Any], options=None
    ) -> list[Any]:
        """``reduce`` for a list of ``(value, destinations)`` pairs.

        Example:
            >>> import jaxdist
            >>> import jax.numpy as jnp
            >>> x, y = jnp.ones(2), jnp.zeros(())
            >>> a, b = jaxdist.NcclAllReduce().batch_reduce("MEAN", [(x, "/cpu:0"), (y, "/cpu:0")])
        """
        pairs = list(value_destination_pairs)
        for pair in pairs:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"batch_reduce expects (value, destinations) pairs, got {pair!r}")
        return [self.reduce(reduce_op, v, d, options) for v, d in pairs]

    def broadcast(self, tensor: Any, destinations: Any) -> Any:
        """Copies ``tensor`` to every device of ``destinations`` (TF's ``broadcast``).

        Example:
            >>> import jaxdist
            >>> import jax.numpy as jnp
            >>> m = jaxdist.NcclAllReduce().broadcast(  # doctest: +NEEDS_2_DEVICES
            ...     jnp.ones(()), ["/cpu:0", "/cpu:1"])
        """
        if destinations is None:
            raise ValueError("destinations can not be None")
        target = destination_sharding(destinations)
        return jax.tree.map(lambda x: jax.device_put(x, target), tensor)

    def _reduce_value(self, op: ReduceOp, v: Any, target: Any) -> Any:
        if _is_per_replica(v):
            stacked = v.stacked
            if not isinstance(stacked, jax.Array):
                stacked = jnp.asarray(stacked)
            devs = per_replica_devices(stacked)
            if stacked.shape[0] == 1:
                return stacked[0]
            if len(devs) != stacked.shape[0]:
                raise ValueError(
                    f"a PerReplica value with {stacked.shape[0]} replicas on {len(devs)} devices "
                    f"cannot be reduced with {self!r}: each replica needs its own device"
                )
            return self._reduce_stacked(op, stacked, devs, target)
        x = jnp.asarray(v)
        copies = len(x.sharding.device_set) if isinstance(x, jax.Array) else 1
        if op is ReduceOp.SUM and copies > 1 and x.sharding.is_fully_replicated:
            return x * copies
        return x

    def _reduce_stacked(self, op: ReduceOp, stacked: Any, devs: tuple, target: Any) -> Any:
        """Reduces a stacked per-replica array with this pattern over a mesh of ``devs``."""
        del target
        cache = self.__dict__.setdefault("_standalone_cache", {})
        key = (devs, op)
        if key not in cache:
            n = len(devs)
            shape, axes = self.mesh_layout(n)
            mesh = jax.make_mesh(
                shape,
                tuple(axes),
                axis_types=(jax.sharding.AxisType.Auto,) * len(axes),
                devices=list(devs),
            )
            spec = jax.sharding.PartitionSpec(tuple(axes))

            def body(x):
                return self.all_reduce(op, x[0], tuple(axes), n)

            fn = jax.jit(
                jax.shard_map(
                    body, mesh=mesh, in_specs=spec, out_specs=jax.sharding.PartitionSpec()
                )
            )
            cache[key] = (fn, jax.sharding.NamedSharding(mesh, spec))
        fn, in_sharding = cache[key]
        if isinstance(stacked, jax.core.Tracer):
            return fn(stacked)
        # Its own mesh as the context (a strategy scope may have set another one).
        with jax.set_mesh(in_sharding.mesh):
            return fn(jax.device_put(stacked, in_sharding))

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
        >>> import jaxdist
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
        >>> import jaxdist
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
        reduce_to_device: the device (JAX device or TF string) that accumulates. ``None`` means
            the first destination device (cross-replica ``reduce``) or the first replica's device
            (inside ``run``). It may be a device outside the strategy's devices (e.g. the host
            CPU while the replicas run on GPUs): cross-replica reductions (``strategy.reduce``,
            ``extended.reduce_to``, ``reduce``) then really gather there; inside a compiled step
            (``ReplicaContext.all_reduce``) no device outside the mesh can take part, so the
            values are accumulated on the first replica's device instead (same numbers).
        accumulation_fn: combines the list of gathered values (default: their sum, like
            ``tf.math.add_n``).

    Example:
        >>> import jaxdist
        >>> ops = jaxdist.ReductionToOneDevice(reduce_to_device="/cpu:0")
        >>> strategy = jaxdist.MirroredStrategy(cross_device_ops=ops)
    """

    def __init__(self, reduce_to_device: Any = None, accumulation_fn: Callable | None = None):
        self.reduce_to_device = reduce_to_device
        self.accumulation_fn = accumulation_fn or _add_n
        self._target = 0
        self._outside_device = None
        if reduce_to_device is not None:
            from jaxdist._src.strategies.devices import resolve_device

            self._device = resolve_device(reduce_to_device)  # a bad string fails here, early
        else:
            self._device = None

    def bind(self, devices):
        super().bind(devices)
        self._target = 0
        self._outside_device = None
        if self._device is None:
            return
        if self._device in self._devices:
            self._target = self._devices.index(self._device)
        else:
            self._outside_device = self._device

    def _reduce_on_device(self, op: ReduceOp, stacked: Any, axis: int | None, device: Any) -> Any:
        """Copies every replica's value to ``device``, accumulates there (TF's _simple_reduce).

        ``axis`` (optional) is first summed over on each replica; ``MEAN`` divides by the
        replica count (times the size of ``axis``).
        """
        from jaxdist._src.values.per_replica import local_components

        with outside_context_mesh():  # ``device`` may be outside the scope's mesh
            parts = [jax.device_put(p, device) for p in local_components(stacked)]
            count = 1
            if axis is not None:
                count = parts[0].shape[axis]
                parts = [jnp.sum(p, axis=axis) for p in parts]
            acc = self.accumulation_fn(parts)
            if op is ReduceOp.MEAN:
                acc = (acc / (count * len(parts))).astype(acc.dtype)
            return acc

    def _reduce_stacked(self, op, stacked, devs, target):
        device = self._device
        if device is None:
            device = _first_device(target) if target is not None else devs[0]
        return self._reduce_on_device(op, stacked, None, device)

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


def outside_device(ops: CrossDeviceOps) -> Any:
    """The device outside the replica mesh a ``ReductionToOneDevice`` reduces on, else ``None``
    (it is known once the ops are bound to a strategy's devices)."""
    return getattr(ops, "_outside_device", None)


def reduce_on_device(ops: ReductionToOneDevice, op: ReduceOp, stacked: Any, axis: int | None,
                     device: Any) -> Any:
    """``ops`` reducing a stacked per-replica array on ``device`` outside the mesh (copies every
    replica's value there; ``ReductionToOneDevice``'s gather, for real)."""
    return ops._reduce_on_device(op, stacked, axis, device)
