"""The engine behind ``Strategy.run``: compile once per function and argument signature, then
dispatch cheaply.

``run(fn, args)`` compiles ``jit(shard_map(fn))`` over the strategy's replica mesh
(``CompiledRun``; a global-view ``nnx.jit`` step compiles as one program, ``GlobalRun``). Calls
then take the cheapest path that can serve them: the steady-state jit over the whole argument
tuple, whose C++ dispatch does the checks (``CompiledRunner._tree_call``); a signature checked
once (``FastEntry``); or the full path (flatten, classify, place, look up or compile). Every
dispatch is bounded by the strategy's steps-in-flight throttle. A partial batch's padding reaching
a reduced output is warned about once per function.

``CompiledRunner`` is the part of ``StrategyExtended`` that does this; it uses the strategy's
mesh and placement attributes (``_devices``, ``_axes``, ``_mesh``, ``_mesh_devices``,
``_replicated``, ``_data_sharding``, ``_throttle``, ``_container_strategy``, set by
``StrategyExtended.__init__``); a ``CompiledRun`` reads the extended's public ones
(``container_strategy``, ``mesh``, ...).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxdist._src.compat import jax_internals
from jaxdist._src.strategies import context as ctx_lib
from jaxdist._src.strategies import nnx_state
from jaxdist._src.strategies.cross_device_ops import varying_axes
from jaxdist._src.strategies.fn_key import function_key
from jaxdist._src.strategies.partial_rows import (
    batch_dependent_outputs,
    padding_warning,
    per_row_lengths,
    wrap_outputs,
)
from jaxdist._src.strategies.replica_context import (
    ReplicaContext,
    row_mask_was_read,
    set_partial_batch,
)
from jaxdist._src.values.per_replica import PerReplica, is_per_replica

SCALAR_TYPES = (int, float, bool, complex)
_Tracer = jax.core.Tracer
# Concrete (not traced) jax.Array classes seen among step outputs: a type test is cheaper than
# isinstance against jax.Array's ABC, and needs no import of JAX's private array module.
_ARRAY_TYPES: set[type] = set()
MISS = object()  # a _tree_call that cannot serve a call


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


RUN_CACHE_SIZE = 128
_RETRACE_WARNING_AFTER = 8


def is_dynamic(x: Any) -> bool:
    """Whether ``run`` passes ``x`` to the compiled step as an argument (an array or number)
    rather than compiling it in as a constant."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, *SCALAR_TYPES)) or hasattr(
        x, "__jax_array__"
    )


#: ``hook(fn, args, kwargs) -> None | (step, step_args, write_back)``: state a replica function
#: reaches that is not among its arguments (Keras variables its closure names). ``run`` then
#: runs ``step(*step_args)``, which returns ``(outputs, new_state)``, and calls
#: ``write_back(new_state)``. ``jaxdist/__init__.py`` registers Keras's.
_RUN_STATE_HOOKS: list[Callable[[Callable, tuple, dict], Any]] = []


def register_run_state_hook(hook: Callable[[Callable, tuple, dict], Any]) -> None:
    """Makes every ``strategy.run`` ask ``hook`` for state its function reaches.

    Example:
        >>> from jaxdist._src.strategies.compiled_run import (
        ...     _RUN_STATE_HOOKS, register_run_state_hook)
        >>> hook = lambda fn, args, kwargs: None   # carries nothing
        >>> register_run_state_hook(hook)
        >>> _RUN_STATE_HOOKS.remove(hook)          # (a hook stays for the process otherwise)
    """
    if hook not in _RUN_STATE_HOOKS:
        _RUN_STATE_HOOKS.append(hook)


