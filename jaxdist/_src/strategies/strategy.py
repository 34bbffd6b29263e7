"""``Strategy`` and ``StrategyExtended``: the API every strategy shares, and the ``run`` engine.

A strategy owns a mesh of replicas. ``run(fn, args)`` compiles ``jit(shard_map(fn))`` over that
mesh: ``PerReplica`` inputs are split one entry per replica, everything else is passed whole,
outputs that are identical on every replica (JAX's shard_map types say which) come back as one
replicated array, and outputs that vary come back as ``PerReplica``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import threading
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
from jaxdist._src.strategies import nnx_state
from jaxdist._src.strategies.context import SCOPE_HOOKS
from jaxdist._src.strategies.cross_device_ops import (
    CrossDeviceOps,
    NcclAllReduce,
    all_gather_invariant,
    destination_sharding,
    outside_context_mesh,
    varying_axes,
)
from jaxdist._src.strategies.fn_key import function_key
from jaxdist._src.strategies.inflight import StepThrottle
from jaxdist._src.strategies.partial_rows import (
    batch_dependent_outputs,
    gather_rows,
    padding_warning,
    per_row_lengths,
    reduce_rows,
    wrap_outputs,
)
from jaxdist._src.strategies.reduce_util import ReduceOp
from jaxdist._src.strategies.replica_context import ReplicaContext
from jaxdist._src.strategies.run_options import RunOptions
from jaxdist._src.values.per_replica import PerReplica, is_per_replica, local_components

_SCALAR_TYPES = (int, float, bool, complex)
_Tracer = jax.core.Tracer
# Concrete (not traced) jax.Array classes seen among step outputs: a type test is cheaper than
# isinstance against jax.Array's ABC, and needs no import of JAX's private array module.
_ARRAY_TYPES: set[type] = set()
_MISS = object()  # a _tree_call that cannot serve a call


def _last_leaf(out: Any) -> Any:
    """The last array of a step's outputs, found without flattening them (``None`` if the
    outputs are not nested tuples, lists, dicts and arrays): ``return params, loss`` gives the
    loss. The step throttle waits on it."""
    if type(out) is tuple and out and type(out[-1]) in _ARRAY_TYPES:
        return out[-1]  # the usual ``return state, loss``
    x = out
    for _ in range(8):
        t = type(x)
        if t is tuple or t is list:
            if not x:
                return None
            x = x[-1]
        elif t is dict:
            if not x:
                return None
            x = x[next(reversed(x))]
        elif t is PerReplica:
            x = x.stacked
        else:
            break
    if type(x) in _ARRAY_TYPES:
        return x
    if isinstance(x, jax.Array):
        if not isinstance(x, _Tracer):
            _ARRAY_TYPES.add(type(x))
        return x
    return None


class _FastMiss(Exception):
    """Raised while a ``_tree_call`` traces a signature that only ``_run_flat`` handles."""

_RUN_CACHE_SIZE = 128
_RETRACE_WARNING_AFTER = 8


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


def _is_dynamic(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, *_SCALAR_TYPES)) or hasattr(
        x, "__jax_array__"
    )


class StrategyExtended:
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
    """

    #: Whether ``_run`` is this class's (``Strategy.run`` may then call a function's
    #: steady-state jit itself); a subclass whose ``_run`` adds work per call sets it False.
    _plain_run = True
    #: Whether this class overrides ``_post_run`` (set for subclasses by ``__init_subclass__``).
    _posts = False

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
        self._run_cache: collections.OrderedDict = collections.OrderedDict()
        self._reduce_cache: dict = {}
        self._cache_lock = threading.Lock()
        self._colocation: list[Any] = []
        self._call_options = threading.local()  # RunOptions.donate_argnums of the current run
        self._donate_masks: dict[Any, tuple[int, ...]] = {}
        self._new_fn_counts: dict[Any, int] = {}
        self._fast: dict[Any, _FastEntry] = {}  # (fn, args treedef, donation) -> checked call
        # (fn, donation) -> one jax.jit over run's whole argument tuple (``_tree_call``), or
        # False once such a call missed (the flatten-and-match path serves that pair then).
        self._tree_calls: dict[Any, Any] = {}
        # (function_key(fn), donation) -> that call, shared by the function objects of one key
        # (a step_fn defined anew inside each train_step call: compiled once).
        self._shared_calls: dict[Any, Any] = {}
        self._padding_warned: set = set()  # functions warned about reducing padding rows

    # ------------------------------------------------------------------ placement
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

    def _placement_mesh(self) -> jax.sharding.Mesh:
        return self._mesh

    def _scope_context(self) -> Any:
        """The JAX context ``scope()`` enters so new arrays are placed as state (or ``None``)."""
        mesh = self._placement_mesh()
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
            if isinstance(x, PerReplica) or not _is_dynamic(x):
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

    def _prepare_leaf(self, leaf: Any, kind: str) -> Any:
        if kind == "pr":
            x = leaf.stacked
            if isinstance(x, jax.core.Tracer):
                return x
            if not isinstance(x, jax.Array) or x.sharding != self._data_sharding:
                x = jax.device_put(x, self._data_sharding)
            return x
        if isinstance(leaf, (jax.core.Tracer, *_SCALAR_TYPES)):
            return leaf
        if isinstance(leaf, np.generic) and leaf.dtype.kind in "biufc" and self._one_process:
            # A numpy scalar: the compiled call takes it as it is (far cheaper than a
            # device_put). Across processes it is placed below, as before: that placement
            # checks it against the peers (a collective, whose failure names a lost peer).
            return leaf
        if isinstance(leaf, jax.Array):
            sh = leaf.sharding
            if sh == self._replicated or (
                sh.device_set == self._mesh_devices and sh.is_fully_replicated
            ):
                return leaf
        return jax.device_put(leaf, self._replicated)

    @functools.cached_property
    def _one_process(self) -> bool:
        """Whether this strategy's devices all belong to this process."""
        return bool(self._replicated.is_fully_addressable)

    def _run(self, fn: Callable, args=(), kwargs=None) -> Any:
        if not kwargs and type(args) is tuple:
            donate = getattr(self._call_options, "donate", ())
            out = self._run_steady(fn, donate, args)
            if out is not _MISS:
                return out
            # Otherwise one flatten, a check per leaf and the compiled call (``_FastEntry``).
            leaves, treedef = jax.tree.flatten(args)
            try:
                entry = self._fast.get((fn, treedef, donate))
            except TypeError:  # an unhashable function
                entry = None
            if entry is not None:
                dyn = entry.match(leaves)
                if dyn is not None:
                    return self._dispatch(entry.compiled, dyn)
        if not callable(fn):
            raise TypeError(f"strategy.run expects a callable, got {fn!r}")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"args must be a tuple or list, got {type(args).__name__}: {args!r}")
        kwargs = dict(kwargs or {})
        if nnx_state.nnx_module() is not None:
            split = nnx_state.split_args(fn, args, kwargs, is_per_replica)
            if split is not None:
                return self._run_nnx(*split)
        for hook in _RUN_STATE_HOOKS:
            carried = hook(fn, args, kwargs)
            if carried is not None:
                step, step_args, write_back = carried
                out, new_state = self._run_flat(step, step_args, {})
                write_back(new_state)
                return out
        return self._run_flat(fn, args, kwargs, remember=True)

    def _run_nnx(self, step: Callable, step_args: tuple, nodes: tuple) -> Any:
        """``run`` of a step whose arguments hold flax NNX objects (``nnx_state``)."""
        options = self._call_options
        donate = getattr(options, "donate", ())
        # Donation names the user's positions; the NNX objects' state is what such a step
        # replaces, so a donating call donates that state (argument 0 of the split step).
        options.donate = (0,) if donate else ()
        try:
            out, new_state = self._run_flat(step, step_args, {})
        finally:
            options.donate = donate
        nnx_state.update(nodes, new_state)
        return out

    def _run_flat(self, fn: Callable, args, kwargs, remember: bool = False) -> Any:
        leaves, treedef = jax.tree.flatten((tuple(args), kwargs), is_leaf=is_per_replica)
        kinds, statics, dyn, partial, tracing = self._classify(leaves)
        donate = getattr(self._call_options, "donate", ())
        if donate:
            donate = self._donated_dyn_indices(treedef, tuple(kinds), donate, len(args))
        key = (function_key(fn), treedef, tuple(kinds), tuple(statics), partial, donate)
        compiled = self._lookup(key, fn, treedef, kinds, statics, partial, donate)
        dyn = [self._prepare_leaf(x, "pr" if isinstance(x, PerReplica) else "arr") for x in dyn]
        if tracing:
            return compiled.raw(*dyn)
        if remember and not kwargs and "empty" not in kinds and type(args) is tuple:
            call = self._remember(fn, args, compiled, kinds, statics, dyn)
            if call:
                out = self._dispatch_tree(fn, getattr(self._call_options, "donate", ()), call,
                                          args)
                if out is not _MISS:
                    return out
        return self._dispatch(compiled, dyn)

    def _classify(self, leaves: list[Any]):
        """Sorts ``run``'s flat argument leaves: ``(kinds, statics, dyn, partial, tracing)``.

        ``kinds`` has one entry per leaf: ``"pr"`` (a ``PerReplica``), ``"arr"`` (an array or
        number, passed whole), ``"empty"`` (an array of size 0, rebuilt inside) or
        ``"static"`` (a hashable constant); ``dyn`` holds the ``pr`` and ``arr`` leaves.
        """
        n = self._num_replicas
        kinds: list[str] = []
        statics: list[Any] = []
        dyn: list[Any] = []
        partial = None  # (lengths, padded rows) of the first partial-batch PerReplica
        tracing = False
        for leaf in leaves:
            if isinstance(leaf, PerReplica):
                if leaf.stacked.shape[0] != n:
                    raise ValueError(
                        f"PerReplica value has {leaf.stacked.shape[0]} replicas, but "
                        f"{self._container_strategy!r} has {n}"
                    )
                if leaf.lengths is not None and partial is None:
                    partial = (leaf.lengths, int(leaf.stacked.shape[1]))
                kinds.append("pr")
                tracing |= isinstance(leaf.stacked, jax.core.Tracer)
                dyn.append(leaf)
            elif _is_dynamic(leaf):
                shape = getattr(leaf, "shape", None)
                if shape is not None and 0 in tuple(shape):
                    # An empty array carries no data: rebuilt inside (XLA rejects size-0
                    # operands of a shard_map body).
                    kinds.append("empty")
                    statics.append((tuple(shape), np.dtype(leaf.dtype)))
                else:
                    kinds.append("arr")
                    tracing |= isinstance(leaf, jax.core.Tracer)
                    dyn.append(leaf)
            else:
                try:
                    hash(leaf)
                except TypeError:
                    raise TypeError(
                        f"strategy.run argument leaf {leaf!r} of type {type(leaf).__name__} is "
                        f"neither an array nor hashable; pass arrays, numbers or hashable "
                        f"constants"
                    ) from None
                kinds.append("static")
                statics.append(leaf)
        return kinds, statics, dyn, partial, tracing

    def _remember(self, fn, args: tuple, compiled, kinds, statics, dyn) -> None:
        """Records a checked call's signature for ``_run``'s fast path (``_FastEntry``)."""
        leaves, treedef = jax.tree.flatten(args)
        if len(leaves) != len(kinds):  # e.g. a PerReplica holding no array
            return
        entry = _FastEntry.build(compiled, kinds, statics, leaves, dyn, self._num_replicas)
        if entry is None:
            return None
        donate = getattr(self._call_options, "donate", ())
        try:
            self._fast[(fn, treedef, donate)] = entry
        except TypeError:
            return None
        while len(self._fast) > _RUN_CACHE_SIZE:
            self._fast.pop(next(iter(self._fast)))
        if statics or not self._one_process:
            return None
        call = self._tree_calls.get((fn, donate))
        if call is None:
            fkey = function_key(fn)
            call = self._shared_calls.get((fkey, donate)) if fkey is not fn else None
            if call is None:
                call = self._tree_call(fn, donate)
                if fkey is not fn:
                    self._shared_calls[(fkey, donate)] = call
                    while len(self._shared_calls) > _RUN_CACHE_SIZE:
                        self._shared_calls.pop(next(iter(self._shared_calls)))
            self._tree_calls[(fn, donate)] = call
            while len(self._tree_calls) > _RUN_CACHE_SIZE:
                self._tree_calls.pop(next(iter(self._tree_calls)))
        return call

    def _compiled_versions(self, fn: Callable) -> int:
        """How many executables ``run`` holds for ``fn`` (one per argument signature): what
        tests count to check that a call compiled nothing new."""
        fkey = function_key(fn)
        count = sum(c.jitted._cache_size() for c in self._run_cache.values()
                    if function_key(c.fn) == fkey)
        calls = {id(call): call for (f, _), call in self._tree_calls.items()
                 if call and function_key(f) == fkey}
        return count + sum(call._cache_size() for call in calls.values())

    def _tree_call(self, fn: Callable, donate: tuple[int, ...]) -> Callable:
        """One ``jax.jit`` over ``run``'s whole argument tuple, for one process's devices.

        Its C++ dispatch does what the checks of ``_run_flat`` do, for arguments of any
        structure, shapes and placement it has seen: a new signature traces ``_tree_body``,
        which classifies the leaves as ``_run_flat`` does and raises ``_FastMiss`` for what
        only ``_run_flat`` handles (constants, empty arrays, flax NNX objects, Keras state).
        """

        def tree_body(*args):
            leaves, treedef = jax.tree.flatten(((tuple(args), {})), is_leaf=is_per_replica)
            kinds, statics, dyn, partial, _ = self._classify(leaves)
            if statics:  # a constant or empty array (jit refuses the former anyway)
                raise _FastMiss
            if nnx_state.nnx_module() is not None and nnx_state.split_args(
                    fn, args, {}, is_per_replica) is not None:
                raise _FastMiss
            if any(hook(fn, args, {}) is not None for hook in _RUN_STATE_HOOKS):
                raise _FastMiss
            mask = self._donated_dyn_indices(treedef, tuple(kinds), donate, len(args))
            key = (function_key(fn), treedef, tuple(kinds), (), partial, mask)
            compiled = self._lookup(key, fn, treedef, kinds, [], partial, mask)
            return compiled.raw(*dyn)

        return jax.jit(tree_body, donate_argnums=donate)

    def _run_steady(self, fn: Callable, donate: tuple[int, ...], args: tuple) -> Any:
        """The steady state in one process: ``fn``'s jit over the whole argument tuple, whose
        C++ dispatch checks structure, shapes and placement (``_tree_call``); ``_MISS`` when
        there is none or it cannot serve ``args``."""
        try:
            call = self._tree_calls.get((fn, donate))
        except TypeError:  # an unhashable function
            return _MISS
        if not call:
            return _MISS
        return self._dispatch_tree(fn, donate, call, args)

    def _dispatch_tree(self, fn: Callable, donate: tuple[int, ...], call: Callable,
                       args: tuple) -> Any:
        """Calls a ``_tree_call``, bounding the steps in flight; ``_MISS`` when it cannot.

        A miss (``_FastMiss`` at a new signature's trace, or jit refusing an argument: a
        non-array leaf, an array on other devices) happens before anything runs; the pair
        then goes the flatten-and-match way, whose checks name what is wrong.
        """
        self._throttle.before_dispatch()
        try:
            out = call(*args)
        except (_FastMiss, TypeError, ValueError):
            self._tree_calls[(fn, donate)] = False
            fkey = function_key(fn)
            if fkey is not fn and (fkey, donate) in self._shared_calls:
                self._shared_calls[(fkey, donate)] = False
            return _MISS
        marker = _last_leaf(out)
        if marker is None:
            leaves = jax.tree.leaves(out)
            if leaves and isinstance(leaves[0], _Tracer):
                return out  # under a user's jax.jit: nothing to throttle
        elif type(marker) not in _ARRAY_TYPES:
            return out  # a tracer (``_last_leaf`` records concrete array types only)
        if self._posts:
            posted = self._post_run(out)
            if posted is not out:
                self._throttle.after_dispatch(posted)
                return posted
        self._throttle.after_dispatch(out, marker)
        return out

    def _dispatch(self, compiled, dyn: list[Any]) -> Any:
        """Calls a compiled step, bounding the steps in flight."""
        self._throttle.before_dispatch()
        out = compiled.jitted(*dyn)
        leaves = jax.tree.leaves(out)
        if leaves and isinstance(leaves[0], jax.core.Tracer):
            return out  # under a user's jax.jit with no traced argument: nothing to throttle
        posted = self._post_run(out)
        # The throttle waits on the step's array outputs (the flat list: no second flatten).
        self._throttle.after_dispatch(leaves if posted is out else posted)
        return posted

    def _post_run(self, out: Any) -> Any:
        """What ``run`` returns for a step's outputs (a subclass may move them)."""
        return out

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._posts = cls._post_run is not StrategyExtended._post_run

    def _donated_dyn_indices(self, treedef, kinds: tuple[str, ...], argnums: tuple[int, ...],
                             num_args: int) -> tuple[int, ...]:
        """Positions among the compiled step's array arguments of the donated ``args``."""
        key = (treedef, kinds, argnums)
        mask = self._donate_masks.get(key)
        if mask is not None:
            return mask
        bad = [i for i in argnums if i >= num_args]
        if bad:
            raise ValueError(
                f"RunOptions.donate_argnums={argnums} names positions {bad}, but run got "
                f"{num_args} positional argument(s)"
            )
        arg_leaves = [t.num_leaves for t in treedef.children()[0].children()]
        donated_leaf = []
        for i, n in enumerate(arg_leaves):
            donated_leaf += [i in argnums] * n
        donated_leaf += [False] * (len(kinds) - len(donated_leaf))  # kwargs
        mask, j = [], 0
        for k, d in zip(kinds, donated_leaf):
            if k in ("static", "empty"):
                continue
            if d:
                mask.append(j)
            j += 1
        self._donate_masks[key] = mask = tuple(mask)
        return mask

    def _note_new_function(self, fn: Callable) -> None:
        """Warns once when the same code keeps arriving as new function objects (retracing)."""
        code = getattr(fn, "__code__", None)
        if code is None:
            return
        count = self._new_fn_counts.get(code, 0) + 1
        self._new_fn_counts[code] = count
        if count == _RETRACE_WARNING_AFTER:
            warnings.warn(
                f"strategy.run compiled {count} different function objects for "
                f"{getattr(fn, '__qualname__', fn)!r} ({code.co_filename}:{code.co_firstlineno}): "
                f"a function defined anew for each call shares a compiled step only when it "
                f"captures the same objects (or equal numbers and strings); this one captures "
                f"other values each time (e.g. an array or a new object in its closure or "
                f"defaults), which are compiled into the step. Pass those values as arguments "
                f"of strategy.run, or define the step function once and reuse it.",
                stacklevel=4,
            )

    def _lookup(self, key, fn, treedef, kinds, statics, partial=None, donate=()):
        try:
            hash(key)
        except TypeError:
            key = None
        with self._cache_lock:
            if key is not None and key in self._run_cache:
                self._run_cache.move_to_end(key)
                return self._run_cache[key]
        cls = _GlobalRun if getattr(fn, "_jaxdist_global_view", False) else _CompiledRun
        compiled = cls(self, fn, treedef, kinds, statics, partial, donate)
        self._note_new_function(fn)
        if key is not None:
            with self._cache_lock:
                self._run_cache[key] = compiled
                while len(self._run_cache) > _RUN_CACHE_SIZE:
                    self._run_cache.popitem(last=False)
        return compiled

    # ------------------------------------------------------------------ reductions
    def _is_mirrored(self, x: Any) -> bool:
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

    def _gather_fn(self, axis: int):
        key = ("gather", axis)
        if key not in self._reduce_cache:
            axes = self._axes

            def body(x):
                return all_gather_invariant(x[0], axes, axis=axis)

            self._reduce_cache[key] = jax.jit(
                jax.shard_map(body, mesh=self._mesh, in_specs=P(axes), out_specs=P())
            )
        return self._reduce_cache[key]

    def _check_not_mixing(self) -> None:
        """Raises TF's mixing error when called inside another (non-default) strategy's scope."""
        strategy = self._container_strategy
        if ctx_lib.has_strategy() and ctx_lib.current_strategy() is not strategy:
            raise ctx_lib.mixing_error(ctx_lib.current_strategy(), strategy)

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
        if target is None and getattr(self._cross_device_ops, "_outside_device", None):
            target = self._replicated  # ReductionToOneDevice accumulated outside the replicas
        out = jax.tree.map(lambda v: self._reduce_leaf(op, v, None), value, is_leaf=is_per_replica)
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

    def _reduce_leaf(self, op: ReduceOp, v: Any, axis: int | None) -> Any:
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
            stacked = self._prepare_leaf(v, "pr")
            if axis is not None and not -v.stacked.ndim + 1 <= axis < v.stacked.ndim - 1:
                raise ValueError(
                    f"axis {axis} is out of range for per-replica values of shape {v.shape}"
                )
            ax = None if axis is None else axis % (v.stacked.ndim - 1)
            outside = getattr(self._cross_device_ops, "_outside_device", None)
            if outside is not None and not isinstance(stacked, jax.core.Tracer):
                # ReductionToOneDevice naming a device outside the mesh: gather there, really.
                return self._cross_device_ops._reduce_on_device(op, stacked, ax, outside)
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
        if self._is_mirrored(v):
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


