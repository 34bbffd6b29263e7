"""``ReplicaContext.all_reduce`` with TF's gradient, and the double-reduction check.

TF registers the gradient of an all-reduce as the all-reduce of the upstream gradient, and
differentiates every value per replica. JAX's ``shard_map`` differentiates a value that is the
same on every replica (invariant) as *one* value. Two consequences, both handled here:

* Gradients through ``all_reduce``: a ``custom_vjp`` whose backward pass all-reduces the
  per-replica cotangents, as TF does. When ``all_reduce`` is called inside a function being
  differentiated, its output is typed as varying over the replicas (the values are still
  identical), so the cotangents reach the backward pass per replica and not pre-summed; the
  result then matches TF exactly (TF's ``strategy_test_lib`` gradient cases: ``d(all_reduce(SUM,
  x) * c)/dx`` is the sum of ``c`` over the replicas, the mean for ``MEAN``).
* Double reduction: ``jax.grad`` with respect to replicated (invariant) state already sums the
  gradient over the replicas (the transpose of the implicit broadcast is a ``psum``). All-reducing
  that value again would silently give ``N`` times TF's gradient (``SUM``) or the sum instead of
  the mean (``MEAN``), so ``all_reduce`` inspects the equations that produced an invariant value
  and raises ``DoubleReductionError`` when a cross-replica ``psum`` it did not make itself is among
  them. An invariant value that was not reduced (a constant, a function of replicated state) keeps
  TF's meaning: ``SUM`` multiplies it by the replica count, ``MEAN`` returns it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxdist._src.compat import jax_internals
from jaxdist._src.strategies.cross_device_ops import CrossDeviceOps, varying_axes
from jaxdist._src.strategies.reduce_util import ReduceOp

_MAX_EQNS_VISITED = 20_000


class DoubleReductionError(ValueError):
    """``all_reduce`` got a value that was already summed over the replicas.

    Example:
        >>> import jax, jaxdist
        >>> import jax.numpy as jnp
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])  # doctest: +NEEDS_2_DEVICES
        >>> def step(params):
        ...     ctx = jaxdist.get_replica_context()
        ...     loss_fn = lambda w: ctx.all_reduce("SUM", jnp.sum(w))
        ...     grads = jax.grad(loss_fn)(params)          # already summed over replicas
        ...     return ctx.all_reduce("SUM", grads)
        >>> strategy.run(step, args=(jnp.ones(2),))
        Traceback (most recent call last):
        ...
        jaxdist.DoubleReductionError: all_reduce(SUM) got a value that is already summed over
        the 2 ...
    """


# forward mode (jax.jvp, jacfwd); reverse mode (jax.grad, vjp)
_JVP_TRACERS, _LIN_TRACERS = jax_internals.autodiff_tracer_types()
_AD_TRACERS = _JVP_TRACERS + _LIN_TRACERS


def _under_autodiff(leaves: list[Any]) -> bool:
    return bool(_AD_TRACERS) and any(isinstance(x, _AD_TRACERS) for x in leaves)


def _forward_mode(leaves: list[Any]) -> bool:
    return bool(_JVP_TRACERS) and any(isinstance(x, _JVP_TRACERS) for x in leaves)


_REDUCTIONS = jax_internals.reduction_primitives()


def _primal(x: Any) -> Any:
    """Strips autodiff tracers to the value the enclosing trace recorded."""
    while _AD_TRACERS and isinstance(x, _AD_TRACERS):
        x = x.primal
    return x


def _eqn_axes(eqn: Any) -> set:
    axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    if not isinstance(axes, (tuple, list)):
        axes = (axes,)
    return set(axes)


def already_reduced(x: Any, axes: tuple[str, ...]) -> bool:
    """Whether an invariant traced value was produced through a ``psum`` over ``axes``.

    Walks the tracing equations behind ``x`` (through invariant values only: a reduction in the
    history of a varying value does not make the value reduced). The ``psum`` inside jaxdist's
    own ``all_reduce`` is hidden in its ``custom_vjp`` and not seen.
    """
    if not _REDUCTIONS:
        return False
    want = set(axes)
    stack = [_primal(x)]
    seen: set[int] = set()
    while stack and len(seen) < _MAX_EQNS_VISITED:
        t = stack.pop()
        eqn = getattr(t, "parent", None)
        if eqn is None or id(eqn) in seen:
            continue
        seen.add(id(eqn))
        if eqn.primitive in _REDUCTIONS and want & _eqn_axes(eqn):
            return True
        for inp in getattr(eqn, "in_tracers", ()):
            if not want & varying_axes(inp):
                stack.append(inp)
    return False


def _double_reduction_message(op: ReduceOp, path: str, n: int) -> str:
    factor = f"{n} times TF's gradient" if op is ReduceOp.SUM else "the sum instead of the mean"
    return (
        f"all_reduce({op.name}) got a value{path} that is already summed over the {n} replicas "
        f"(a double reduction: reducing it again would silently give {factor}). This happens "
        f"when jax.grad is taken with respect to replicated state: under strategy.run JAX "
        f"already sums that gradient over the replicas. Fix: either drop the all_reduce "
        f"(grads = jax.grad(loss_fn)(params) is already the total), or differentiate with "
        f"respect to ctx.local(params) to get TF's per-replica gradients and keep "
        f"ctx.all_reduce({op.name!r}, grads)."
    )


def check_not_reduced(op: ReduceOp, value: Any, axes: tuple[str, ...], n: int) -> None:
    """Raises ``DoubleReductionError`` if an invariant leaf of ``value`` is already reduced."""
    flat, _ = jax.tree_util.tree_flatten_with_path(value)
    for path, leaf in flat:
        if not isinstance(leaf, jax.core.Tracer):
            continue
        if set(axes) & varying_axes(leaf):
            continue
        if already_reduced(leaf, axes):
            where = f" at {jax.tree_util.keystr(path)}" if path else ""
            raise DoubleReductionError(_double_reduction_message(op, where, n))


def _cast_varying(x: Any, axes: tuple[str, ...]) -> Any:
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x


def _cast_like(x: Any, varying: bool, axes: tuple[str, ...]) -> Any:
    if varying:
        return _cast_varying(x, axes)
    return x


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _all_reduce(cdo, op, axes, n, in_varying, vary_out, leaves):
    out = cdo.all_reduce(op, list(leaves), axes, n)
    if vary_out:
        out = [_cast_varying(x, axes) for x in out]
    return tuple(out)


def _all_reduce_fwd(cdo, op, axes, n, in_varying, vary_out, leaves):
    return _all_reduce(cdo, op, axes, n, in_varying, vary_out, leaves), None


def _all_reduce_bwd(cdo, op, axes, n, in_varying, vary_out, res, cts):
    del res, vary_out
    cts = list(cts)
    varying = [i for i, g in enumerate(cts) if set(axes) & varying_axes(g)]
    out = list(cts)
    if varying:
        # TF: the gradient of an all-reduce is the same all-reduce of the upstream gradients.
        reduced = cdo.all_reduce(op, [cts[i] for i in varying], axes, n)
        for i, r in zip(varying, reduced):
            out[i] = r
    for i, g in enumerate(cts):
        if i not in varying and op is ReduceOp.MEAN:
            # An invariant cotangent is already the sum of the replicas' cotangents.
            out[i] = (g / n).astype(g.dtype)
    return (tuple(_cast_like(g, v, axes) for g, v in zip(out, in_varying)),)


_all_reduce.defvjp(_all_reduce_fwd, _all_reduce_bwd)


def all_reduce(cdo: CrossDeviceOps, op: ReduceOp, value: Any, axes: tuple[str, ...], n: int):
    """All-reduces a pytree inside ``shard_map`` with TF's forward values and gradients.

    Raises:
        DoubleReductionError: a leaf is already summed over the replicas (see module doc).
    """
    check_not_reduced(op, value, axes, n)
    leaves, treedef = jax.tree.flatten(value)
    if not leaves:
        return value
    leaves = [jnp.asarray(x) for x in leaves]
    if _forward_mode(leaves):
        # Forward mode: a custom_vjp has no JVP; the tangent of an all-reduce is the same
        # all-reduce of the tangents, which the plain reduction gives.
        return treedef.unflatten(list(cdo.all_reduce(op, leaves, axes, n)))
    in_varying = tuple(bool(set(axes) & varying_axes(x)) for x in leaves)
    vary_out = _under_autodiff(leaves)
    out = _all_reduce(cdo, op, tuple(axes), n, in_varying, vary_out, tuple(leaves))
    return treedef.unflatten(list(out))