class CompiledRunner:
    """``run``'s compile cache and dispatch, a base of ``StrategyExtended``."""

    #: Whether ``run_compiled`` is this class's (``Strategy.run`` may then call a function's
    #: steady-state jit itself); a subclass whose ``run_compiled`` adds work per call sets it False.
    plain_run = True
    #: Whether this class overrides ``_post_run`` (set for subclasses by ``__init_subclass__``).
    _posts = False

    def _init_run_caches(self) -> None:
        self._run_cache: collections.OrderedDict = collections.OrderedDict()
        self._cache_lock = threading.Lock()
        self.call_options = threading.local()  # RunOptions.donate_argnums of the current run
        self._donate_masks: dict[Any, tuple[int, ...]] = {}
        self._new_fn_counts: dict[Any, int] = {}
        self._fast: dict[Any, FastEntry] = {}  # (fn, args treedef, donation) -> checked call
        # (fn, donation) -> one jax.jit over run's whole argument tuple (``_tree_call``), or
        # False once such a call missed (the flatten-and-match path serves that pair then).
        self._tree_calls: dict[Any, Any] = {}
        # (function_key(fn), donation) -> that call, shared by the function objects of one key
        # (a step_fn defined anew inside each train_step call: compiled once).
        self._shared_calls: dict[Any, Any] = {}
        self._padding_warned: set = set()  # functions warned about reducing padding rows

    def prepare_leaf(self, leaf: Any, kind: str) -> Any:
        if kind == "pr":
            x = leaf.stacked
            if isinstance(x, jax.core.Tracer):
                return x
            if not isinstance(x, jax.Array) or x.sharding != self._data_sharding:
                x = jax.device_put(x, self._data_sharding)
            return x
        if isinstance(leaf, (jax.core.Tracer, *SCALAR_TYPES)):
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

    def run_compiled(self, fn: Callable, args=(), kwargs=None) -> Any:
        if not kwargs and type(args) is tuple:
            donate = getattr(self.call_options, "donate", ())
            out = self.run_steady(fn, donate, args)
            if out is not MISS:
                return out
            # Otherwise one flatten, a check per leaf and the compiled call (``FastEntry``).
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
        options = self.call_options
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
        donate = getattr(self.call_options, "donate", ())
        if donate:
            donate = self._donated_dyn_indices(treedef, tuple(kinds), donate, len(args))
        key = (function_key(fn), treedef, tuple(kinds), tuple(statics), partial, donate)
        compiled = self._lookup(key, fn, treedef, kinds, statics, partial, donate)
        dyn = [self.prepare_leaf(x, "pr" if isinstance(x, PerReplica) else "arr") for x in dyn]
        if tracing:
            return compiled.raw(*dyn)
        if remember and not kwargs and "empty" not in kinds and type(args) is tuple:
            call = self._remember(fn, args, compiled, kinds, statics, dyn)
            if call:
                out = self._dispatch_tree(fn, getattr(self.call_options, "donate", ()), call,
                                          args)
                if out is not MISS:
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
            elif is_dynamic(leaf):
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
        """Records a checked call's signature for ``run_compiled``'s fast path (``FastEntry``)."""
        leaves, treedef = jax.tree.flatten(args)
        if len(leaves) != len(kinds):  # e.g. a PerReplica holding no array
            return
        entry = FastEntry.build(compiled, kinds, statics, leaves, dyn, self._num_replicas)
        if entry is None:
            return None
        donate = getattr(self.call_options, "donate", ())
        try:
            self._fast[(fn, treedef, donate)] = entry
        except TypeError:
            return None
        while len(self._fast) > RUN_CACHE_SIZE:
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
                    while len(self._shared_calls) > RUN_CACHE_SIZE:
                        self._shared_calls.pop(next(iter(self._shared_calls)))
            self._tree_calls[(fn, donate)] = call
            while len(self._tree_calls) > RUN_CACHE_SIZE:
                self._tree_calls.pop(next(iter(self._tree_calls)))
        return call

    def _compiled_versions(self, fn: Callable) -> int:
        """How many executables ``run`` holds for ``fn`` (one per argument signature): what
        tests count to check that a call compiled nothing new."""
        fkey = function_key(fn)
        count = sum(jax_internals.jit_cache_size(c.jitted) for c in self._run_cache.values()
                    if function_key(c.fn) == fkey)
        calls = {id(call): call for (f, _), call in self._tree_calls.items()
                 if call and function_key(f) == fkey}
        return count + sum(jax_internals.jit_cache_size(call) for call in calls.values())

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

    def run_steady(self, fn: Callable, donate: tuple[int, ...], args: tuple) -> Any:
        """The steady state in one process: ``fn``'s jit over the whole argument tuple, whose
        C++ dispatch checks structure, shapes and placement (``_tree_call``); ``MISS`` when
        there is none or it cannot serve ``args``."""
        try:
            call = self._tree_calls.get((fn, donate))
        except TypeError:  # an unhashable function
            return MISS
        if not call:
            return MISS
        return self._dispatch_tree(fn, donate, call, args)

    def _dispatch_tree(self, fn: Callable, donate: tuple[int, ...], call: Callable,
                       args: tuple) -> Any:
        """Calls a ``_tree_call``, bounding the steps in flight; ``MISS`` when it cannot.

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
            return MISS
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
        cls._posts = cls._post_run is not CompiledRunner._post_run

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
        cls = GlobalRun if nnx_state.is_global_view_step(fn) else CompiledRun
        compiled = cls(self, fn, treedef, kinds, statics, partial, donate)
        self._note_new_function(fn)
        if key is not None:
            with self._cache_lock:
                self._run_cache[key] = compiled
                while len(self._run_cache) > RUN_CACHE_SIZE:
                    self._run_cache.popitem(last=False)
        return compiled


class FastEntry:
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
            elif isinstance(leaf, (*SCALAR_TYPES, np.generic)):
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


class CompiledRun:
    """One replica function compiled for one argument structure."""

    def __init__(
        self, extended: CompiledRunner, fn: Callable, treedef, kinds, statics, partial=None,
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
        strategy = ext.container_strategy
        rctx = ReplicaContext(strategy, axes)
        if self.partial is not None:
            set_partial_batch(rctx, *self.partial)
        # A loop carry started from a constant and made per-replica by the body starts
        # per-replica (as under pmap): JAX's carry type check would refuse it otherwise.
        carries = (jax_internals.carries_vary_over(axes) if axes is not None
                   else contextlib.nullcontext())
        with ctx_lib.enter_replica(strategy, rctx), carries:
            self.traces += 1
            out = self.fn(*args, **kwargs)
        self.row_mask_read = row_mask_was_read(rctx)
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
        axes, mesh = ext.replica_axis_names, ext.mesh
        dyn_kinds = [k for k in self.kinds if k not in ("static", "empty")]
        dyn = [x.stacked if isinstance(x, PerReplica) else x for x in dyn]
        if ext.num_replicas_in_mesh == 1:
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

    def __init__(self, strategy: ctx_lib.StrategyLike):
        super().__init__(strategy, None)

    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    def __repr__(self) -> str:
        return f"ReplicaContext(strategy={self._strategy!r}, global_view=True)"


class GlobalRun(CompiledRun):
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
        strategy = ext.container_strategy
        rctx = _GlobalViewContext(strategy)
        with ctx_lib.enter_replica(strategy, rctx):
            self.traces += 1
            out, new_state = self.fn(*args, **kwargs)
        if ext.num_replicas_in_mesh > 1:
            replicated = ext.replicated_sharding
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