class _FastEntry:
    """A call signature ``run`` has checked once: what each flat argument leaf must be.

    ``match(leaves)`` returns the compiled step's arguments when every leaf is what it was the
    first time (an array placed as then, a Python number of the same type, an equal static
    value), else ``None`` (the full path then checks, places and compiles as usual).
    """

    __slots__ = ("compiled", "checks", "statics", "positions", "seen")

    def __init__(self, compiled, checks, statics, positions):
        self.compiled = compiled
        self.checks = checks  # per dynamic leaf: (position, type, sharding or None, replicas)
        self.statics = statics  # (position, value) of static leaves
        self.positions = positions
        # Per check, the last sharding object found equal to the recorded one: a step's outputs
        # carry the same sharding objects call after call, so identity settles most checks.
        self.seen = [c[2] for c in checks]

    @classmethod
    def build(cls, compiled, kinds, statics, leaves, dyn, num_replicas):
        checks, static_pos = [], []
        it_static, it_dyn = iter(statics), iter(dyn)
        for i, (kind, leaf) in enumerate(zip(kinds, leaves)):
            if kind == "static":
                static_pos.append((i, next(it_static)))
                continue
            placed = next(it_dyn)
            if isinstance(placed, jax.Array):
                if placed is not leaf or isinstance(placed, jax.core.Tracer):
                    return None  # this leaf was placed by the call: keep the full path
                replicas = num_replicas if kind == "pr" else None
                checks.append((i, type(leaf), leaf.sharding, replicas))
            elif isinstance(leaf, (*_SCALAR_TYPES, np.generic)):
                checks.append((i, type(leaf), None, None))
            else:
                return None
        return cls(compiled, tuple(checks), tuple(static_pos), len(leaves))

    def match(self, leaves: list[Any]) -> list[Any] | None:
        if len(leaves) != self.positions:
            return None
        for i, value in self.statics:
            if leaves[i] != value:
                return None
        dyn = []
        seen = self.seen
        for k, (i, typ, sharding, replicas) in enumerate(self.checks):
            x = leaves[i]
            if type(x) is not typ:
                return None
            if sharding is not None:
                xs = x.sharding
                if xs is not seen[k]:
                    if xs != sharding:
                        return None
                    seen[k] = xs
                if replicas is not None and x.shape[0] != replicas:
                    return None
            dyn.append(x)
        return dyn


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
        while len(_UPDATE_CACHE) > _RUN_CACHE_SIZE:
            _UPDATE_CACHE.pop(next(iter(_UPDATE_CACHE)))
    except TypeError:
        pass
    return jitted


