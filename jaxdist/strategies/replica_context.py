"""``ReplicaContext``: what a replica function sees (``all_reduce``, ``all_gather``, its id)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist.strategies.cross_device_ops import all_gather_invariant, varying_axes
from jaxdist.strategies.reduce_util import ReduceOp

if TYPE_CHECKING:
    from jaxdist.strategies.strategy import Strategy


class ReplicaContext:
    """The context of one replica inside ``strategy.run``.

    Example:
        >>> def step(x):
        ...     ctx = jaxdist.get_replica_context()
        ...     return ctx.all_reduce("SUM", x)
        >>> strategy.run(step, args=(per_replica_x,))
    """

    def __init__(self, strategy: Strategy, axes: tuple[str, ...] | None):
        self._strategy = strategy
        self._axes = axes

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        return self._strategy.num_replicas_in_sync

    @property
    def axis_name(self) -> tuple[str, ...] | None:
        """The mesh axis names the replicas span (for direct ``jax.lax`` collectives)."""
        return self._axes

    @property
    def replica_id_in_sync_group(self) -> Any:
        """This replica's index in ``[0, num_replicas_in_sync)`` (a traced int32 scalar)."""
        if self._axes is None:
            return jnp.int32(0)
        return lax.axis_index(self._axes)

    def local(self, value: Any) -> Any:
        """This replica's own copy of mirrored state (typed as varying across replicas).

        JAX differentiates replicated state as one value: ``jax.grad`` of a per-replica loss
        with respect to it already sums the gradient over the replicas (shard_map inserts the
        all-reduce). To get per-replica gradients, as ``tf.GradientTape`` gives, and reduce them
        with the strategy's cross-device op, differentiate with respect to ``ctx.local(params)``
        and call ``all_reduce``:

        Example:
            >>> ctx = jaxdist.get_replica_context()
            >>> grads = jax.grad(loss_fn)(ctx.local(params), batch)   # per replica
            >>> grads = ctx.all_reduce("SUM", grads)                  # NcclAllReduce, ...
        """
        if self._axes is None:
            return value

        def cast(x):
            x = jnp.asarray(x)
            missing = tuple(a for a in self._axes if a not in varying_axes(x))
            return lax.pcast(x, missing, to="varying") if missing else x

        return jax.tree.map(cast, value)

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any, options: Any = None) -> Any:
        """Reduces ``value`` (a pytree) across replicas with the strategy's cross-device op.

        The result is identical on every replica. A value that is already the same on every
        replica is treated as TF does: ``SUM`` multiplies it by the replica count, ``MEAN``
        returns it.
        """
        del options
        op = ReduceOp.from_value(reduce_op)
        if self._axes is None:
            return value
        ext = self._strategy.extended
        return ext._cross_device_ops.all_reduce(op, value, self._axes, self.num_replicas_in_sync)

    def all_gather(self, value: Any, axis: int, options: Any = None) -> Any:
        """Concatenates every replica's ``value`` along ``axis``, in replica order."""
        del options
        if self._axes is None:
            return value
        return jax.tree.map(
            lambda x: all_gather_invariant(jnp.asarray(x), self._axes, axis=axis), value
        )

    def merge_call(self, merge_fn, args=(), kwargs=None) -> Any:
        """Calls ``merge_fn(strategy, *args, **kwargs)`` in the cross-replica context.

        Inside ``merge_fn``, ``get_replica_context()`` is ``None`` and
        ``get_cross_replica_context()`` is the strategy, as in TF. In a compiled step the
        function is traced once (not once per replica) and ``args`` are this replica's values;
        ``strategy.reduce`` / ``extended.reduce_to`` on them reduce across the replicas.

        Example:
            >>> def merge_fn(strategy, x):
            ...     return strategy.reduce("SUM", x, axis=None)
            >>> total = jaxdist.get_replica_context().merge_call(merge_fn, args=(x,))
        """
        from jaxdist.strategies import context as ctx_lib

        with ctx_lib.enter_merge(self._strategy, self):
            return merge_fn(self._strategy, *args, **(kwargs or {}))

    def __repr__(self) -> str:
        return f"ReplicaContext(strategy={self._strategy!r})"
