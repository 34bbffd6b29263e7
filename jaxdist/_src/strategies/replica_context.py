"""``ReplicaContext``: what a replica function sees (``all_reduce``, ``all_gather``, its id)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist._src.strategies import replica_reduce, trace_util
from jaxdist._src.strategies.context import StrategyLike
from jaxdist._src.strategies.cross_device_ops import all_gather_invariant, varying_axes
from jaxdist._src.strategies.reduce_util import ReduceOp


class ReplicaContext:
    """The context of one replica inside ``strategy.run``.

    Example:
        >>> import jax, jaxdist
        >>> import jax.numpy as jnp
        >>> def step(x):
        ...     ctx = jaxdist.get_replica_context()
        ...     return ctx.all_reduce("SUM", x)
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
        >>> per_replica_x = strategy.experimental_distribute_values_from_function(
        ...     lambda ctx: jnp.float32(1.0))
        >>> total = strategy.run(step, args=(per_replica_x,))   # the replica count, everywhere
    """

    def __init__(self, strategy: StrategyLike, axes: tuple[str, ...] | None):
        self._strategy = strategy
        self._axes = axes
        self._partial: tuple[tuple[int, ...], int] | None = None
        # Whether the replica function asked which rows are real (valid_rows, padded_rows,
        # row_mask; compute_average_loss does): a padded step that never asks is warned about.
        self._row_mask_read = False
        # The trace the replica function starts in (the context is made right before it is
        # called): merge_call looks for control flow between it and its own trace.
        self._home_trace = trace_util.current_trace()

    def _set_partial_batch(self, lengths: tuple[int, ...], padded_rows: int) -> None:
        self._partial = (tuple(lengths), int(padded_rows))

    @property
    def valid_rows(self) -> Any:
        """This replica's real row count on a partial-batch step, else ``None``.

        On TF's last partial batch replicas get different numbers of rows (some none); jaxdist
        passes each replica its rows zero-padded to ``padded_rows``. ``compute_average_loss``
        ignores the padding by itself; mask other per-row computations with
        ``jnp.arange(padded_rows) < ctx.valid_rows`` (``row_mask``): TF's ``reduce_mean(x)``
        over a replica's rows is ``sum(where(mask, x, 0)) / valid_rows`` here. A replica
        function that never reads ``valid_rows``, ``padded_rows`` or ``row_mask`` (nor calls
        ``compute_average_loss``) while a padded batch reaches its non-per-row outputs is
        warned once.

        Example:
            >>> import jaxdist
            >>> import jax.numpy as jnp
            >>> x = jnp.ones((4, 3))
            >>> ctx = jaxdist.get_replica_context()
            >>> if ctx.valid_rows is not None:
            ...     mask = jnp.arange(x.shape[0]) < ctx.valid_rows
        """
        self._row_mask_read = True
        return self._valid_rows()

    def _valid_rows(self) -> Any:
        """``valid_rows`` for jaxdist's own code: not a read by the replica function."""
        if self._partial is None:
            return None
        lengths = jnp.asarray(self._partial[0], jnp.int32)
        return lengths[self.replica_id_in_sync_group]

    def _padded_rows(self) -> int | None:
        """``padded_rows`` for jaxdist's own code: not a read by the replica function."""
        return None if self._partial is None else self._partial[1]

    def _row_mask(self, rows: int) -> Any:
        """``row_mask`` for jaxdist's own code: not a read by the replica function."""
        if self._partial is None or rows != self._partial[1]:
            return jnp.ones((rows,), bool)
        return jnp.arange(rows) < self._valid_rows()

    @property
    def padded_rows(self) -> int | None:
        """The padded per-replica row count on a partial-batch step, else ``None``."""
        self._row_mask_read = True
        return self._padded_rows()

    def row_mask(self, rows: int) -> Any:
        """A bool mask of the real rows among ``rows`` (all True outside a partial step).

        Example:
            >>> import jaxdist
            >>> import jax.numpy as jnp
            >>> x = jnp.ones((4, 3))
            >>> jaxdist.get_replica_context().row_mask(x.shape[0])   # a full batch: all True
            Array([ True,  True,  True,  True], dtype=bool)
        """
        self._row_mask_read = True
        return self._row_mask(rows)

    @property
    def strategy(self) -> StrategyLike:
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
            >>> import jax, jaxdist
            >>> import jax.numpy as jnp
            >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
            >>> loss_fn = lambda w, x: jnp.sum(w * x)
            >>> def step(params, batch):
            ...     ctx = jaxdist.get_replica_context()
            ...     grads = jax.grad(loss_fn)(ctx.local(params), batch)   # per replica
            ...     return ctx.all_reduce("SUM", grads)                  # NcclAllReduce, ...
            >>> grads = strategy.run(step, args=(jnp.ones(3), jnp.ones(3)))
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

        The result is identical on every replica. As in TF:

        * a value that is the same on every replica and was never reduced (a constant, a
          function of replicated state) is treated as one copy per replica: ``SUM`` multiplies
          it by the replica count, ``MEAN`` returns it;
        * the gradient of ``all_reduce`` is the same all-reduce of the upstream gradients (TF's
          registered gradient), so ``jax.grad`` through it gives TF's numbers.

        Raises:
            DoubleReductionError: a leaf is already summed over the replicas, typically
                ``jax.grad(loss_fn)(params)`` with ``params`` replicated (JAX already summed it).
                Drop the ``all_reduce``, or differentiate w.r.t. ``ctx.local(params)``.

        Example:
            >>> import jax, jaxdist
            >>> import jax.numpy as jnp
            >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])  # doctest: +NEEDS_2_DEVICES
            >>> def step(per_replica_loss):
            ...     ctx = jaxdist.get_replica_context()
            ...     return ctx.all_reduce("SUM", per_replica_loss)
            >>> strategy.experimental_local_results(strategy.run(step, args=(jnp.float32(0.5),)))
            (Array(1., dtype=float32), Array(1., dtype=float32))
        """
        del options
        op = ReduceOp.from_value(reduce_op)
        if self._axes is None:
            return value
        ext = self._strategy.extended
        return replica_reduce.all_reduce(
            ext.cross_device_ops, op, value, self._axes, self.num_replicas_in_sync
        )

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

        Raises:
            RuntimeError: called inside a ``jax.lax`` control-flow body (``while_loop``,
                ``fori_loop``, ``scan``, ``map``, ``cond``, ``switch``) traced inside the
                replica function, as TF's mirrored replica threads raise for a ``merge_call``
                inside a ``tf.while_loop`` or ``tf.cond`` body (``MirroredStrategy``,
                ``MultiWorkerMirroredStrategy``, ``CentralStorageStrategy``,
                ``ParameterServerStrategy``; TF's ``OneDeviceStrategy``, ``TPUStrategy`` and
                default strategy have no such check, and neither do jaxdist's). The error
                comes while the step is traced, before anything is dispatched;
                ``all_reduce`` inside such a body is fine.

        Example:
            >>> import jax, jaxdist
            >>> import jax.numpy as jnp
            >>> def merge_fn(strategy, x):
            ...     return strategy.reduce("SUM", x, axis=None)
            >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
            >>> def step(x):
            ...     return jaxdist.get_replica_context().merge_call(merge_fn, args=(x,))
            >>> total = strategy.run(step, args=(jnp.float32(1.0),))
        """
        from jaxdist._src.strategies import context as ctx_lib

        if getattr(self._strategy, "merge_call_checks_control_flow", True):
            inside = trace_util.control_flow_between(self._home_trace)
            if inside is not None:
                raise RuntimeError(
                    f"`merge_call` called while defining a new graph or a tf.function: "
                    f"merge_call({getattr(merge_fn, '__qualname__', merge_fn)!r}) is inside "
                    f"a jax.lax control-flow body (traced for {inside!r}) within the replica "
                    f"function of {self._strategy!r}. A merge function cannot run inside "
                    f"while_loop, fori_loop, scan, map, cond or switch (TF raises the same for "
                    f"tf.while_loop / tf.cond). Move the merge_call out of the control flow, "
                    f"or reduce inside the body with "
                    f"jaxdist.get_replica_context().all_reduce(...)."
                )
        with ctx_lib.enter_merge(self._strategy, self):
            return merge_fn(self._strategy, *args, **(kwargs or {}))

    def __repr__(self) -> str:
        return f"ReplicaContext(strategy={self._strategy!r})"


# jaxdist's own reads of a replica context's partial batch (``compiled_run``, ``nnx_state``,
# the Keras custom loop): not reads by the replica function, so they do not count as the
# function asking for the row mask (``valid_rows``).


def set_partial_batch(rctx: ReplicaContext, lengths: tuple[int, ...], padded_rows: int) -> None:
    """Makes ``rctx`` a partial-batch step's: ``lengths`` real rows per replica, each replica's
    rows zero-padded to ``padded_rows``."""
    rctx._set_partial_batch(lengths, padded_rows)


def row_mask_was_read(rctx: ReplicaContext) -> bool:
    """Whether the replica function read ``valid_rows``, ``padded_rows`` or ``row_mask``."""
    return rctx._row_mask_read


def padded_rows_of(rctx: ReplicaContext) -> int | None:
    """``rctx.padded_rows`` without counting as the replica function's read."""
    return rctx._padded_rows()


def row_mask_of(rctx: ReplicaContext, rows: int) -> Any:
    """``rctx.row_mask(rows)`` without counting as the replica function's read."""
    return rctx._row_mask(rows)