class _CompiledRun:
    """One replica function compiled for one argument structure."""

    def __init__(
        self, extended: StrategyExtended, fn: Callable, treedef, kinds, statics, partial=None,
        donate: tuple[int, ...] = (),
    ):
        self.extended = extended
        self.partial = partial  # (per-replica lengths, padded rows) on a partial-batch step
        self.fn = fn
        self.treedef = treedef
        self.kinds = tuple(kinds)
        self.statics = tuple(statics)
        self.traces = 0
        self.row_mask_read = False  # whether the last trace of fn read the row mask
        self.jitted = jax.jit(self.raw, donate_argnums=donate)

    def _args(self, dyn: Sequence[Any]):
        it_dyn, it_static = iter(dyn), iter(self.statics)
        leaves = []
        for k in self.kinds:
            if k == "static":
                leaves.append(next(it_static))
            elif k == "empty":
                shape, dtype = next(it_static)
                leaves.append(jnp.zeros(shape, dtype))
            elif k == "pr":
                leaves.append(next(it_dyn)[0])
            else:
                leaves.append(next(it_dyn))
        return self.treedef.unflatten(leaves)

    def _call_fn(self, dyn, axes=None):
        ext = self.extended
        args, kwargs = self._args(dyn)
        rctx = ReplicaContext(ext._container_strategy, axes)
        if self.partial is not None:
            rctx._set_partial_batch(*self.partial)
        # A loop carry started from a constant and made per-replica by the body starts
        # per-replica (as under pmap): JAX's carry type check would refuse it otherwise.
        carries = (jax_internals.carries_vary_over(axes) if axes is not None
                   else contextlib.nullcontext())
        with ctx_lib.enter_replica(ext._container_strategy, rctx), carries:
            self.traces += 1
            out = self.fn(*args, **kwargs)
        self.row_mask_read = rctx._row_mask_read
        return out

    def _check_padding(self, jaxpr: Any, dyn_kinds: Sequence[str], rows: Sequence[Any]) -> None:
        """Warns once per function when a padded batch reaches outputs other than per-row ones
        and the function never read the row mask (a mean over the rows would count padding)."""
        dependent = batch_dependent_outputs(jaxpr, [k == "pr" for k in dyn_kinds])
        outputs = [i for i, (d, r) in enumerate(zip(dependent, rows)) if d and r is None]
        if not outputs:
            return
        ext = self.extended
        key = function_key(self.fn)
        try:
            if key in ext._padding_warned:
                return
            ext._padding_warned.add(key)
        except TypeError:  # an unhashable function: warned each time it is compiled
            pass
        name = getattr(self.fn, "__qualname__", None) or repr(self.fn)
        warnings.warn(padding_warning(name, self.partial, outputs), UserWarning, stacklevel=2)

    def raw(self, *dyn):
        ext = self.extended
        axes, mesh = ext._axes, ext._mesh
        dyn_kinds = [k for k in self.kinds if k not in ("static", "empty")]
        dyn = [x.stacked if isinstance(x, PerReplica) else x for x in dyn]
        if ext._num_replicas == 1:
            # One replica: no mesh program needed. Every output is trivially the same on all
            # replicas, so it comes back as a plain array (TF's regroup of one value).
            return self._call_fn(dyn)
        in_specs = tuple(P(axes) if k == "pr" else P() for k in dyn_kinds)
        record: dict[str, Any] = {}

        def probe(*xs):
            out = self._call_fn(xs, axes)
            flat, tree = jax.tree.flatten(out)
            flat = [_as_output(x) for x in flat]
            record["tree"] = tree
            record["varying"] = [bool(set(axes) & varying_axes(x)) for x in flat]
            return [x[None] for x in flat]

        probe_shapes = jax.shard_map(probe, mesh=mesh, in_specs=in_specs, out_specs=P(axes))
        if self.partial is None:
            out_avals, probe_jaxpr = jax.eval_shape(probe_shapes, *dyn), None
        else:  # the jaxpr too: which outputs the padded batch reaches (_check_padding)
            probe_jaxpr, out_avals = jax.make_jaxpr(probe_shapes, return_shape=True)(*dyn)
        mask_read = self.row_mask_read
        varying, tree = record["varying"], record["tree"]
        # A partial-batch step: which outputs are per row (partial_rows: a second abstract
        # trace with one more row tells the row axis from a size that only equals it).
        rows = per_row_lengths(
            self.partial, [a.shape for a in out_avals], dyn, dyn_kinds,
            None if self.partial is None else lambda xs: jax.eval_shape(probe_shapes, *xs),
        )
        if probe_jaxpr is not None and not mask_read:
            self._check_padding(probe_jaxpr, dyn_kinds, rows)

        def body(*xs):
            flat = [_as_output(x) for x in jax.tree.leaves(self._call_fn(xs, axes))]
            return tuple(x[None] if v else x for x, v in zip(flat, varying))

        out_specs = tuple(P(axes) if v else P() for v in varying)
        flat = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*dyn)
        return tree.unflatten(wrap_outputs(flat, varying, rows))


