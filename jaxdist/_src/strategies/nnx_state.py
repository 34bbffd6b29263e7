"""flax NNX objects crossing ``Strategy.run``: split before the step, updated in place after it.

flax NNX modules, ``nnx.Optimizer``, ``nnx.MultiMetric`` and ``nnx.Rngs`` are mutable Python
objects. A compiled step cannot mutate them, so ``run`` does what ``nnx.jit`` does: it splits
the objects among the arguments into a ``GraphDef`` (static) and their state (arrays), merges
them again inside the compiled step, hands the merged objects to the step, takes their state
back out as a step output, and writes it into the caller's objects (``nnx.update``). Shared
references between the objects (a model held by two of them) survive, as under ``nnx.jit``.

Two views, chosen by the step function:

* **Global view** (the step is an ``nnx.jit`` function, flax's own convention: flax steps are
  written for one device, ``loss = ....mean()``): the step runs once over the *global* batch,
  as one XLA program partitioned over the replica mesh (the batch stays split across the
  devices). Every number is one device's: the gradient of a mean loss, metric sums and counts,
  BatchNorm statistics over the whole batch, dropout masks. On a partial last batch the step
  sees exactly the real rows (padding dropped). Inside it ``get_replica_context()`` is one
  replica that sees everything (``num_replicas_in_sync == 1``; ``all_reduce`` returns its
  input), so ``compute_average_loss`` divides by the global batch.
* **Replica view** (any other function, TF's ``strategy.run`` semantics): the step runs once
  per replica on its slice of the batch. NNX state that comes back different on the replicas
  is reduced by TF's ``SyncOnRead`` rule (``VARIABLE_RULES``): metric state (``nnx.metrics``)
  is summed (each replica's contribution once), ``nnx.BatchStat`` is averaged, RNG state must
  agree. Parameters and optimizer state that differ across replicas are an error naming the
  variable (their update used an unreduced per-replica value). On a partial last batch a step
  that updates metric state or batch statistics is refused (the padding rows would count);
  the error names the fix (an ``nnx.jit`` step, or ``drop_remainder=True``).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist._src.compat import flax_internals
from jaxdist._src.strategies.cross_device_ops import varying_axes
from jaxdist._src.strategies.fn_key import function_key

#: What replica-view ``run`` does with NNX state that differs across replicas, by variable type
#: name (the first match along the type's MRO wins; anything else that differs is an error).
VARIABLE_RULES = {
    "MetricState": "sum",  # TF: metric variables are SyncOnRead SUM
    "BatchStat": "mean",  # TF: BatchNorm moving statistics are averaged (SyncOnRead MEAN)
    "RngCount": "first",  # identical on every replica unless a step makes them differ
    "RngKey": "first",
}


class NnxStateError(ValueError):
    """NNX state cannot cross ``strategy.run`` as asked (the message names the variable)."""


def nnx_module() -> Any:
    """``flax.nnx`` if it has been imported (no NNX object can exist before), else ``None``."""
    return sys.modules.get("flax.nnx")


def is_global_view(fn: Callable) -> bool:
    """Whether ``fn`` is an ``nnx.jit`` function (run over the global batch)."""
    return flax_internals.is_nnx_jit(fn)


class _Slot:
    """A placeholder for the ``i``-th NNX object among a step's arguments (static, hashable)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Slot) and other.index == self.index

    def __hash__(self) -> int:
        return hash((_Slot, self.index))

    def __repr__(self) -> str:
        return f"<nnx object {self.index}>"


_WRAPPERS: dict[Any, Callable] = {}
_MAX_WRAPPERS = 256


def split_args(fn: Callable, args: tuple, kwargs: dict, is_leaf: Callable[[Any], bool]):
    """Splits the NNX objects out of ``(args, kwargs)``.

    Returns ``None`` when there are none, else ``(step, step_args, nodes)``: call
    ``step(state, args_with_slots, kwargs_with_slots)`` (cached per function and graph), whose
    result is ``(fn's outputs, new state)``, then ``update(nodes, new_state)``.
    """
    nnx = nnx_module()
    if nnx is None:
        return None
    leaves, treedef = jax.tree.flatten(
        (tuple(args), kwargs), is_leaf=lambda x: is_leaf(x) or isinstance(x, nnx.Pytree)
    )
    nodes: list[Any] = []
    ids: dict[int, int] = {}
    found = False
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, nnx.Pytree):
            found = True
            k = ids.setdefault(id(leaf), len(nodes))
            if k == len(nodes):
                nodes.append(leaf)
            leaves[i] = _Slot(k)
    if not found:
        return None
    graphdef, state = nnx.split(tuple(nodes))
    new_args, new_kwargs = treedef.unflatten(leaves)
    global_view = is_global_view(fn)
    key = (function_key(fn), graphdef, global_view)  # a step_fn made anew: one wrapper
    try:
        step = _WRAPPERS.get(key)
    except TypeError:  # an unhashable fn: no cache
        key, step = None, None
    if step is None:
        step = _make_step(fn, graphdef, global_view)
        if key is not None:
            if len(_WRAPPERS) >= _MAX_WRAPPERS:
                _WRAPPERS.pop(next(iter(_WRAPPERS)))
            _WRAPPERS[key] = step
    return step, (state, new_args, new_kwargs), tuple(nodes)


def update(nodes: tuple, new_state: Any) -> None:
    """Writes a step's new NNX state into the caller's objects (in place, as ``nnx.jit``)."""
    nnx_module().update(nodes, new_state)


