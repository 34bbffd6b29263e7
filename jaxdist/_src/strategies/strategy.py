"""``Strategy`` and ``StrategyExtended``: the API every strategy shares (TF's names).

A strategy owns a mesh of replicas. ``run(fn, args)`` compiles ``jit(shard_map(fn))`` over that
mesh: ``PerReplica`` inputs are split one entry per replica, everything else is passed whole,
outputs that are identical on every replica (JAX's shard_map types say which) come back as one
replicated array, and outputs that vary come back as ``PerReplica``. The compile cache and
dispatch behind ``run`` live in ``compiled_run`` (``CompiledRunner``) and the reductions outside
``run`` in ``cross_replica`` (``CrossReplicaReducer``), both bases of ``StrategyExtended``; this
module holds TF's API: scope, placement, updates, reduce and the distribution of values.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist._src.compat import jax_internals
from jaxdist._src.strategies import context as ctx_lib
from jaxdist._src.strategies.compiled_run import MISS, RUN_CACHE_SIZE, CompiledRunner, is_dynamic
from jaxdist._src.strategies.context import SCOPE_HOOKS
from jaxdist._src.strategies.cross_device_ops import (
    CrossDeviceOps,
    NcclAllReduce,
)
from jaxdist._src.strategies.cross_replica import CrossReplicaReducer
from jaxdist._src.strategies.fn_key import function_key
from jaxdist._src.strategies.inflight import StepThrottle
from jaxdist._src.strategies.partial_rows import (
    gather_rows,
)
from jaxdist._src.strategies.reduce_util import ReduceOp
from jaxdist._src.strategies.run_options import RunOptions
from jaxdist._src.values.per_replica import PerReplica, is_per_replica, local_components


class ValueContext:
    """What ``experimental_distribute_values_from_function`` passes to its function.

    Attributes:
        replica_id_in_sync_group: the replica the value is for.
        num_replicas_in_sync: the total number of replicas.

    Example:
        >>> import jax, jaxdist
        >>> import numpy as np
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])  # doctest: +NEEDS_2_DEVICES
        >>> v = strategy.experimental_distribute_values_from_function(
        ...     lambda ctx: np.full(2, ctx.replica_id_in_sync_group / ctx.num_replicas_in_sync))
        >>> strategy.experimental_local_results(v)[1]
        Array([0.5, 0.5], dtype=float32)
    """

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1):
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"ValueContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )



class StrategyExtended(CrossReplicaReducer, CompiledRunner):
    """Strategy internals with TF's ``extended`` names (``reduce_to``, ``update``, ...).

    Example:
        >>> import jax, jaxdist
        >>> import jax.numpy as jnp
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])  # doctest: +NEEDS_2_DEVICES
        >>> ext = strategy.extended
        >>> len(ext.worker_devices)
        2
        >>> per_replica_value = strategy.experimental_distribute_values_from_function(
        ...     lambda ctx: jnp.ones(3) * (ctx.replica_id_in_sync_group + 1))
        >>> total = ext.reduce_to("SUM", per_replica_value, destinations=None)
        >>> total
        Array([3., 3., 3.], dtype=float32)
        >>> ext.update(jnp.zeros(3), lambda s, g: s - 0.1 * g, args=(total,))
        Array([-0.3, -0.3, -0.3], dtype=float32)

    Args:
        strategy: the owning strategy.
        devices: compute devices, in replica order.
        cross_device_ops: how replicas reduce (default ``NcclAllReduce(num_packs=0)``).
        max_steps_in_flight: bound on dispatched-but-unfinished ``run`` calls (see
            ``StepThrottle``).

    Besides TF's names, jaxdist's own modules (``Strategy``, the strategies' subclasses, the
    Keras integration, the coordinator) use this extension surface; a subclass overrides the
    methods marked so:

    * ``container_strategy``: the owning ``Strategy``; ``cross_device_ops``: its
      ``CrossDeviceOps``; ``mesh``, ``replica_axis_names``, ``num_replicas_in_mesh``,
      ``replicated_sharding``, ``per_replica_sharding``: the replica mesh and its shardings.
    * ``placement_mesh()`` (overridable): the mesh ``scope()`` places new arrays on (``None``:
      none).
    * ``run_compiled(fn, args, kwargs)`` (overridable): ``Strategy.run``'s work after its
      context checks (compile, place, dispatch; ``CompiledRunner``); ``plain_run``: whether it
      is ``CompiledRunner``'s own (``Strategy.run`` may then call ``run_steady(fn, donate,
      args)``, a function's steady-state jit, itself); ``call_options``: the thread's options
      of the current ``run`` (``.donate``).
    * ``prepare_leaf(leaf, kind)``: an argument placed as the compiled step takes it
      (``kind``: ``"pr"`` for a ``PerReplica``, else ``"arr"``).
    * ``reduce_leaf(op, value, axis)`` (overridable): ``Strategy.reduce`` of one leaf;
      ``gather_fn(axis)``: the compiled concatenation of a stacked per-replica array;
      ``is_mirrored(x)``: whether ``x`` is state placed on every replica (``CrossReplicaReducer``).
    """

    #: TF's name: the cluster resolver of a strategy with a cluster (``Strategy.cluster_resolver``).
    _cluster_resolver: Any = None

    def __init__(
        self,
        strategy: Strategy,
        devices: Sequence[Any],
        cross_device_ops: CrossDeviceOps | None = None,
        max_steps_in_flight: int = 2,
    ):
        self._container_strategy = strategy
        self._devices = tuple(devices)
        # Default: one psum per value and let XLA's all-reduce combiner batch them; explicit
        # packing (TF's num_packs=1) costs a concatenate + split that XLA CPU pays dearly for.
        self._cross_device_ops = cross_device_ops or NcclAllReduce(num_packs=0)
        if not isinstance(self._cross_device_ops, CrossDeviceOps):
            raise TypeError(
                f"cross_device_ops must be a jaxdist.CrossDeviceOps (NcclAllReduce, "
                f"HierarchicalCopyAllReduce, ReductionToOneDevice), got {cross_device_ops!r}"
            )
        self._cross_device_ops.bind(self._devices)
        shape, axes = self._cross_device_ops.mesh_layout(len(self._devices))
        self._axes: tuple[str, ...] = tuple(axes)
        self._mesh = jax.make_mesh(
            shape,
            self._axes,
            axis_types=(AxisType.Auto,) * len(axes),
            devices=list(self._devices),
        )
        self._mesh_devices = frozenset(self._devices)
        self._replicated = NamedSharding(self._mesh, P())
        self._data_sharding = NamedSharding(self._mesh, P(self._axes))
        self._throttle = self._make_throttle(max_steps_in_flight)
        self._reduce_cache: dict = {}
        self._colocation: list[Any] = []
        self._init_run_caches()

    # ------------------------------------------------------------------ placement
    @property
    def container_strategy(self) -> Strategy:
        """The ``Strategy`` this belongs to (TF's private ``_container_strategy()``)."""
        return self._container_strategy

    @property
    def cross_device_ops(self) -> CrossDeviceOps:
        """How the replicas reduce (the ``cross_device_ops`` the strategy was made with)."""
        return self._cross_device_ops

    @property
    def worker_devices(self) -> tuple[Any, ...]:
        """The compute devices, in replica order."""
        return self._devices

    @property
    def parameter_devices(self) -> tuple[Any, ...]:
        """Where state lives (all compute devices for mirrored strategies)."""
        return self._devices

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The replica mesh ``run`` maps over."""
        return self._mesh

    @property
    def replica_axis_names(self) -> tuple[str, ...]:
        """Mesh axis names the replicas span (use them for direct ``jax.lax`` collectives)."""
        return self._axes

    @property
    def state_sharding(self) -> jax.sharding.Sharding:
        """The sharding state created under ``scope()`` gets."""
        return self._replicated

    @property
    def num_replicas_in_mesh(self) -> int:
        """The replicas of ``mesh`` (all processes of a multi-worker mesh; a parameter-server
        worker's own devices, where ``Strategy.num_replicas_in_sync`` may name the workers')."""
        return self._num_replicas

    @property
    def per_replica_sharding(self) -> jax.sharding.Sharding:
        """The sharding of a stacked per-replica array: leading axis split over the replicas.

        Distributed datasets place their batches with it (``jaxdist._src.input``).
        """
        return self._data_sharding

    @property
    def replicated_sharding(self) -> jax.sharding.Sharding:
        """One full copy on every replica's device (a one-replica dataset's batches)."""
        return self._replicated

    @property
    def experimental_max_steps_in_flight(self) -> int:
        return self._throttle.max_in_flight

    @experimental_max_steps_in_flight.setter
    def experimental_max_steps_in_flight(self, value: int) -> None:
        self._throttle.wait_all()
        self._throttle = self._make_throttle(value)

    def _make_throttle(self, max_in_flight: int) -> StepThrottle:
        """The bound on steps in flight (multi-process strategies also watch their peers)."""
        return StepThrottle(max_in_flight)

    def placement_mesh(self) -> jax.sharding.Mesh:
        """The mesh ``scope()`` places new arrays on (``None``: it places none)."""
        return self._mesh

    def _scope_context(self) -> Any:
        """The JAX context ``scope()`` enters so new arrays are placed as state (or ``None``)."""
        mesh = self.placement_mesh()
        return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)

    def _state_needs_move(self, x: Any) -> bool:
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            return False
        sh = x.sharding
        return sh != self.state_sharding and not (
            sh.device_set == self.state_sharding.device_set and sh.is_fully_replicated
        )

    def place(self, tree: Any) -> Any:
        """Places every array leaf of ``tree`` as this strategy keeps state."""

        def put(x):
            if isinstance(x, PerReplica) or not is_dynamic(x):
                return x
            if isinstance(x, jax.Array) and not self._state_needs_move(x):
                return x
            return jax.device_put(x, self.state_sharding)

        return jax.tree.map(put, tree, is_leaf=is_per_replica)

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """State created in this context is placed with ``colocate_with_variable``.

        Mirrored strategies keep every variable on every replica, so this only records the
        request (the parameter-server strategy uses it to keep variables on one ps task).
        """
        self._colocation.append(colocate_with_variable)
        try:
            yield
        finally:
            self._colocation.pop()

    # ------------------------------------------------------------------ run
    @property
    def _num_replicas(self) -> int:
        return len(self._devices)

    def call_for_each_replica(self, fn: Callable, args=(), kwargs=None) -> Any:
        """compat.v1 name for ``Strategy.run``.

        Example:
            >>> import jax, jaxdist
            >>> import jax.numpy as jnp
            >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
            >>> strategy.extended.call_for_each_replica(lambda: jnp.ones(()))  # same everywhere
            Array(1., dtype=float32)
        """
        return self._container_strategy.run(fn, args, kwargs)

    # ------------------------------------------------------------------ contexts and updates
    def _check_not_mixing(self) -> None:
        """Raises TF's mixing error when called inside another (non-default) strategy's scope."""
        strategy = self._container_strategy
        if ctx_lib.has_strategy() and ctx_lib.current_strategy() is not strategy:
            raise ctx_lib.mixing_error(ctx_lib.current_strategy(), strategy)

    def update(self, var: Any, fn: Callable, args=(), kwargs=None, group: bool = True) -> Any:
        """Returns ``fn(var, *args, **kwargs)`` computed where ``var`` lives (functional update).

        ``var`` and the result are pytrees placed as the strategy keeps state; inputs that are
        ``PerReplica`` are not allowed (reduce them first).
        """
        del group
        leaves = jax.tree.leaves((args, kwargs or {}), is_leaf=is_per_replica)
        if any(isinstance(x, PerReplica) for x in leaves):
            raise ValueError(
                "extended.update got a PerReplica argument: reduce it first "
                "(strategy.extended.reduce_to) so the update is the same on every copy"
            )
        self._check_not_mixing()
        var = self.place(var)
        args, kwargs = self.place((tuple(args), dict(kwargs or {})))
        with self._container_strategy.scope():
            return _jit_update(fn)(var, *args, **kwargs)

    def update_non_slot(
        self, colocate_with: Any, fn: Callable, args=(), kwargs=None, group: bool = True
    ) -> Any:
        """Runs ``fn(*args, **kwargs)`` once, in the cross-replica context (TF's update_non_slot).

        For state that is not a slot of one variable (a step counter, a loss scale):
        ``colocate_with`` names the state it lives with; the result's arrays are placed as the
        strategy keeps state.

        Raises:
            RuntimeError: called inside another strategy's scope or in a replica context.

        Example:
            >>> import jax, jaxdist
            >>> import jax.numpy as jnp
            >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
            >>> step = jnp.zeros((), jnp.int32)
            >>> step = strategy.extended.update_non_slot(step, lambda: step + 1)
            >>> int(step)
            1
        """
        del colocate_with, group
        ctx_lib.require_cross_replica_or_default_context(self._container_strategy)
        with self._container_strategy.scope():
            result = fn(*args, **(kwargs or {}))
        return self.place(result)

    def value_container(self, value: Any) -> Any:
        return value

    def experimental_make_numpy_dataset(self, numpy_input: Any):
        """A ``jaxdist.Dataset`` of the slices of ``numpy_input``.

        Example:
            >>> import jax, jaxdist
            >>> import numpy as np
            >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
            >>> ds = strategy.extended.experimental_make_numpy_dataset(np.ones([10]))
        """
        ctx_lib.require_cross_replica_or_default_context(self._container_strategy)
        from jaxdist._src.input.dataset import Dataset

        return Dataset.from_tensor_slices(numpy_input)

    def non_slot_devices(self, var_list: Any) -> tuple[Any, ...]:
        return self.parameter_devices


_UPDATE_CACHE: dict = {}


def _jit_update(fn: Callable) -> Callable:
    key = function_key(fn)  # an update function made anew with the same captures: one jit
    try:
        return _UPDATE_CACHE[key]
    except (KeyError, TypeError):
        pass
    jitted = jax.jit(fn)
    try:
        _UPDATE_CACHE[key] = jitted
        while len(_UPDATE_CACHE) > RUN_CACHE_SIZE:
            _UPDATE_CACHE.pop(next(iter(_UPDATE_CACHE)))
    except TypeError:
        pass
    return jitted


class Strategy:
    """The API shared by every distribution strategy (``tf.distribute.Strategy``).

    Example:
        >>> import jax, jaxdist
        >>> import jax.numpy as jnp
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])  # doctest: +NEEDS_2_DEVICES
        >>> with strategy.scope():
        ...     params = {"w": jnp.zeros((3,))}          # replicated on every device
        >>> dist_x = strategy.experimental_distribute_values_from_function(
        ...     lambda ctx: jnp.full((3,), ctx.replica_id_in_sync_group + 1.0))
        >>> def step(params, x):
        ...     return jaxdist.get_replica_context().all_reduce("SUM", (params["w"] + x).sum())
        >>> total = strategy.run(step, args=(params, dist_x))
        >>> strategy.experimental_local_results(total)   # 3*1 + 3*2 on both replicas
        (Array(9., dtype=float32), Array(9., dtype=float32))
    """

    #: True only for the default strategy (in effect outside every scope).
    _is_default_strategy: bool = False
    #: Whether ``ReplicaContext.merge_call`` refuses to run inside ``jax.lax`` control flow
    #: (TF's mirrored replica threads refuse it; strategies whose replica context runs a merge
    #: function in place set it False).
    merge_call_checks_control_flow: bool = True
    #: The Keras distribution made for this strategy (``jaxdist._src.keras.api`` sets it on the
    #: first ``scope()`` once Keras is imported). An attribute rather than a registry keyed by
    #: the strategy: the distribution refers to its strategy, and would keep it alive there.
    keras_distribution: Any = None

    def __init__(self, extended: StrategyExtended):
        self._extended = extended

    @property
    def extended(self) -> StrategyExtended:
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas that run each step in lock-step."""
        return self._extended._num_replicas

    @property
    def cluster_resolver(self) -> Any:
        """The cluster resolver (``None`` for single-host strategies).

        As in TF, it is ``extended._cluster_resolver`` when a strategy sets one.
        """
        return self._extended._cluster_resolver

    def scope(self) -> ctx_lib.StrategyScope:
        """Makes this the current strategy; arrays created inside are placed as it keeps state.

        The returned object may be entered again (also while it is entered), as in TF.

        Raises:
            RuntimeError: another strategy's scope is already entered ("Mixing different
                tf.distribute.Strategy objects"), or this is called inside this strategy's
                replica function.

        Example:
            >>> import jax, jaxdist
            >>> import jax.numpy as jnp
            >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
            >>> with strategy.scope():
            ...     params = {"w": jnp.zeros((3,))}   # replicated on every device
        """
        return ctx_lib.StrategyScope(self, self._scope_contexts)

    def _scope_contexts(self) -> Any:
        """What entering ``scope()`` enters: the placement context, then the scope hooks'.

        The Keras hook (registered by ``jaxdist/__init__.py``): once ``keras`` has been
        imported (and only then: it never imports it), Keras models built and fit inside the
        scope are distributed as this strategy (see ``jaxdist.keras``).
        """
        entered = self._extended._scope_context()
        for hook in SCOPE_HOOKS:
            extra = hook(self)
            if extra is not None:
                entered = _Entered(entered, extra)
        return entered

    def run(self, fn: Callable, args=(), kwargs=None, options: Any = None) -> Any:
        """Runs ``fn`` once per replica and returns its (per-replica or replicated) outputs.

        Args:
            fn: a function of arrays; inside it ``jaxdist.get_replica_context()`` gives the
                replica's context.
            args: positional arguments; ``PerReplica`` leaves are split, one entry per replica,
                other arrays are passed whole to every replica.
            kwargs: keyword arguments, treated like ``args``.
            options: ``jaxdist.RunOptions``; ``donate_argnums`` lets the step write its new
                state into the buffers of the state it replaces (the donated arrays are
                deleted by the call).

        Returns:
            ``fn``'s outputs: a leaf identical on every replica is one replicated array, a leaf
            that varies is a ``PerReplica``.

        Example:
            >>> import jax, jaxdist
            >>> import jax.numpy as jnp
            >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
            >>> def train_step(params, batch):
            ...     loss = jnp.mean((params * batch) ** 2)
            ...     return params - 0.1 * batch, loss
            >>> params = jnp.ones(4)
            >>> batch = strategy.experimental_distribute_values_from_function(
            ...     lambda ctx: jnp.ones(4))
            >>> params, loss = strategy.run(
            ...     train_step, args=(params, batch),
            ...     options=jaxdist.RunOptions(donate_argnums=(0,)))
        """
        donate: tuple[int, ...] = ()
        if options is not None:
            if not isinstance(options, RunOptions):
                raise TypeError(f"options must be jaxdist.RunOptions, got {options!r}")
            donate = options.donate_argnums
        ext = self._extended
        steady = ext.plain_run and not kwargs and type(args) is tuple
        if steady:
            # Outside every scope, or in this strategy's scope and not in a merge_call, the
            # checks below have nothing to say: the steady-state jit first.
            stack = ctx_lib.state.stack
            if not stack or (stack[-1].strategy is self and stack[-1].merged_from is None):
                out = ext.run_steady(fn, donate, args)
                if out is not MISS:
                    return out
                steady = False  # tried: the per-leaf path below
        ext._check_not_mixing()
        merged = ctx_lib.merged_from()
        if merged is not None and merged.axis_name is not None and merged.strategy is self:
            # run inside a merge_call's merge function, inside this strategy's compiled step:
            # the trace is already per replica, so fn runs in the replica context it came from.
            with ctx_lib.enter_replica(self, merged):
                return fn(*args, **(kwargs or {}))
        try:
            if steady:
                out = ext.run_steady(fn, donate, args)
                if out is not MISS:
                    return out
            call_options = ext.call_options
            previous = getattr(call_options, "donate", ())
            call_options.donate = donate
            try:
                return ext.run_compiled(fn, args, kwargs)
            finally:
                call_options.donate = previous
        except NotImplementedError as e:
            if "Closing over inputs to shard_map" not in str(e):
                raise
            raise ValueError(
                f"The replica function {getattr(fn, '__qualname__', fn)!r} closes over an array "
                f"placed by {self!r} (created under strategy.scope() or by strategy.place), "
                f"which JAX cannot capture inside the compiled replica step. Pass that state as "
                f"an argument instead: strategy.run(fn, args=(state, ...)) (a pytree of arrays, "
                f"e.g. a flax nnx module's state, is passed whole to every replica)."
            ) from e

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Reduces a (pytree of) per-replica value(s) across replicas, and along ``axis``.

        Example:
            >>> import jax, jaxdist
            >>> import jax.numpy as jnp
            >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])  # doctest: +NEEDS_2_DEVICES
            >>> per_replica_losses = strategy.run(lambda: jnp.float32(0.5))
            >>> strategy.reduce("SUM", per_replica_losses, axis=None)
            Array(1., dtype=float32)
        """
        op = ReduceOp.from_value(reduce_op)
        ctx_lib.require_cross_replica_or_default_context(self)
        return jax.tree.map(
            lambda v: self._extended.reduce_leaf(op, v, axis), value, is_leaf=is_per_replica
        )

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates the per-replica values of ``value`` along ``axis`` (replica order)."""

        ext = self._extended

        def one(v):
            if isinstance(v, PerReplica) and v.lengths is not None:
                return gather_rows(v, axis, ext._replicated)  # the real rows, in order
            if isinstance(v, PerReplica):
                stacked = ext.prepare_leaf(v, "pr")
            elif ext.is_mirrored(v) or isinstance(v, (jax.Array, np.ndarray)):
                host = np.asarray(jax.device_get(v))
                stacked = jax.device_put(
                    np.broadcast_to(host, (ext._num_replicas, *host.shape)), ext._data_sharding
                )
            else:
                raise TypeError(f"gather expects PerReplica values or arrays, got {v!r}")
            if stacked.ndim < 2:
                raise ValueError(
                    f"gather needs per-replica values of rank >= 1 to concatenate along axis "
                    f"{axis}, got per-replica shape {tuple(stacked.shape[1:])}"
                )
            if not -(stacked.ndim - 1) <= axis < stacked.ndim - 1:
                raise ValueError(
                    f"axis {axis} is out of range for per-replica shape {tuple(stacked.shape[1:])}"
                )
            return ext.gather_fn(axis % (stacked.ndim - 1))(stacked)

        return jax.tree.map(one, value, is_leaf=is_per_replica)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The values on this process's replicas, as a tuple (one entry per replica)."""
        leaves, treedef = jax.tree.flatten(value, is_leaf=is_per_replica)
        per_leaf = []
        for leaf in leaves:
            if isinstance(leaf, PerReplica):
                per_leaf.append(leaf.values)
            elif self._extended.is_mirrored(leaf):
                by_dev = {s.device: s.data for s in leaf.addressable_shards}
                per_leaf.append(tuple(by_dev[d] for d in self._extended._devices if d in by_dev))
            else:
                per_leaf.append((leaf,))
        if not leaves:
            return (value,)
        width = max(len(p) for p in per_leaf)
        return tuple(
            treedef.unflatten([p[i] if len(p) == width else p[0] for p in per_leaf])
            for i in range(width)
        )

    def experimental_distribute_values_from_function(self, value_fn: Callable) -> Any:
        """Calls ``value_fn(ValueContext)`` for each replica; returns the values as ``PerReplica``.

        Example:
            >>> import jax, jaxdist
            >>> import jax.numpy as jnp
            >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])  # doctest: +NEEDS_2_DEVICES
            >>> v = strategy.experimental_distribute_values_from_function(
            ...     lambda ctx: jnp.array([ctx.replica_id_in_sync_group]))
            >>> strategy.experimental_local_results(v)
            (Array([0], dtype=int32), Array([1], dtype=int32))
        """
        ext = self._extended
        n = ext._num_replicas
        values = [value_fn(ValueContext(i, n)) for i in range(n)]
        return stack_per_replica(values, ext._data_sharding)

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None):
        """Splits each global batch of ``dataset`` across the replicas (rows in order).

        Args:
            dataset: any iterable of batches (numpy / jax arrays, tuples, dicts), a
                ``jaxdist.Dataset``, or a ``tf.data.Dataset`` if TensorFlow is installed.
            options: ``jaxdist.InputOptions``.
        """
        from jaxdist._src.input.distributed import DistributedDataset

        return DistributedDataset(self._extended, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None):
        """Calls ``dataset_fn(InputContext)`` per input pipeline; each element feeds one replica."""
        from jaxdist._src.input.distributed import DistributedDatasetsFromFunction

        return DistributedDatasetsFromFunction(self._extended, dataset_fn, options)

    def experimental_distribute_datasets_from_function(
        self, dataset_fn: Callable, options: Any = None
    ):
        """Deprecated TF alias of ``distribute_datasets_from_function``.

        Example:
            >>> import jax, jaxdist
            >>> import numpy as np
            >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
            >>> def dataset_fn(ctx):
            ...     return jaxdist.Dataset.from_tensor_slices(np.arange(8.0)).batch(
            ...         ctx.get_per_replica_batch_size(4))
            >>> dist = strategy.experimental_distribute_datasets_from_function(dataset_fn)
        """
        warnings.warn(
            "experimental_distribute_datasets_from_function is deprecated (as in TF): use "
            "distribute_datasets_from_function",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.distribute_datasets_from_function(dataset_fn, options)

    def experimental_make_numpy_dataset(self, numpy_input: Any):
        """A ``jaxdist.Dataset`` of the slices of ``numpy_input`` (batch it yourself).

        Example:
            >>> import jax, jaxdist
            >>> import numpy as np
            >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
            >>> ds = strategy.experimental_make_numpy_dataset(np.ones([10], np.float32))
        """
        ctx_lib.require_cross_replica_or_default_context(self)
        return self._extended.experimental_make_numpy_dataset(numpy_input)

    def place(self, tree: Any) -> Any:
        """Places state made outside ``scope()`` as this strategy keeps state (one call)."""
        return self._extended.place(tree)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync})"


