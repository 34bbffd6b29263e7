"""The default strategy: what ``get_strategy()`` returns outside every scope (a pass-through)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxdist._src.strategies.reduce_util import ReduceOp
from jaxdist._src.strategies.replica_context import ReplicaContext
from jaxdist._src.strategies.strategy import Strategy, StrategyExtended


class _DefaultExtended(StrategyExtended):
    plain_run = False  # its run_compiled calls fn as it is

    def __init__(self, strategy):
        super().__init__(strategy, (jax.local_devices()[0],))

    def placement_mesh(self):
        return None

    def place(self, tree):
        return tree

    def run_compiled(self, fn: Callable, args=(), kwargs=None) -> Any:
        return fn(*args, **(kwargs or {}))

    def reduce_leaf(self, op, v, axis):
        if axis is None:
            return v
        return jnp.mean(v, axis=axis) if op is ReduceOp.MEAN else jnp.sum(v, axis=axis)

    def reduce_to(self, reduce_op, value, destinations=None, options=None):
        from jaxdist._src.strategies import context as ctx_lib

        ReduceOp.from_value(reduce_op)
        ctx_lib.require_cross_replica_or_default_context(self._container_strategy)
        return self._to_destination(value, destinations)

    def broadcast_to(self, tensor, destinations):
        from jaxdist._src.strategies import context as ctx_lib

        ctx_lib.require_cross_replica_or_default_context(self._container_strategy)
        return tensor

    def update(self, var, fn, args=(), kwargs=None, group=True):
        self._check_not_mixing()
        return fn(var, *args, **(kwargs or {}))


class DefaultStrategy(Strategy):
    """The strategy in effect outside every ``scope()``: one replica, ``run(fn)`` calls ``fn``.

    Example:
        >>> import jaxdist
        >>> jaxdist.get_strategy().run(lambda x: x + 1, args=(1,))
        2
    """

    #: TF's replica context of this strategy runs a merge function in place: a merge_call
    #: inside control flow is allowed (only TF's mirrored replica threads refuse it).
    merge_call_checks_control_flow = False

    _is_default_strategy = True

    def __init__(self):
        super().__init__(_DefaultExtended(self))
        #: The replica context outside every strategy: what ``get_replica_context()`` returns
        #: when no strategy's scope is entered.
        self.default_replica_context = ReplicaContext(self, None)

    def scope(self):
        """A no-op for the contexts (as in TF); raises inside another strategy's scope.

        Example:
            >>> import jaxdist
            >>> with jaxdist.get_strategy().scope():
            ...     jaxdist.get_replica_context() is not None
            True
        """
        from jaxdist._src.strategies.context import DefaultStrategyScope

        return DefaultStrategyScope(self)

    def experimental_distribute_dataset(self, dataset, options=None):
        """The default strategy distributes nothing: the dataset is returned as it is."""
        del options
        return dataset

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        from jaxdist._src.input.options import InputContext

        del options
        return dataset_fn(InputContext())

    def experimental_local_results(self, value):
        return (value,)

    def gather(self, value, axis):
        return value

    def experimental_distribute_values_from_function(self, value_fn):
        from jaxdist._src.strategies.strategy import ValueContext

        return value_fn(ValueContext(0, 1))

    def __repr__(self) -> str:
        return "DefaultStrategy()"


_default: DefaultStrategy | None = None
_lock = threading.Lock()


def get_default_strategy() -> DefaultStrategy:
    """The process-wide default strategy singleton."""
    global _default
    if _default is None:
        with _lock:
            if _default is None:
                _default = DefaultStrategy()
    return _default
