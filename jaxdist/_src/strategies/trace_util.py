"""Where a replica function is being traced: the one place that reads JAX's trace stack.

``merge_call`` must know whether it is called inside a ``jax.lax`` control-flow body (a
``while_loop``, ``fori_loop``, ``scan``, ``cond`` or ``switch`` traced inside the replica
function): there, as in TF (where control flow builds a separate graph), it raises instead of
tracing a cross-replica reduction into a loop body. JAX records, for every jaxpr it traces, what
it traces it for (``DebugInfo.traced_for``: ``"while_body"``, ``"scan"``, ``"cond"``, ...) and
links each trace to its parent; this module walks that chain. Written for JAX 0.10
(``jax._src.core.trace_ctx``, ``DynamicJaxprTrace.parent_trace`` / ``.frame.debug_info``); if
those move, ``current_trace`` returns ``None`` and ``tests/test_context.py`` fails loudly.
"""

from __future__ import annotations

from typing import Any

from jaxdist._src.compat import jax_internals

#: ``DebugInfo.traced_for`` of the bodies of ``jax.lax`` control flow (``lax.map`` is a scan).
_CONTROL_FLOW = ("while_body", "while_cond", "fori_loop", "scan", "cond", "switch",
                 "custom_root", "custom_linear_solve")


def current_trace() -> Any:
    """The JAX trace operations go to right now (``None`` if this JAX hides it).

    Example:
        >>> from jaxdist._src.strategies.trace_util import current_trace
        >>> current_trace() is not None
        True
    """
    return jax_internals.current_trace()


def control_flow_between(home: Any, trace: Any = None) -> str | None:
    """The control flow ``trace`` is nested in below ``home``, or ``None``.

    Args:
        home: the trace the replica function started in (recorded by its ``ReplicaContext``).
        trace: the trace to look from (default: the current one).

    Returns:
        what JAX traced the innermost control-flow body for (``"while_body"``, ``"scan"``,
        ``"cond"``, ...), or ``None`` when no control flow lies between ``trace`` and ``home``
        (nested ``jax.jit``, ``jax.grad``, ``jax.vmap`` and ``jax.checkpoint`` are not control
        flow), or when ``home`` is not among ``trace``'s ancestors (another trace altogether).

    Example:
        >>> from jaxdist._src.strategies.trace_util import control_flow_between, current_trace
        >>> control_flow_between(current_trace()) is None
        True
    """
    if home is None:
        return None
    t = current_trace() if trace is None else trace
    found = None
    for _ in range(10_000):  # a bound on the walk, far above any real nesting depth
        if t is None:
            return None
        if t is home:
            return found
        if found is None:
            dbg = getattr(getattr(t, "frame", None), "debug_info", None)
            traced_for = getattr(dbg, "traced_for", None)
            if isinstance(traced_for, str) and traced_for.startswith(_CONTROL_FLOW):
                found = traced_for
        t = getattr(t, "parent_trace", None)
    return None