def trace_state_clean() -> bool:
    return jax_internals.trace_state_clean()


def stack_per_replica(values: Sequence[Any], sharding: NamedSharding) -> Any:
    """Builds a pytree of ``PerReplica`` from one pytree per replica, each on its device."""
    n = len(values)
    leaves_per = [jax.tree.leaves(v) for v in values]
    treedef = jax.tree.structure(values[0])
    if not trace_state_clean() or any(
        isinstance(x, jax.core.Tracer) for leaves in leaves_per for x in leaves
    ):
        # Inside a user's jax.jit (TF: inside tf.function): stack and constrain the sharding.
        return treedef.unflatten([
            PerReplica(jax.lax.with_sharding_constraint(
                jnp.stack([jnp.asarray(leaves_per[i][j]) for i in range(n)]), sharding))
            for j in range(treedef.num_leaves)
        ])
    out = []
    for j in range(treedef.num_leaves):
        parts = [np.asarray(jax.device_get(leaves_per[i][j])) for i in range(n)]
        stacked_shape = (n, *parts[0].shape)
        for i, p in enumerate(parts):
            if p.shape != parts[0].shape:
                raise ValueError(
                    f"per-replica values must have the same shape: replica 0 has "
                    f"{parts[0].shape}, replica {i} has {p.shape}"
                )
        idx_map = sharding.addressable_devices_indices_map(stacked_shape)
        arrays = []
        for dev, idx in idx_map.items():
            arrays.append(jax.device_put(np.stack(parts)[idx], dev))
        out.append(
            PerReplica(jax.make_array_from_single_device_arrays(stacked_shape, sharding, arrays))
        )
    return treedef.unflatten(out)


__all__ = ["Strategy", "StrategyExtended", "ValueContext", "local_components"]



class _Entered:
    """Two context managers entered in order and exited in reverse (for ``Strategy.scope``)."""

    def __init__(self, first: Any, second: Any):
        self._first, self._second = first, second

    def __enter__(self) -> None:
        self._first.__enter__()
        try:
            self._second.__enter__()
        except BaseException:
            self._first.__exit__(*sys.exc_info())
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self._second.__exit__(exc_type, exc, tb)
        finally:
            self._first.__exit__(exc_type, exc, tb)
