"""Keras ``fit`` under ``CentralStorageStrategy``: variables on the parameter device.

Inside the strategy's scope Keras creates every variable (weights, optimizer slots, metric
state) on the strategy's parameter device. Keras's JAX trainer jits one step over its whole
state, and a jitted computation runs on one set of devices, so each Keras step function of a
model whose state is central is wrapped: the state is broadcast to the compute devices, the
jitted step runs there data-parallel (the batch split over the replicas, the gradient
all-reduce inserted by XLA), and the new state is moved back to the parameter device. Between
steps exactly one copy of the state exists, on the parameter device, as in TF.

The wrapping is one of jaxdist's trainer hooks (``model_strategy.hooks``, active inside
jaxdist scopes only); models of any other kind are untouched (their step functions are Keras's
own).

Example:
    >>> import jaxdist
    >>> import numpy as np
    >>> import keras  # doctest: +NEEDS_KERAS
    >>> x, y = np.ones((32, 4), np.float32), np.ones((32, 1), np.float32)
    >>> strategy = jaxdist.CentralStorageStrategy(["/cpu:0", "/cpu:1"], "/cpu:0")
    >>> with strategy.scope():   # doctest: +NEEDS_2_DEVICES
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    ...     model.compile(optimizer="sgd", loss="mse")
    ...     history = model.fit(x, y, batch_size=8, verbose=0)  # state on /cpu:0, compute on both
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import jax
import keras
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist._src.compat import keras_internals as ki
from jaxdist._src.keras.object_registry import ObjectRegistry

_STEP_ATTRS = {
    "make_train_function": "train_function",
    "make_test_function": "test_function",
    "make_predict_function": "predict_function",
}


#: The ``CentralStorageStrategy`` whose parameter device holds each Keras variable placed there.
_CENTRAL_VARIABLES = ObjectRegistry()


def mark_central(variable: Any, strategy: Any) -> None:
    """Records that ``variable`` lives on ``strategy``'s parameter device."""
    _CENTRAL_VARIABLES.set(variable, strategy)


def central_strategy_of(model: Any) -> Any:
    """The ``CentralStorageStrategy`` holding ``model``'s variables, or ``None``.

    Example:
        >>> import jaxdist
        >>> from jaxdist._src.keras.central_storage import central_strategy_of
        >>> import keras  # doctest: +NEEDS_KERAS
        >>> strategy = jaxdist.CentralStorageStrategy()
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        ...     model.compile(optimizer="sgd", loss="mse")
        >>> central_strategy_of(model) is strategy
        True
    """
    from jaxdist._src.strategies.central_storage import CentralStorageStrategy

    dist = keras.distribution.distribution()
    strategy = getattr(dist, "strategy", None)
    if isinstance(strategy, CentralStorageStrategy):
        return strategy
    for v in getattr(model, "variables", ()):
        strategy = _CENTRAL_VARIABLES.get(v)
        if strategy is not None:
            return strategy
    return None


#: The central-storage steps made here, each with the strategy it was made for.
_CENTRAL_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _central_step_strategy(fn: Any) -> Any:
    """The strategy ``fn`` was made for, if it is a central-storage step (else ``None``)."""
    try:
        return _CENTRAL_STEPS.get(fn)
    except TypeError:  # unhashable, or no weak reference to it
        return None


def _central_step(fn: Any, strategy: Any) -> Any:
    ext = strategy.extended
    compute = NamedSharding(ext.mesh, P())
    param = ext.state_sharding

    @functools.wraps(fn)
    def step(state: Any, iterator: Any) -> Any:
        state = jax.device_put(state, compute)  # broadcast: parameter device -> replicas
        outputs, state = fn(state, iterator)
        return outputs, jax.device_put(state, param)  # one copy again, on the parameter device

    _CENTRAL_STEPS[step] = strategy
    return step


def wrap_maker(name: str, original: Any) -> Any:
    """Keras's step-function maker ``name`` (``original``), making central-storage steps for a
    model whose state is central (see the module docstring); Keras's own for any other.
    """
    attr = _STEP_ATTRS[name]

    @functools.wraps(original)
    def make(self: Any, force: bool = False) -> Any:
        if not ki.hooks_active_here():
            return original(self, force)
        strategy = central_strategy_of(self)
        if strategy is None:
            return original(self, force)
        fn = getattr(self, attr, None)
        if fn is not None and not force:
            if _central_step_strategy(fn) is strategy:
                return None
            force = True  # made for another placement: make it again
        # Keras jits with its distribution's state shardings as out_shardings; those name
        # the parameter device, the step runs on the compute devices: let jit infer them.
        token = keras.distribution.distribution()
        keras.distribution.set_distribution(None)
        try:
            original(self, force)
        finally:
            keras.distribution.set_distribution(token)
        setattr(self, attr, _central_step(getattr(self, attr), strategy))
        return None

    return make

