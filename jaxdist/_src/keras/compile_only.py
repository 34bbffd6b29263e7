"""Compiling a Keras model's ``fit`` step for a strategy's devices without running it.

Keras's JAX trainer jits ``model.train_step(state, data)`` with the state replicated and each
batch split over the replicas (``StrategyDistribution``); ``compile_fit_step`` compiles that
same function with those shardings from shapes alone. With a compile-only
``TPUStrategy(topology="v5e:2x2")`` the TPU compiler reports the step's per-chip memory and
FLOPs on a machine without a TPU.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def compile_fit_step(model: Any, x: Any, y: Any = None, batch_size: int = 32,
                     sample_weight: Any = None, strategy: Any = None) -> Any:
    """Compiles one ``model.fit`` training step of ``batch_size`` rows without running it.

    Args:
        model: a compiled Keras model (``model.compile(...)``).
        x: example features (arrays, dicts or lists of arrays, or ``jax.ShapeDtypeStruct``):
            only the shape of a row and the dtype are read.
        y: example targets, read the same way.
        batch_size: the global batch of one step (split over the replicas).
        sample_weight: example sample weights (or ``None``).
        strategy: the strategy to compile for (default: the one the model was compiled under,
            else the current one).

    Returns:
        A ``jaxdist.tpu.CompileReport`` (per-device memory and FLOPs).

    Raises:
        ValueError: the model is not compiled, no strategy is known, or ``batch_size`` does not
            split over the replicas.

    Example:
        >>> import numpy as np
        >>> import keras, jaxdist.keras  # doctest: +NEEDS_KERAS
        >>> x, y = np.zeros((512, 784), np.float32), np.zeros((512, 10), np.float32)
        >>> strategy = jaxdist.TPUStrategy(topology="v5e:2x2")  # doctest: +NEEDS_LIBTPU
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(10)])
        ...     model.compile(optimizer="adam", loss="mse")
        >>> print(jaxdist.keras.compile_fit_step(model, x, y, batch_size=128))
        Keras fit step (128 rows) compiled for TPU v5 lite v5e:2x2 (4 chips, 4 replicas, ...)
        per chip: memory ...
    """
    from jaxdist._src.compat import keras_internals as ki
    from jaxdist._src.keras.model_strategy import current_strategy, strategy_of
    from jaxdist._src.strategies.compile_report import compile_global

    if not getattr(model, "compiled", False):
        raise ValueError(f"Keras model {getattr(model, 'name', model)!r} is not compiled: call "
                         f"model.compile(optimizer=..., loss=...) first")
    strategy = strategy or strategy_of(model) or current_strategy()
    if strategy is None:
        raise ValueError("no strategy to compile for: compile the model inside "
                         "strategy.scope() or pass strategy=")
    n = strategy.num_replicas_in_sync
    if batch_size < 1 or batch_size % n:
        raise ValueError(f"batch_size={batch_size} does not split over the {n} replicas of "
                         f"{strategy!r}; expected a positive multiple of {n}")

    def batch(a: Any) -> Any:
        if a is None:
            return None
        return jax.ShapeDtypeStruct((batch_size, *tuple(np.shape(a))[1:]), np.dtype(a.dtype))

    leaf = lambda v: isinstance(v, jax.ShapeDtypeStruct)  # noqa: E731
    data = jax.tree.map(batch, (x, y, sample_weight), is_leaf=leaf)
    if sample_weight is None:
        data = data[:2] if y is not None else data[:1]
    # Builds the layers, optimizer, loss and metrics as fit would: inside the strategy's scope,
    # so their variables are placed as the strategy keeps state (host memory when
    # compile-only).
    with strategy.scope():
        ki.symbolic_build(model, data)
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables] if model.optimizer is not None else [],
        [v.value for v in model.metrics_variables],
    )
    train_step = type(model).train_step

    def step(state: Any, data: Any) -> Any:
        return train_step(model, state, data)

    return compile_global(strategy, step, state, data,
                          what=f"Keras fit step ({batch_size} rows)")


__all__ = ["compile_fit_step"]
