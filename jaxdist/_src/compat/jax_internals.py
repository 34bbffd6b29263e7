"""Every use of JAX's private modules (``jax._src``), with the JAX versions it is written for.

jaxdist is written against JAX's public API; where that API has no equivalent yet, the private
object is reached here, and only here, each with a comment naming the public API that would
replace it. ``check_version()`` says whether the installed JAX is one these adapters were
written and tested for (``SUPPORTED``); ``tests/internal/test_jax_internals.py`` checks each adapter
still finds what it needs, so a JAX that moves an internal fails there, by name.

Example:
    >>> from jaxdist._src.compat import jax_internals
    >>> jax_internals.check_version()          # None: a supported JAX
"""

from __future__ import annotations

import warnings
from typing import Any

import jax

from jaxdist._src.compat.versions import outside_range

#: The JAX releases the adapters below are written for: (lowest, first unsupported).
SUPPORTED = ((0, 10, 2), (0, 12, 0))


def check_version(version: str | None = None) -> str | None:
    """``None`` for a supported JAX, else a sentence saying which range is supported.

    Example:
        >>> check_version("0.9.0")
        'jaxdist supports jax >= 0.10.2, < 0.12.0; found jax 0.9.0'
    """
    found = jax.__version__ if version is None else version
    return outside_range("jaxdist", "jax", found, SUPPORTED)


def warn_if_unsupported() -> None:
    """Warns once (at import of jaxdist) when the installed JAX is outside ``SUPPORTED``."""
    message = check_version()
    if message is not None:
        warnings.warn(message + ": private JAX APIs jaxdist adapts may have moved",
                      RuntimeWarning, stacklevel=2)


# ---------------------------------------------------------------------- tracing and autodiff
def trace_state_clean() -> bool:
    """Whether no JAX transformation is tracing right now (outside every ``jit`` / ``grad``).

    Public replacement: none yet (``jax.core.trace_state_clean`` was removed from ``jax.core``).
    """
    try:
        from jax._src import core
    except ImportError:  # pragma: no cover - a JAX without the private module
        return True
    return core.trace_state_clean()


def current_trace() -> Any:
    """The JAX trace operations go to right now (``None`` if this JAX hides it).

    Public replacement: none (JAX does not expose its trace stack).
    """
    try:
        from jax._src import core
    except ImportError:  # pragma: no cover
        return None
    ctx = getattr(core, "trace_ctx", None)
    return getattr(ctx, "trace", None)


def autodiff_tracer_types() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """``(forward-mode tracer types, reverse-mode tracer types)`` (``ad.JVPTracer``,
    ``ad.LinearizeTracer``); empty tuples where this JAX has neither.

    Public replacement: none (``jax.core.Tracer`` subclasses are private).
    """
    try:
        from jax._src.interpreters import ad
    except ImportError:  # pragma: no cover
        return (), ()

    def one(name: str) -> tuple[type, ...]:
        t = getattr(ad, name, None)
        return (t,) if t is not None else ()

    return one("JVPTracer"), one("LinearizeTracer")


def reduction_primitives() -> tuple[Any, ...]:
    """The primitives of a cross-replica sum (``psum_invariant_p``, ``psum_p``).

    Public replacement: none (primitives are private).
    """
    try:
        from jax._src.lax import parallel
    except ImportError:  # pragma: no cover
        return ()
    return tuple(
        p for p in (getattr(parallel, "psum_invariant_p", None), getattr(parallel, "psum_p", None))
        if p is not None
    )


def all_gather_invariant() -> Any:
    """JAX's ``all_gather_invariant`` (an all-gather typed as identical on every replica), or
    ``None`` where this JAX has none.

    Public replacement: ``jax.lax.all_gather_invariant`` once exported.
    """
    public = getattr(jax.lax, "all_gather_invariant", None)
    if public is not None:
        return public
    try:
        from jax._src.lax.parallel import all_gather_invariant as agi
    except ImportError:  # pragma: no cover
        return None
    return agi


# ---------------------------------------------------------------------- hardware
def num_tpu_chips() -> int | None:
    """How many TPU chips this machine has (``None`` if this JAX cannot say).

    Public replacement: none (``jax._src.hardware_utils`` reads the PCI bus).
    """
    try:
        from jax._src import hardware_utils

        return int(hardware_utils.num_available_tpu_chips_and_device_id()[0])
    except Exception:  # noqa: BLE001 - an unknown jax
        return None


# ---------------------------------------------------------------------- jax.distributed
def distributed_module() -> Any:
    """``jax._src.distributed``: ``global_state`` (the process's distributed client and service)
    and ``is_initialized``.

    Public replacement: ``jax.distributed.initialize`` does not take a service started in
    another process; jaxdist starts the service in its own process and records it in
    ``global_state``, where XLA's backends and gloo look for the client.
    """
    from jax._src import distributed

    return distributed


def xla_bridge() -> Any:
    """``jax._src.xla_bridge`` (backend factories and whether backends exist).

    Public replacement: none (backend registration is private).
    """
    from jax._src import xla_bridge as xb

    return xb


def jax_extension() -> Any:
    """``jax._src.lib._jax``: the C++ extension (distributed runtime service and client, gloo).

    Public replacement: none.
    """
    from jax._src.lib import _jax

    return _jax


__all__ = [
    "SUPPORTED",
    "all_gather_invariant",
    "autodiff_tracer_types",
    "check_version",
    "current_trace",
    "distributed_module",
    "jax_extension",
    "num_tpu_chips",
    "reduction_primitives",
    "trace_state_clean",
    "warn_if_unsupported",
    "xla_bridge",
]