class _GlobalViewContext(ReplicaContext):
    """The replica context of a global-view step (an ``nnx.jit`` step): one replica that sees
    the whole global batch, so reductions across replicas are the identity."""

    def __init__(self, strategy: Strategy):
        super().__init__(strategy, None)

    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    def __repr__(self) -> str:
        return f"ReplicaContext(strategy={self._strategy!r}, global_view=True)"


class _GlobalRun(_CompiledRun):
    """A step compiled over the global batch (``nnx_state``'s global view).

    ``PerReplica`` inputs become the global batch (rows in replica order, padding dropped on a
    partial batch); the step is one jitted program whose batch stays split over the replica
    mesh (XLA partitions it). The NNX state it returns is kept replicated, as state is.
    """

    def raw(self, *dyn):
        ext = self.extended
        lengths = None if self.partial is None else tuple(self.partial[0])
        dyn = [
            nnx_state.globalize(x.stacked if isinstance(x, PerReplica) else x, lengths)[None]
            if k == "pr" else x
            for x, k in zip(dyn, [k for k in self.kinds if k not in ("static", "empty")])
        ]
        args, kwargs = self._args(dyn)
        rctx = _GlobalViewContext(ext._container_strategy)
        with ctx_lib.enter_replica(ext._container_strategy, rctx):
            self.traces += 1
            out, new_state = self.fn(*args, **kwargs)
        if ext._num_replicas > 1:
            replicated = ext._replicated
            new_state = jax.tree.map(
                lambda x: jax.lax.with_sharding_constraint(x, replicated), new_state
            )
        return out, new_state


