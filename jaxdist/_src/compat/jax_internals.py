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

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import jax

from jaxdist._src.compat.versions import outside_range

#: The JAX releases the adapters below are written for: (lowest, first unsupported).
SUPPORTED = ((0, 10, 2), (0, 12, 0))


def check_version(version: str | None = None) -> str | None:
    """``None`` for a supported JAX, else a sentence saying which range is supported.

    Example:
        >>> from jaxdist._src.compat.jax_internals import check_version
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


# ---------------------------------------------------------------------- loop carries
_carry_state = threading.local()
_carry_patch_lock = threading.Lock()


def _aval_varying(aval: Any) -> frozenset:
    mat = getattr(aval, "mat", None)
    if mat is not None and hasattr(mat, "varying"):
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()) or ())


def _install_carry_promotion() -> bool:
    """Wraps ``jax._src.lax.control_flow.loops._promote_weak_typed_input`` (once, for good).

    ``lax.scan`` and ``lax.while_loop`` (and so ``fori_loop``, ``lax.map``, flax's ``nn.scan``
    / ``nn.RNN`` and ``nnx.scan``) trace their body, then call that function per carry leaf
    with the initial value, its type and the body's output type; where it reports a change they
    trace the body again with the new initial values. Inside ``carries_vary_over(axes)`` the
    wrapper also casts an initial carry to varying over those axes when the body's output
    carry varies over them (``jax.lax.pcast(init, axes, to="varying")``, what JAX's error
    message asks the user to write); elsewhere it is JAX's function. Returns whether it is in
    place.

    Public replacement: none (JAX asks for the cast by hand; pmap and ``check_vma=False`` do not
    type the carry at all).
    """
    try:
        from jax._src.lax.control_flow import loops
    except ImportError:  # pragma: no cover - a JAX without the private module
        return False
    original = getattr(loops, "_promote_weak_typed_input", None)
    if original is None:  # pragma: no cover
        return False
    if getattr(original, "_jaxdist_carry_promotion", False):
        return True

    def promote(in_val, in_aval, out_aval):
        val, changed = original(in_val, in_aval, out_aval)
        axes = getattr(_carry_state, "axes", None)
        if axes:
            extra = tuple(a for a in axes
                          if a in _aval_varying(out_aval) and a not in _aval_varying(in_aval))
            if extra:
                val = jax.lax.pcast(val, extra, to="varying")
                changed = True
        return val, changed

    promote._jaxdist_carry_promotion = True  # type: ignore[attr-defined]
    promote.__wrapped__ = original  # type: ignore[attr-defined]
    loops._promote_weak_typed_input = promote
    return True


@contextlib.contextmanager
def carries_vary_over(axes: tuple[str, ...]) -> Iterator[bool]:
    """While tracing inside it, a ``lax.scan`` / ``while_loop`` / ``fori_loop`` carry that
    starts identical on every replica (a constant such as ``jnp.zeros``) and becomes varying over
    ``axes`` in the body starts varying instead of failing JAX's carry type check. Yields
    whether this JAX has the hook (``_install_carry_promotion``). Thread-local; nests.

    A carry component that becomes varying only through another component (a delay line:
    ``(a, b) -> (x_t, a)``) needs more than the one extra trace JAX makes; such a loop still
    fails with JAX's message, whose fix (``jax.lax.pcast(init, axis, to="varying")``) works.
    """
    with _carry_patch_lock:
        ok = _install_carry_promotion()
    previous = getattr(_carry_state, "axes", None)
    _carry_state.axes = tuple(axes)
    try:
        yield ok
    finally:
        _carry_state.axes = previous


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
    "carries_vary_over",
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
