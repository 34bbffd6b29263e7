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
import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
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
_CARRY_MISMATCH = "carry input and carry output must have equal types"
_BRANCH_MISMATCH = "branches must have equal output types"
#: Retries of one loop at most: each retry casts at least one more carry leaf, so a loop of n
#: leaves needs at most n; the cap only bounds a pathological body.
_MAX_LOOP_RETRIES = 64


def _aval_varying(aval: Any) -> frozenset:
    mat = getattr(aval, "mat", None)
    if mat is not None and hasattr(mat, "varying"):
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()) or ())


def _varying_of(value: Any) -> frozenset:
    try:
        return _aval_varying(jax.typeof(value))
    except TypeError:  # not an array-like leaf
        return frozenset()


def _cast_varying(value: Any, axes: Iterable[str]) -> Any:
    missing = tuple(a for a in axes if a not in _varying_of(value))
    return jax.lax.pcast(value, missing, to="varying") if missing else value


class _LoopFrame:
    """One loop call being traced: its initial carry leaves, in order, and which of them the
    body made varying (``grew``), as JAX's promotion hook reports them."""

    __slots__ = ("leaves", "cursor", "grew")

    def __init__(self, leaves: list) -> None:
        self.leaves = leaves
        self.cursor = 0
        self.grew: set[int] = set()

    def saw(self, in_val: Any, grew: bool) -> None:
        # JAX calls the hook once per carry leaf, in order, with the leaves themselves; a call
        # for another loop (one entered through a reference bound before the patch) is ignored.
        if self.cursor < len(self.leaves) and in_val is self.leaves[self.cursor]:
            if grew:
                self.grew.add(self.cursor)
            self.cursor += 1


#: jaxdist's wrappers put in place of JAX's control-flow functions (``_install_carry_promotion``
#: installs them once: finding one there means they are in place).
_CARRY_WRAPPERS: weakref.WeakSet = weakref.WeakSet()

def _promotion_hook(original: Callable) -> Callable:
    def promote(in_val, in_aval, out_aval):
        val, changed = original(in_val, in_aval, out_aval)
        axes = getattr(_carry_state, "axes", None)
        if axes:
            extra = tuple(a for a in axes
                          if a in _aval_varying(out_aval) and a not in _aval_varying(in_aval))
            frames = getattr(_carry_state, "frames", None)
            if frames:
                frames[-1].saw(in_val, bool(extra))
            if extra:
                val = jax.lax.pcast(val, extra, to="varying")
                changed = True
        return val, changed

    _CARRY_WRAPPERS.add(promote)
    promote.__wrapped__ = original  # type: ignore[attr-defined]
    return promote


def _retrying_loop(original: Callable, init_name: str, init_pos: int) -> Callable:
    """``scan`` / ``while_loop`` that, inside ``carries_vary_over``, traces again until every
    carry leaf the body makes varying starts varying (a fixpoint: a delay line ``(a, b) ->
    (x_t, a)`` makes ``b`` varying only once ``a`` is). Outside it, JAX's function."""

    @functools.wraps(original)
    def loop(*args, **kwargs):
        axes = getattr(_carry_state, "axes", None)
        if not axes:
            return original(*args, **kwargs)
        args = list(args)
        if init_name in kwargs:
            init = kwargs[init_name]
        elif len(args) > init_pos:
            init = args[init_pos]
        else:
            return original(*args, **kwargs)  # JAX names the missing argument
        leaves, tree = jax.tree.flatten(init)
        forced: set[int] = set()
        frames = _carry_state.__dict__.setdefault("frames", [])
        for _ in range(_MAX_LOOP_RETRIES):
            cur = [_cast_varying(v, axes) if i in forced else v for i, v in enumerate(leaves)]
            if init_name in kwargs:
                kwargs[init_name] = jax.tree.unflatten(tree, cur)
            else:
                args[init_pos] = jax.tree.unflatten(tree, cur)
            frame = _LoopFrame(cur)
            frames.append(frame)
            try:
                return original(*args, **kwargs)
            except TypeError as e:
                new = frame.grew - forced
                if _CARRY_MISMATCH not in str(e) or not new:
                    raise
                forced |= new
            finally:
                frames.pop()
        return original(*args, **kwargs)

    _CARRY_WRAPPERS.add(loop)
    return loop


