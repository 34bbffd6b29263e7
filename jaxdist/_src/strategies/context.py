"""The strategy context stack: ``scope``, ``get_strategy``, replica and cross-replica contexts.

As in tf.distribute, a thread is in one of three states:

* default replica context: no strategy scope entered; ``get_strategy()`` is the default strategy
  and ``get_replica_context()`` its (single) replica context;
* cross-replica context: inside ``strategy.scope()``; ``get_replica_context()`` is ``None``;
* replica context: inside the function passed to ``strategy.run``; ``get_replica_context()``
  gives the ``ReplicaContext`` with ``all_reduce``, ``all_gather`` and the replica id.

This module is the stack alone and imports no strategy; ``get_strategy`` and
``get_replica_context``, which fall back to the default strategy, are in
``jaxdist._src.strategies.current``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol


class StrategyLike(Protocol):
    """What the context stack and a replica context need of a strategy (``Strategy`` is one).

    Typed by this protocol, the modules below ``strategy.py`` name no strategy class, so no
    import (not even one for type checkers) points back up at it.
    """

    _is_default_strategy: bool

    @property
    def extended(self) -> Any: ...

    @property
    def num_replicas_in_sync(self) -> int: ...

    def scope(self) -> Any: ...


class ReplicaContextLike(Protocol):
    """What the context stack keeps of a replica context (``ReplicaContext`` is one)."""

    @property
    def num_replicas_in_sync(self) -> Any: ...


class _Frame:
    __slots__ = ("strategy", "replica_context", "merged_from")

    def __init__(self, strategy: StrategyLike, replica_context: ReplicaContextLike | None):
        self.strategy = strategy
        self.replica_context = replica_context
        self.merged_from: ReplicaContextLike | None = None


class _State(threading.local):
    def __init__(self):
        self.stack: list[_Frame] = []
        self.global_scope: StrategyScope | None = None


state = _State()


def top() -> _Frame | None:
    return state.stack[-1] if state.stack else None


def current_strategy() -> StrategyLike | None:
    """The strategy of the innermost scope (or replica function), ``None`` outside every scope.

    ``get_strategy()`` (``jaxdist._src.strategies.current``) falls back to the default strategy.

    Example:
        >>> from jaxdist._src.strategies.context import current_strategy
        >>> current_strategy() is None
        True
    """
    frame = top()
    return None if frame is None else frame.strategy


def has_strategy() -> bool:
    """True inside the scope of (or a replica function of) a non-default strategy.

    Example:
        >>> import jaxdist
        >>> jaxdist.has_strategy()
        False
        >>> with jaxdist.MirroredStrategy().scope():
        ...     jaxdist.has_strategy()
        True
    """
    frame = top()
    return frame is not None and not frame.strategy._is_default_strategy


def in_cross_replica_context() -> bool:
    """True inside ``strategy.scope()`` but not inside a function run by ``strategy.run``.

    Example:
        >>> import jax, jaxdist
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:1])
        >>> with strategy.scope():
        ...     jaxdist.in_cross_replica_context()
        True
        >>> _ = strategy.run(lambda: print(jaxdist.in_cross_replica_context()))
        False
    """
    frame = top()
    return frame is not None and frame.replica_context is None


def get_cross_replica_context() -> StrategyLike | None:
    """The strategy if in a cross-replica context, else ``None``.

    As in TF, this is ``None`` outside every scope (the default replica context) and inside a
    replica function; it is the strategy inside ``strategy.scope()`` and inside a
    ``merge_call``'s merge function.

    Example:
        >>> import jax, jaxdist
        >>> jaxdist.get_cross_replica_context() is None
        True
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
        >>> with strategy.scope():
        ...     jaxdist.get_cross_replica_context() is strategy
        True
    """
    frame = top()
    if frame is None:
        return None
    return frame.strategy if frame.replica_context is None else None


def mixing_error(current: StrategyLike, wanted: StrategyLike) -> RuntimeError:
    return RuntimeError(
        f"Mixing different tf.distribute.Strategy objects: {current!r} is not {wanted!r}. "
        f"Use {wanted!r} outside the scope of {current!r} (or inside its own scope)."
    )


def require_cross_replica_or_default_context(strategy: StrategyLike) -> None:
    """Raises unless ``strategy``'s cross-replica methods may be called here (TF's rule).

    They may be called in the default replica context (outside every scope) and in
    ``strategy``'s own cross-replica context (its ``scope()`` or a ``merge_call``).

    Raises:
        RuntimeError: inside another strategy's scope ("Mixing different
            tf.distribute.Strategy objects"), inside a merge function of the default strategy
            ("Need to be inside ``with strategy.scope()``"), or in a replica context
            ("Method requires being in cross-replica context").

    Example:
        >>> import jax, jaxdist
        >>> from jaxdist._src.strategies.context import require_cross_replica_or_default_context
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
        >>> require_cross_replica_or_default_context(strategy)   # outside any scope: fine
    """
    frame = top()
    if frame is None:
        return
    if frame.replica_context is None and frame.strategy is strategy:
        return
    if frame.strategy is not strategy:
        if not has_strategy():
            raise RuntimeError(
                f'Need to be inside "with strategy.scope()" for {strategy!r}: the current '
                f"context is the default strategy's cross-replica context (a merge_call)."
            )
        raise mixing_error(frame.strategy, strategy)
    raise RuntimeError(
        f"Method requires being in cross-replica context, use "
        f"get_replica_context().merge_call(): {strategy!r} was called inside its own replica "
        f"function (strategy.run)."
    )


class StrategyScope:
    """The object ``strategy.scope()`` returns: a context manager that may be re-entered.

    Entering it while the same strategy is already the current cross-replica context only
    counts the nesting (as TF's ``_CurrentDistributionContext``); entering it inside another
    strategy's scope raises TF's mixing error; entering it inside the strategy's own replica
    function raises TF's cross-replica error.

    Example:
        >>> import jax, jaxdist
        >>> scope = jaxdist.MirroredStrategy(jax.devices()[:2]).scope()
        >>> with scope:
        ...     with scope:          # nested re-entry of the same object is allowed
        ...         pass
    """

    def __init__(self, strategy: StrategyLike, on_enter: Any = None):
        self._strategy = strategy
        self._on_enter = on_enter
        self._same_scope_again = 0
        self._pushed: list[tuple[_Frame, Any]] = []

    def __enter__(self) -> StrategyLike:
        if has_strategy():
            require_cross_replica_or_default_context(self._strategy)
            self._same_scope_again += 1
            return self._strategy
        frame = _Frame(self._strategy, None)
        state.stack.append(frame)
        extra = None
        try:
            if self._on_enter is not None:
                extra = self._on_enter()
                extra.__enter__()
        except BaseException:
            state.stack.remove(frame)
            raise
        self._pushed.append((frame, extra))
        return self._strategy

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._same_scope_again > 0:
            self._same_scope_again -= 1
            return
        frame, extra = self._pushed.pop()
        try:
            if extra is not None:
                extra.__exit__(exc_type, exc, tb)
        finally:
            if state.stack and state.stack[-1] is frame:
                state.stack.pop()
            else:
                if frame in state.stack:
                    state.stack.remove(frame)
                raise RuntimeError(
                    f"Strategy scope nesting error: the scope of {self._strategy!r} was exited "
                    f"while an inner scope was still open; exit scopes in reverse order."
                )


#: ``fn(strategy) -> context manager | None``: contexts every ``scope()`` enters after the
#: placement context. ``jaxdist/__init__.py`` registers Keras's, so that this package imports
#: nothing above it (``jaxdist.keras`` sits above ``strategies``).
SCOPE_HOOKS: list[Callable[[Any], Any]] = []


def register_scope_hook(hook: Callable[[Any], Any]) -> None:
    """Makes every ``strategy.scope()`` also enter ``hook(strategy)`` (when not ``None``).

    Example:
        >>> from jaxdist._src.strategies.context import SCOPE_HOOKS, register_scope_hook
        >>> hook = lambda strategy: None          # a hook that never adds a context
        >>> register_scope_hook(hook)
        >>> SCOPE_HOOKS.remove(hook)             # (a hook stays for the process otherwise)
    """
    if hook not in SCOPE_HOOKS:
        SCOPE_HOOKS.append(hook)


class DefaultStrategyScope:
    """``scope()`` of the default strategy: a no-op for the contexts, as in TF.

    Raises:
        RuntimeError: entered inside another strategy's scope ("Must not nest
            tf.distribute.Strategy scopes").

    Example:
        >>> import jaxdist
        >>> with jaxdist.get_strategy().scope():
        ...     jaxdist.get_replica_context() is not None
        True
    """

    def __init__(self, strategy: StrategyLike):
        self._strategy = strategy
        self._entered: list[list[Any]] = []

    def __enter__(self) -> StrategyLike:
        if has_strategy():
            raise RuntimeError(
                f"Must not nest tf.distribute.Strategy scopes: the default strategy's scope was "
                f"entered inside the scope of {current_strategy()!r}."
            )
        # Hooks learn of the default scope: Keras's hook returns a context that places nothing
        # (model.fit takes a jaxdist.Dataset inside it, as TF's default strategy takes
        # tf.data); it is entered with this scope and left with it.
        entered: list[Any] = []
        try:
            for hook in SCOPE_HOOKS:
                extra = hook(self._strategy)
                if extra is not None:
                    extra.__enter__()
                    entered.append(extra)
        except BaseException:
            for extra in reversed(entered):
                extra.__exit__(*sys.exc_info())
            raise
        self._entered.append(entered)
        return self._strategy

    def __exit__(self, exc_type, exc, tb) -> None:
        for extra in reversed(self._entered.pop() if self._entered else []):
            extra.__exit__(exc_type, exc, tb)
        return None


def experimental_set_strategy(strategy: StrategyLike | None) -> None:
    """Sets ``strategy`` as the current strategy of this thread, without a ``with`` block.

    ``tf.distribute.experimental_set_strategy``: equivalent to entering ``strategy.scope()``
    and never leaving it; ``None`` leaves the scope set before. A strategy set this way is
    replaced by the next call.

    Raises:
        RuntimeError: called inside a ``strategy.scope()`` ("Must not be called inside a
            `tf.distribute.Strategy` scope").

    Example:
        >>> import jaxdist
        >>> jaxdist.experimental_set_strategy(jaxdist.MirroredStrategy())
        >>> jaxdist.in_cross_replica_context()
        True
        >>> jaxdist.experimental_set_strategy(None)
    """
    old = state.global_scope
    if old is not None:
        old.__exit__(None, None, None)
        state.global_scope = None
    if has_strategy():
        raise RuntimeError(
            "Must not be called inside a `tf.distribute.Strategy` scope: leave the scope of "
            f"{current_strategy()!r} first."
        )
    if strategy is not None:
        scope = strategy.scope()
        scope.__enter__()
        state.global_scope = scope


@contextlib.contextmanager
def enter_replica(strategy: StrategyLike, replica_context: Any) -> Iterator[None]:
    """Pushes a replica frame while a replica function is traced."""
    state.stack.append(_Frame(strategy, replica_context))
    try:
        yield
    finally:
        state.stack.pop()


@contextlib.contextmanager
def enter_merge(strategy: StrategyLike, replica_context: Any = None) -> Iterator[None]:
    """Pushes a cross-replica frame for a ``merge_call``'s merge function.

    ``replica_context`` is the context ``merge_call`` was called from (inside a compiled replica
    function it carries the replica axes, so cross-replica reductions there can all-reduce).
    """
    frame = _Frame(strategy, None)
    frame.merged_from = replica_context
    state.stack.append(frame)
    try:
        yield
    finally:
        state.stack.pop()


def merged_from() -> Any:
    """The replica context whose ``merge_call`` is running (``None`` elsewhere)."""
    frame = top()
    return None if frame is None else frame.merged_from
