"""The functions of ``jaxdist.keras``: Keras 3 (JAX backend) under jaxdist strategies.

``require_keras`` imports Keras on the JAX backend; ``scope``, ``distribution_for`` and
``distribution_scope`` make Keras distribute variables and batches over a strategy's own mesh;
``strategy_scope_hook`` is what ``strategy.scope()`` enters once keras is imported;
``attach``, ``compile_fit_step`` and ``value_and_grad`` import their Keras-dependent modules on
first call, so that keras stays optional.

Example:
    >>> import jaxdist.keras
    >>> keras = jaxdist.keras.require_keras()
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

_INSTALL = "pip install 'jaxdist[keras]'  (or: pip install 'keras>=3.8,<4')"


def _is_default(strategy: Any) -> bool:
    """Whether ``strategy`` is the default strategy (its scope distributes nothing)."""
    from jaxdist._src.strategies.default import DefaultStrategy

    return isinstance(strategy, DefaultStrategy)


def require_keras() -> Any:
    """Imports Keras 3 and checks it runs on the JAX backend.

    Returns:
        The ``keras`` module.

    Raises:
        ImportError: Keras is not installed (the message gives the pip command).
        RuntimeError: Keras runs on another backend (set ``KERAS_BACKEND=jax`` before importing
            keras).

    Example:
        >>> import jaxdist
        >>> keras = jaxdist.keras.require_keras()
    """
    if "keras" not in sys.modules:
        chosen = os.environ.get("KERAS_BACKEND", "jax")
        if chosen != "jax":  # Keras is not loaded yet: jaxdist.keras chooses its backend
            warnings.warn(f"jaxdist.keras runs Keras on JAX: KERAS_BACKEND={chosen!r} in the "
                          f"environment is replaced by 'jax' (Keras was not imported yet)",
                          stacklevel=3)
        os.environ["KERAS_BACKEND"] = "jax"
    try:
        import keras
    except ImportError as e:
        if importlib.util.find_spec("keras") is not None:  # installed; its backend failed
            raise ImportError(
                f"jaxdist.keras could not import Keras on the backend "
                f"{os.environ.get('KERAS_BACKEND', 'jax')!r} ({type(e).__name__}: {e}): "
                f"jaxdist.keras needs the JAX backend: set KERAS_BACKEND=jax before Keras is "
                f"first imported") from e
        raise ImportError(f"jaxdist.keras needs Keras 3: {_INSTALL}") from e
    version = getattr(keras, "__version__", "0")
    if int(version.split(".")[0]) < 3:
        raise ImportError(f"jaxdist.keras needs Keras 3, found keras {version}: {_INSTALL}")
    backend = keras.backend.backend()
    if backend != "jax":
        raise RuntimeError(
            f"jaxdist.keras needs the Keras JAX backend, but Keras was already imported on "
            f"{backend!r}: set KERAS_BACKEND=jax in the environment, or import jaxdist (or "
            f"jaxdist.keras) before keras"
        )
    from jaxdist._src.compat import keras_internals  # noqa: F401  (warns: an untested Keras)

    return keras


def distribution_for(strategy: Any) -> Any:
    """The ``keras.distribution.Distribution`` that places Keras state as ``strategy`` does.

    Args:
        strategy: a synchronous jaxdist strategy (Mirrored, OneDevice, TPU).

    Returns:
        A ``keras.distribution.DataParallel`` over the strategy's own mesh.

    Example:
        >>> import jax
        >>> import jaxdist
        >>> import keras
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
        >>> with jaxdist.keras.distribution_for(strategy).scope():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    """
    require_keras()
    from jaxdist._src.keras.distribution import StrategyDistribution

    if _is_default(strategy):
        return None  # the default strategy distributes nothing (its scope enters no context)
    return StrategyDistribution(strategy)


@contextlib.contextmanager
def distribution_scope(strategy: Any) -> Iterator[Any]:
    """Only the Keras side of ``scope``: the hook a strategy's own ``scope()`` can enter.

    Does nothing (yields ``None``) when keras has not been imported, so strategies stay free of
    a keras dependency.

    Example:
        >>> import jax
        >>> import jaxdist.keras
        >>> import keras
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
        >>> with strategy.scope(), jaxdist.keras.distribution_scope(strategy):
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    """
    if "keras" not in sys.modules:
        yield None
        return
    dist = distribution_for(strategy)
    with dist.scope():
        yield dist


def strategy_scope_hook(strategy: Any) -> Any:
    """The Keras context ``strategy.scope()`` enters once keras is imported (or ``None``).

    Never imports keras and never raises: ``None`` when keras is not imported. When keras runs
    on another backend, a context in which Keras models refuse to compile or train (they would
    train undistributed; the error names ``KERAS_BACKEND=jax``). For a synchronous strategy,
    its ``StrategyDistribution``'s scope; for the default strategy, a
    ``ParameterServerStrategy`` (its Keras models are attached with ``jaxdist.keras.attach``)
    or a compile-only one, only jaxdist's trainer hooks (a model compiled there remembers its
    strategy; ``jaxdist.Dataset`` input).

    Example:
        >>> import jax
        >>> import jaxdist
        >>> import keras
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
        >>> with strategy.scope():    # enters strategy_scope_hook(strategy) after the mesh
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    """
    mod = sys.modules.get("keras")
    try:
        if mod is None:
            return None
        backend = mod.backend.backend()
    except AttributeError:  # keras is being imported right now
        return None
    if backend != "jax":
        return _other_backend_refusal(strategy, backend)
    from jaxdist._src.keras import model_strategy

    if _is_default(strategy):
        return model_strategy.hooks()  # the default strategy distributes nothing
    dist = strategy.keras_distribution
    if dist is None:
        from jaxdist._src.keras import distribution as dist_lib

        if dist_lib.unsupported_reason(strategy) is not None:
            return model_strategy.hooks()  # models remember the strategy (ps: attach check)
        dist = dist_lib.StrategyDistribution(strategy)
        strategy.keras_distribution = dist
    return dist.scope()


def _other_backend_refusal(strategy: Any, backend: str) -> Any:
    """For Keras on another backend: inside a (non-default) strategy's scope, Keras models
    refuse to compile or train (they would train this process alone, undistributed; e.g. every
    worker on its whole global batch), naming the fix. The scope itself works as without keras:
    a program that only imported keras through ``import tensorflow`` (for ``tf.data``) and
    trains with jax loses nothing."""
    if _is_default(strategy):
        return None
    from jaxdist._src.compat import keras_internals as ki

    return ki.refuse_training(
        f"Keras runs on the {backend!r} backend, and jaxdist distributes Keras models on the "
        f"JAX backend only: inside {type(strategy).__name__}.scope() this model would train on "
        f"this process alone, undistributed (with several workers each on its whole global "
        f"batch). Set KERAS_BACKEND=jax in the environment before keras is first imported "
        f"(importing tensorflow imports keras: set it before `import tensorflow`)")


@contextlib.contextmanager
def scope(strategy: Any) -> Iterator[Any]:
    """``strategy.scope()`` plus Keras: models built and fit inside train data-parallel.

    Args:
        strategy: a synchronous jaxdist strategy.

    Yields:
        The strategy.

    Example:
        >>> import jaxdist.keras
        >>> import keras
        >>> import numpy as np
        >>> x, y = np.ones((32, 4), np.float32), np.ones((32, 1), np.float32)
        >>> with jaxdist.keras.scope(jaxdist.MirroredStrategy()) as strategy:
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        ...     model.compile(optimizer="sgd", loss="mse")
        ...     history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    """
    require_keras()
    dist = distribution_for(strategy)
    with strategy.scope(), dist.scope():
        yield strategy


def compile_fit_step(model: Any, x: Any, y: Any = None, batch_size: int = 32,
                     sample_weight: Any = None, strategy: Any = None) -> Any:
    """Compiles one ``model.fit`` step for the strategy's devices without running it.

    See ``jaxdist._src.keras.compile_only.compile_fit_step``; with a compile-only
    ``TPUStrategy(topology="v5e:2x2")`` it reports the step's per-chip memory and FLOPs on a
    machine without a TPU.

    Example:
        >>> import jaxdist
        >>> import numpy as np
        >>> import keras
        >>> x, y = np.zeros((512, 784), np.float32), np.zeros((512, 10), np.float32)
        >>> with jaxdist.TPUStrategy(topology="v5e:2x2").scope():  # doctest: +NEEDS_LIBTPU
        ...     model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(10)])
        ...     model.compile(optimizer="adam", loss="mse")
        >>> print(jaxdist.keras.compile_fit_step(model, x, y, batch_size=128))
        Keras fit step (128 rows) compiled for TPU v5 lite v5e:2x2 (4 chips, 4 replicas, ...)
        per chip: memory ...
    """
    require_keras()
    from jaxdist._src.keras.compile_only import compile_fit_step as _compile

    return _compile(model, x, y, batch_size=batch_size, sample_weight=sample_weight,
                    strategy=strategy)


def attach(model: Any, strategy: Any, **kwargs: Any) -> Any:
    """Trains a compiled Keras model on parameter servers (``ParameterServerStrategy``).

    See ``jaxdist._src.keras.parameter_server.attach``.

    Example:
        >>> import jaxdist
        >>> import numpy as np
        >>> import keras
        >>> x, y = np.ones((32, 4), np.float32), np.ones((32, 1), np.float32)
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        >>> training = jaxdist.keras.attach(model, jaxdist.ParameterServerStrategy())
        >>> history = model.fit(x, y, epochs=2, verbose=0)
    """
    require_keras()
    from jaxdist._src.keras.parameter_server import attach as _attach

    return _attach(model, strategy, **kwargs)


def value_and_grad(fn: Any, variables: Any, has_aux: bool = False) -> Any:
    """The gradient line of TF's custom loop: ``fn()``'s value and its gradient w.r.t. Keras
    ``variables``.

    Example:
        >>> import jaxdist
        >>> import numpy as np
        >>> import keras
        >>> x, y = np.ones((8, 4), np.float32), np.ones((8, 1), np.float32)
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> loss_object = keras.losses.MeanSquaredError()
        >>> loss, grads = jaxdist.keras.value_and_grad(
        ...     lambda: loss_object(y, model(x, training=True)), model.trainable_variables)
    """
    require_keras()
    from jaxdist._src.keras.custom_loop import value_and_grad as _value_and_grad

    return _value_and_grad(fn, variables, has_aux=has_aux)
