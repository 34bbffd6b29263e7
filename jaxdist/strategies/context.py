"""The strategy context stack: ``scope``, ``get_strategy``, replica and cross-replica contexts.

As in tf.distribute, a thread is in one of three states:

* default replica context: no strategy scope entered; ``get_strategy()`` is the default strategy
  and ``get_replica_context()`` its (single) replica context;
* cross-replica context: inside ``strategy.scope()``; ``get_replica_context()`` is ``None``;
* replica context: inside the function passed to ``strategy.run``; ``get_replica_context()``
  gives the ``ReplicaContext`` with ``all_reduce``, ``all_gather`` and the replica id.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxdist.strategies.replica_context import ReplicaContext
    from jaxdist.strategies.strategy import Strategy


class _Frame:
    __slots__ = ("strategy", "replica_context")

    def __init__(self, strategy: Strategy, replica_context: ReplicaContext | None):
        self.strategy = strategy
        self.replica_context = replica_context


class _State(threading.local):
    def __init__(self):
        self.stack: list[_Frame] = []


_state = _State()


def _top() -> _Frame | None:
    return _state.stack[-1] if _state.stack else None


def get_strategy() -> Strategy:
    """Returns the current strategy: the innermost ``scope()``, else the default strategy.

    Example:
        >>> with jaxdist.MirroredStrategy().scope():
        ...     jaxdist.get_strategy().num_replicas_in_sync
        8
    """
    frame = _top()
    if frame is None:
        from jaxdist.strategies.default import get_default_strategy

        return get_default_strategy()
    return frame.strategy


def has_strategy() -> bool:
    """True inside the scope of (or a replica function of) a non-default strategy.

    Example:
        >>> jaxdist.has_strategy()
        False
        >>> with jaxdist.MirroredStrategy().scope():
        ...     jaxdist.has_strategy()
        True
    """
    frame = _top()
    if frame is None:
        return False
    from jaxdist.strategies.default import DefaultStrategy

    return not isinstance(frame.strategy, DefaultStrategy)


def in_cross_replica_context() -> bool:
    """True inside ``strategy.scope()`` but not inside a function run by ``strategy.run``.

    Example:
        >>> with strategy.scope():
        ...     jaxdist.in_cross_replica_context()
        True
        >>> strategy.run(lambda: print(jaxdist.in_cross_replica_context()))  # False
    """
    frame = _top()
    return frame is not None and frame.replica_context is None


def get_replica_context() -> ReplicaContext | None:
    """The current ``ReplicaContext``; ``None`` in a cross-replica context.

    Outside every scope this is the default strategy's replica context (one replica), as in TF.

    Example:
        >>> def step(x):
        ...     ctx = jaxdist.get_replica_context()
        ...     return ctx.all_reduce("SUM", x) / ctx.num_replicas_in_sync
        >>> strategy.run(step, args=(per_replica_x,))
    """
    frame = _top()
    if frame is None:
        from jaxdist.strategies.default import get_default_strategy

        return get_default_strategy()._default_replica_context
    return frame.replica_context


def get_cross_replica_context() -> Strategy | None:
    """The strategy if in a cross-replica context, else ``None``.

    Example:
        >>> with strategy.scope():
        ...     jaxdist.get_cross_replica_context() is strategy
        True
    """
    frame = _top()
    if frame is None:
        from jaxdist.strategies.default import get_default_strategy

        return get_default_strategy()
    return frame.strategy if frame.replica_context is None else None


@contextlib.contextmanager
def enter_scope(strategy: Strategy) -> Iterator[None]:
    """Pushes a cross-replica frame for ``strategy`` (used by ``Strategy.scope``)."""
    frame = _top()
    if frame is not None and frame.strategy is not strategy:
        from jaxdist.strategies.default import DefaultStrategy

        if not isinstance(frame.strategy, DefaultStrategy):
            raise ValueError(
                f"Mixing different distribution strategies is not allowed: tried to enter the "
                f"scope of {strategy!r} inside the scope of {frame.strategy!r}. Leave the outer "
                f"scope first."
            )
    if frame is not None and frame.replica_context is not None:
        raise RuntimeError(
            f"Cannot enter {strategy!r}.scope() inside a replica function (strategy.run): "
            f"create state in the cross-replica context."
        )
    _state.stack.append(_Frame(strategy, None))
    try:
        yield
    finally:
        _state.stack.pop()


@contextlib.contextmanager
def enter_replica(strategy: Strategy, replica_context: Any) -> Iterator[None]:
    """Pushes a replica frame while a replica function is traced."""
    _state.stack.append(_Frame(strategy, replica_context))
    try:
        yield
    finally:
        _state.stack.pop()
