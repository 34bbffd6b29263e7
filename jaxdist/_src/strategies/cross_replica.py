"""Reductions across replicas outside ``run``: TF's ``extended.reduce_to``, ``batch_reduce_to``
and ``broadcast_to``, and what ``Strategy.reduce`` / ``gather`` compile.

A ``PerReplica`` value is reduced by one compiled ``shard_map`` program per (op, axis, rank)
(through the strategy's cross-device ops); a mirrored array needs no communication (its sum is
``n`` times it); inside a ``merge_call``'s merge function in a compiled step the value is this
replica's and is reduced as TF does; a value that is not distributed follows TF's
``reduce_non_distributed_value`` rules. A partial batch's ``PerReplica`` reduces its real rows only.

``CrossReplicaReducer`` is the part of ``StrategyExtended`` that does this; it uses the strategy's
``_axes``, ``_mesh``, ``_mesh_devices``, ``_replicated``, ``_cross_device_ops``,
``_num_replicas``, ``_reduce_cache`` and ``_container_strategy``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxdist._src.strategies import context as ctx_lib
from jaxdist._src.strategies.cross_device_ops import (
    all_gather_invariant,
    destination_sharding,
    outside_context_mesh,
    outside_device,
    reduce_on_device,
)
from jaxdist._src.strategies.partial_rows import reduce_rows
from jaxdist._src.strategies.reduce_util import ReduceOp
from jaxdist._src.values.per_replica import PerReplica, is_per_replica


class CrossReplicaReducer:
    """Reductions across replicas outside ``run``, a base of ``StrategyExtended``."""

    def is_mirrored(self, x: Any) -> bool:
        return (
            isinstance(x, jax.Array)
            and not isinstance(x, jax.core.Tracer)
            and x.sharding.device_set == self._mesh_devices
            and x.sharding.is_fully_replicated
        )

    def _reduce_fn(self, op: ReduceOp, axis: int | None, ndim: int):
        key = (op, axis, ndim)
        if key in self._reduce_cache:
            return self._reduce_cache[key]
        axes, n, cdo = self._axes, self._num_replicas, self._cross_device_ops

        def body(x):
            x = x[0]
            count = 1
            if axis is not None:
                count = x.shape[axis]
                x = jnp.sum(x, axis=axis)
            total = cdo.all_reduce(ReduceOp.SUM, x, axes, n)
            if op is ReduceOp.MEAN:
                total = total / (count * n)
            return total

        f = jax.jit(
            jax.shard_map(body, mesh=self._mesh, in_specs=P(axes), out_specs=P()),
        )
        self._reduce_cache[key] = f
        return f

    def gather_fn(self, axis: int):
        key = ("gather", axis)
        if key not in self._reduce_cache:
            axes = self._axes

            def body(x):
                return all_gather_invariant(x[0], axes, axis=axis)

            self._reduce_cache[key] = jax.jit(
                jax.shard_map(body, mesh=self._mesh, in_specs=P(axes), out_specs=P())
            )
        return self._reduce_cache[key]

    def reduce_to(
        self, reduce_op: ReduceOp | str, value: Any, destinations: Any = None, options: Any = None
    ) -> Any:
        """Reduces ``value`` (a pytree of ``PerReplica`` or mirrored arrays) across replicas.

        Args:
            reduce_op: ``ReduceOp.SUM`` / ``MEAN`` or their names.
            value: the values to reduce.
            destinations: where the result goes, any destination TF accepts: ``None``
                (replicated over the replicas), a device or TF device string, a list of them,
                an array (the result is placed as it is: a replicated array gives a replicated
                result), a ``PerReplica`` (replicated over its devices), or a
                ``jax.sharding.Sharding``.
            options: accepted for TF compatibility.

        Raises:
            RuntimeError: called inside another strategy's scope or in a replica context.

        Example:
            >>> import jax, jaxdist
            >>> import jax.numpy as jnp
            >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])  # doctest: +NEEDS_2_DEVICES
            >>> per_replica = strategy.run(lambda: jnp.ones(()))
            >>> strategy.extended.reduce_to("SUM", per_replica, None)
            Array(2., dtype=float32)
        """
        del options
        ctx_lib.require_cross_replica_or_default_context(self._container_strategy)
        op = ReduceOp.from_value(reduce_op)
        target = destination_sharding(destinations)
        if target is None and outside_device(self._cross_device_ops):
            target = self._replicated  # ReductionToOneDevice accumulated outside the replicas
        out = jax.tree.map(lambda v: self.reduce_leaf(op, v, None), value, is_leaf=is_per_replica)
        return self._place_result(out, target)

    def batch_reduce_to(
        self,
        reduce_op: ReduceOp | str,
        value_destination_pairs: Sequence[tuple[Any, Any]],
        options: Any = None,
    ) -> list[Any]:
        """``reduce_to`` for a list of ``(value, destinations)`` pairs.

        Example:
            >>> import jax, jaxdist
            >>> import jax.numpy as jnp
            >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
            >>> x = strategy.run(lambda: jnp.ones(2))
            >>> y = strategy.run(lambda: jnp.zeros(()))
            >>> a, b = strategy.extended.batch_reduce_to("MEAN", [(x, x), (y, None)])
            >>> a, b
            (Array([1., 1.], dtype=float32), Array(0., dtype=float32))
        """
        ctx_lib.require_cross_replica_or_default_context(self._container_strategy)
        pairs = list(value_destination_pairs)
        for pair in pairs:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(
                    f"batch_reduce_to expects (value, destinations) pairs, got {pair!r}"
                )
        return [self.reduce_to(reduce_op, v, d, options) for v, d in pairs]

    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        """Copies ``tensor`` to ``destinations`` (TF's ``extended.broadcast_to``).

        Python ints and floats are returned as they are (as in TF); ``destinations`` ``None``
        means every replica's device (a replicated array).

        Example:
            >>> import jax, jaxdist
            >>> import jax.numpy as jnp
            >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
            >>> w = strategy.extended.broadcast_to(jnp.ones(3), strategy.extended.worker_devices)
        """
        ctx_lib.require_cross_replica_or_default_context(self._container_strategy)
        if isinstance(tensor, (float, int)):
            return tensor
        target = destination_sharding(destinations)
        if target is None:
            target = self._replicated
        return jax.tree.map(lambda x: jax.device_put(x, target), tensor)

    def _to_destination(self, tree: Any, destinations: Any) -> Any:
        return self._place_result(tree, destination_sharding(destinations))

    def _place_result(self, tree: Any, target: Any) -> Any:
        if target is None:
            return tree

        def put(x):
            if isinstance(x, jax.core.Tracer) or isinstance(x, PerReplica):
                return x
            return jax.device_put(x, target)

        return jax.tree.map(put, tree, is_leaf=is_per_replica)

    def reduce_leaf(self, op: ReduceOp, v: Any, axis: int | None) -> Any:
        # Eagerly, outside scope()'s mesh: the value or the reduction may be on devices that are
        # not the strategy's (a host value, ReductionToOneDevice's device); inside a trace
        # nothing changes.
        with outside_context_mesh():
            return self._reduce_leaf_here(op, v, axis)

    def _reduce_leaf_here(self, op: ReduceOp, v: Any, axis: int | None) -> Any:
        n = self._num_replicas
        if isinstance(v, PerReplica) and v.lengths is not None:
            return reduce_rows(op, v, axis)
        if isinstance(v, PerReplica):
            stacked = self.prepare_leaf(v, "pr")
            if axis is not None and not -v.stacked.ndim + 1 <= axis < v.stacked.ndim - 1:
                raise ValueError(
                    f"axis {axis} is out of range for per-replica values of shape {v.shape}"
                )
            ax = None if axis is None else axis % (v.stacked.ndim - 1)
            outside = outside_device(self._cross_device_ops)
            if outside is not None and not isinstance(stacked, jax.core.Tracer):
                # ReductionToOneDevice naming a device outside the mesh: gather there, really.
                return reduce_on_device(self._cross_device_ops, op, stacked, ax, outside)
            return self._reduce_fn(op, ax, stacked.ndim)(stacked)
        merged = ctx_lib.merged_from()
        if merged is not None and merged.axis_name is not None and isinstance(
            v, jax.core.Tracer
        ):
            # strategy.reduce inside a merge_call's merge function, in a compiled step: the
            # value is this replica's; reduce it across the replicas as TF does.
            axes = merged.axis_name
            x = jnp.asarray(v)
            count = 1
            if axis is not None:
                count = x.shape[axis]
                x = jnp.sum(x, axis=axis)
            total = self._cross_device_ops.all_reduce(ReduceOp.SUM, x, axes, n)
            return total / (count * n) if op is ReduceOp.MEAN else total
        if self.is_mirrored(v):
            x = v
            if axis is not None:
                x = jnp.mean(x, axis=axis) if op is ReduceOp.MEAN else jnp.sum(x, axis=axis)
            return x * n if op is ReduceOp.SUM else x
        # A value that is not distributed: TF's reduce_non_distributed_value rules.
        x = v
        if axis is not None:
            x = jnp.mean(x, axis=axis) if op is ReduceOp.MEAN else jnp.sum(x, axis=axis)
        if op is ReduceOp.MEAN or n == 1:
            return x
        if not isinstance(v, jax.Array) and np.all(np.asarray(v) == 0):
            return x
        raise ValueError(
            f"A non-distributed value {v!r} cannot be reduced with {op} across {n} replicas: "
            f"pass a PerReplica value (from strategy.run) or state placed by the strategy"
        )