def _as_output(x: Any) -> Any:
    if isinstance(x, PerReplica):
        raise TypeError("a replica function must return arrays, not PerReplica values")
    try:
        return jnp.asarray(x)
    except TypeError:
        raise TypeError(
            f"a replica function returned {x!r} of type {type(x).__name__}; "
            f"return arrays (or pytrees of arrays)"
        ) from None


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
        return getattr(self._extended, "_cluster_resolver", None)

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
        steady = ext._plain_run and not kwargs and type(args) is tuple
        if steady:
            # Outside every scope, or in this strategy's scope and not in a merge_call, the
            # checks below have nothing to say: the steady-state jit first.
            stack = ctx_lib.state.stack
            if not stack or (stack[-1].strategy is self and stack[-1].merged_from is None):
                out = ext._run_steady(fn, donate, args)
                if out is not _MISS:
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
                out = ext._run_steady(fn, donate, args)
                if out is not _MISS:
                    return out
            call_options = ext._call_options
            previous = getattr(call_options, "donate", ())
            call_options.donate = donate
            try:
                return ext._run(fn, args, kwargs)
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
            lambda v: self._extended._reduce_leaf(op, v, axis), value, is_leaf=is_per_replica
        )

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates the per-replica values of ``value`` along ``axis`` (replica order)."""

        ext = self._extended

        def one(v):
            if isinstance(v, PerReplica) and v.lengths is not None:
                return gather_rows(v, axis, ext._replicated)  # the real rows, in order
            if isinstance(v, PerReplica):
                stacked = ext._prepare_leaf(v, "pr")
            elif ext._is_mirrored(v) or isinstance(v, (jax.Array, np.ndarray)):
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
            return ext._gather_fn(axis % (stacked.ndim - 1))(stacked)

        return jax.tree.map(one, value, is_leaf=is_per_replica)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The values on this process's replicas, as a tuple (one entry per replica)."""
        leaves, treedef = jax.tree.flatten(value, is_leaf=is_per_replica)
        per_leaf = []
        for leaf in leaves:
            if isinstance(leaf, PerReplica):
                per_leaf.append(leaf.values)
            elif self._extended._is_mirrored(leaf):
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


#: ``hook(fn, args, kwargs) -> None | (step, step_args, write_back)``: state a replica function
#: reaches that is not among its arguments (Keras variables its closure names). ``run`` then
#: runs ``step(*step_args)``, which returns ``(outputs, new_state)``, and calls
#: ``write_back(new_state)``. ``jaxdist/__init__.py`` registers Keras's.
_RUN_STATE_HOOKS: list[Callable[[Callable, tuple, dict], Any]] = []


def register_run_state_hook(hook: Callable[[Callable, tuple, dict], Any]) -> None:
    """Makes every ``strategy.run`` ask ``hook`` for state its function reaches.

    Example:
        >>> from jaxdist._src.strategies.strategy import _RUN_STATE_HOOKS, register_run_state_hook
        >>> hook = lambda fn, args, kwargs: None   # carries nothing
        >>> register_run_state_hook(hook)
        >>> _RUN_STATE_HOOKS.remove(hook)          # (a hook stays for the process otherwise)
    """
    if hook not in _RUN_STATE_HOOKS:
        _RUN_STATE_HOOKS.append(hook)


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