def _variable_kinds(state: Any) -> list[tuple[str, str]]:
    """(path, rule) per array leaf of ``state``, in ``jax.tree.leaves`` order."""
    nnx = nnx_module()
    pairs, _ = jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    out = []
    for path, var in pairs:
        name = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
        rule = "error"
        for cls in type(var).__mro__:
            if cls.__name__ in VARIABLE_RULES:
                rule = VARIABLE_RULES[cls.__name__]
                break
        label = f"{type(var).__name__} {name}"
        out.extend((label, rule) for _ in jax.tree.leaves(var))
    return out


#: The steps made for a global-view (``nnx.jit``) function: ``strategy.run`` compiles them over
#: the global batch (``compiled_run.GlobalRun``).
_GLOBAL_VIEW_STEPS: weakref.WeakSet = weakref.WeakSet()


def is_global_view_step(fn: Callable) -> bool:
    """Whether ``fn`` is a step this module made for a global-view function."""
    try:
        return fn in _GLOBAL_VIEW_STEPS
    except TypeError:  # an unhashable callable
        return False


def _make_step(fn: Callable, graphdef: Any, global_view: bool) -> Callable:
    nnx = nnx_module()

    def step(state, args, kwargs):
        old_leaves = jax.tree.leaves(state)  # merge shares the Variables: read them first
        nodes = nnx.merge(graphdef, state)

        def put(x):
            return nodes[x.index] if isinstance(x, _Slot) else x

        args, kwargs = jax.tree.map(put, (args, kwargs), is_leaf=lambda x: isinstance(x, _Slot))
        out = fn(*args, **kwargs)
        new_graphdef, new_state = nnx.split(nodes)
        if new_graphdef != graphdef:
            raise NnxStateError(
                f"The step {getattr(fn, '__qualname__', fn)!r} changed the structure of the NNX "
                f"objects it was given (added, removed or retyped an attribute or variable). "
                f"strategy.run carries only their state; create every variable before the "
                f"first step (e.g. build the model and the metrics under strategy.scope())."
            )
        if not global_view:
            new_state = _sync_on_read(old_leaves, new_state)
        return out, new_state

    step.__qualname__ = getattr(fn, "__qualname__", type(fn).__name__)
    if global_view:
        _GLOBAL_VIEW_STEPS.add(step)
    step.__wrapped__ = fn
    return step


def _sync_on_read(old_leaves: list[Any], new_state: Any) -> Any:
    """Replica view: reduces NNX state that differs across replicas by ``VARIABLE_RULES``."""
    from jaxdist._src.strategies import context as ctx_lib
    from jaxdist._src.strategies.replica_context import padded_rows_of

    frame = ctx_lib.top()
    rctx = None if frame is None else frame.replica_context
    axes = None if rctx is None else rctx.axis_name
    partial = rctx is not None and padded_rows_of(rctx) is not None  # not a user read
    kinds = _variable_kinds(new_state)
    new_leaves, treedef = jax.tree.flatten(new_state)
    out = []
    for (label, rule), old, new in zip(kinds, old_leaves, new_leaves, strict=True):
        if partial and new is not old and rule in ("sum", "mean"):
            raise NnxStateError(
                f"A partial last batch reached a per-replica step that updates {label}: its "
                f"padding rows would be counted. Run the step over the global batch instead "
                f"(decorate it with @nnx.jit: strategy.run then drops the padding), or batch "
                f"the dataset with drop_remainder=True."
            )
        varies = axes is not None and bool(set(axes) & varying_axes(new))
        if rule == "sum" and axes is not None and new is not old:
            # Each replica's contribution counts once: the old value plus every replica's
            # change. A change that is the same on every replica (a row count) is N changes.
            delta = new - old
            if varies:
                delta = lax.psum(delta, axes)
            else:
                delta = delta * rctx.strategy.num_replicas_in_sync
            out.append((old + delta).astype(new.dtype))
            continue
        if not varies:
            out.append(new)
        elif rule == "mean":
            out.append(lax.pmean(new, axes).astype(new.dtype))
        elif rule == "first":
            out.append(_first_replica(new, axes))
        else:
            raise NnxStateError(
                f"{label} differs across the replicas after the step: its update used a "
                f"per-replica value that was never reduced (e.g. a gradient of ctx.local(...) "
                f"state, or a per-replica statistic). Reduce it first "
                f"(jaxdist.get_replica_context().all_reduce), or decorate the step with "
                f"@nnx.jit to run it over the global batch."
            )
    return treedef.unflatten(out)


def _first_replica(x: Any, axes: tuple[str, ...]) -> Any:
    """Replica 0's ``x`` on every replica (RNG state: keys are gathered as their raw data)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _first_replica(jax.random.key_data(x), axes)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return lax.all_gather(x, axes, tiled=False).reshape((-1, *x.shape))[0]


def globalize(x: Any, lengths: tuple[int, ...] | None) -> Any:
    """A stacked per-replica array ``(replicas, rows, ...)`` as the global batch.

    Inside a compiled step: the rows in replica order, padding dropped on a partial batch.
    """
    if lengths is None:
        return x.reshape((x.shape[0] * x.shape[1], *x.shape[2:]))
    parts = [x[i, :n] for i, n in enumerate(lengths) if n]
    if not parts:
        return jnp.zeros((0, *x.shape[2:]), x.dtype)
    return jnp.concatenate(parts, axis=0)


__all__ = [
    "VARIABLE_RULES",
    "NnxStateError",
    "globalize",
    "is_global_view",
    "is_global_view_step",
    "split_args",
    "update",
]