def _joining_branches(original: Callable, kind: str) -> Callable:
    """``cond`` / ``switch`` that, inside ``carries_vary_over``, casts each output to varying
    where another branch's is (the join of the branches' types) instead of failing JAX's
    "branches must have equal output types". Outside it, JAX's function."""

    def traced(fns: Sequence[Callable]) -> tuple[list[Callable], list]:
        seen: list = [None] * len(fns)

        def record(i: int, fn: Callable) -> Callable:
            @functools.wraps(fn)
            def branch(*a, **k):
                out = fn(*a, **k)
                seen[i] = [_varying_of(v) for v in jax.tree.leaves(out)]
                return out
            return branch
        return [record(i, f) for i, f in enumerate(fns)], seen

    def cast(fn: Callable, joined: list) -> Callable:
        @functools.wraps(fn)
        def branch(*a, **k):
            out = fn(*a, **k)
            leaves, tree = jax.tree.flatten(out)
            return jax.tree.unflatten(tree, [_cast_varying(v, j) if j else v
                                             for v, j in zip(leaves, joined)])
        return branch

    def call(fns: list[Callable], build: Callable, *args, **kwargs):
        axes = getattr(_carry_state, "axes", None)
        if not axes or not fns or not all(callable(f) for f in fns):
            return original(*build(fns), *args, **kwargs)
        recorded, seen = traced(fns)
        try:
            return original(*build(recorded), *args, **kwargs)
        except TypeError as e:
            if (_BRANCH_MISMATCH not in str(e) or any(s is None for s in seen)
                    or len({len(s) for s in seen}) != 1):
                raise
            joined = [frozenset().union(*col) & frozenset(axes) for col in zip(*seen)]
            if all(s == joined for s in seen):
                raise  # the branches differ in more than the replica axes
            return original(*build([cast(f, joined) for f in fns]), *args, **kwargs)

    if kind == "cond":
        @functools.wraps(original)
        def cond(pred, true_fun, false_fun, *operands, **kwargs):
            return call([true_fun, false_fun], lambda fs: (pred, *fs), *operands, **kwargs)
        wrapper = cond
    else:
        @functools.wraps(original)
        def switch(index, branches, *operands, **kwargs):
            return call(list(branches), lambda fs: (index, fs), *operands, **kwargs)
        wrapper = switch
    _CARRY_WRAPPERS.add(wrapper)
    return wrapper


def _install_carry_promotion() -> bool:
    """Puts jaxdist's loop-carry and branch-join wrappers in place (once, for good).

    ``lax.scan`` and ``lax.while_loop`` (and so ``fori_loop``, ``lax.map``, flax's ``nn.scan``
    / ``nn.RNN`` and ``nnx.scan``) trace their body, then call
    ``jax._src.lax.control_flow.loops._promote_weak_typed_input`` per carry leaf with the
    initial value, its type and the body's output type; where it reports a change they trace
    the body again with the new initial values. Inside ``carries_vary_over(axes)`` the hook
    also casts an initial carry to varying over those axes when the body's output carry varies
    over them (``jax.lax.pcast(init, axes, to="varying")``, what JAX's error message asks the
    user to write), and ``scan`` / ``while_loop`` trace again while that second trace still
    finds a carry made varying through another one. ``cond`` / ``switch`` cast a branch's
    output to varying where another branch's output is. Elsewhere each is JAX's function.
    Returns whether the hooks are in place.

    Public replacement: none (JAX asks for the cast by hand; pmap and ``check_vma=False`` do not
    type the carry at all).
    """
    try:
        import jax._src.lax.control_flow as control_flow
        from jax._src.lax.control_flow import conditionals, loops
    except ImportError:  # pragma: no cover - a JAX without the private modules
        return False
    original = getattr(loops, "_promote_weak_typed_input", None)
    if original is None or not all(hasattr(m, n) for m, n in (
            (loops, "scan"), (loops, "while_loop"), (conditionals, "cond"),
            (conditionals, "switch"))):  # pragma: no cover
        return False
    if original in _CARRY_WRAPPERS:
        return True
    wrapped = {
        "scan": _retrying_loop(loops.scan, "init", 1),
        "while_loop": _retrying_loop(loops.while_loop, "init_val", 2),
        "cond": _joining_branches(conditionals.cond, "cond"),
        "switch": _joining_branches(conditionals.switch, "switch"),
    }
    for module in (loops, conditionals, control_flow, jax.lax):
        for name, fn in wrapped.items():
            if getattr(module, name, None) is getattr(fn, "__wrapped__", None):
                setattr(module, name, fn)
    loops._promote_weak_typed_input = _promotion_hook(original)
    return True


@contextlib.contextmanager
def carries_vary_over(axes: tuple[str, ...]) -> Iterator[bool]:
    """While tracing inside it, a ``lax.scan`` / ``while_loop`` / ``fori_loop`` carry that
    starts identical on every replica (a constant such as ``jnp.zeros``) and becomes varying over
    ``axes`` in the body starts varying instead of failing JAX's carry type check, also when it
    becomes varying only through another carry (a delay line); a ``lax.cond`` / ``switch``
    output that varies in one branch varies in all. Yields whether this JAX has the hooks
    (``_install_carry_promotion``). Thread-local; nests.
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


def jit_cache_size(jitted: Any) -> int:
    """How many executables a ``jax.jit`` function holds (one per argument signature it has
    compiled): what ``run``'s compile cache reports, and tests count to see nothing recompiled.

    Public replacement: none yet (the count is the jit wrapper's private ``_cache_size()``;
    ``jax.stages`` exposes one ``lower``/``compile`` at a time, not what a jit has cached).

    Example:
        >>> import jax
        >>> from jaxdist._src.compat.jax_internals import jit_cache_size
        >>> f = jax.jit(lambda x: x + 1)
        >>> _ = f(1.0)
        >>> jit_cache_size(f)
        1
    """
    return jitted._cache_size()


__all__ = [
    "SUPPORTED",
    "all_gather_invariant",
    "autodiff_tracer_types",
    "carries_vary_over",
    "check_version",
    "current_trace",
    "distributed_module",
    "jax_extension",
    "jit_cache_size",
    "num_tpu_chips",
    "reduction_primitives",
    "trace_state_clean",
    "warn_if_unsupported",
    "xla_bridge",
]
