"""Refuses a Keras ``fit`` that would silently train locally under ``ParameterServerStrategy``.

TF's guide builds and compiles a Keras model inside ``ParameterServerStrategy().scope()`` and
calls ``model.fit``: TF then trains it on the parameter servers. On jaxdist a Keras model
trains on the parameter servers through ``jaxdist.keras.attach(model, strategy)``; without it
``fit`` would train a local copy on this process and leave the ps untouched, a wrong result
without an error. This module makes that case fail loudly instead: a model compiled inside a
``ParameterServerStrategy`` scope (or fit inside one) raises at its first ``fit`` unless it was
attached (``attach`` installs its own train function on the model, which bypasses this check).

The guard is installed on Keras's ``JAXTrainer`` (``compile`` and ``make_train_function``) the
first time a ``ParameterServerStrategy`` scope is entered with Keras imported.

Example:
    >>> with jaxdist.ParameterServerStrategy(resolver).scope():
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    ...     model.compile(optimizer="sgd", loss="mse")
    >>> model.fit(x, y)   # RuntimeError: ... jaxdist.keras.attach(model, strategy) ...
"""

from __future__ import annotations

import functools
from typing import Any

_installed = False
_MARK = "_jaxdist_ps_compiled_in"


def _current_ps_strategy() -> Any:
    from jaxdist.strategies.current import get_strategy
    from jaxdist.strategies.parameter_server import ParameterServerStrategy

    strategy = get_strategy()
    return strategy if isinstance(strategy, ParameterServerStrategy) else None


def unattached_error(model: Any, strategy: Any) -> RuntimeError:
    """The error for ``fit`` on a model of a ``ParameterServerStrategy`` that was not attached.

    Example:
        >>> raise unattached_error(model, strategy)
    """
    return RuntimeError(
        f"Keras model {getattr(model, 'name', model)!r} was compiled (or is fit) inside "
        f"{type(strategy).__name__}.scope() but is not attached to the parameter servers: "
        f"model.fit would train a local copy on this process and leave the ps variables "
        f"unchanged. Call jaxdist.keras.attach(model, strategy) after model.compile (see "
        f"docs/parameter_server.md, 'Keras models'); to train locally on purpose, compile "
        f"the model outside the strategy's scope")


def install() -> None:
    """Wraps ``JAXTrainer.compile`` / ``make_train_function`` once (idempotent).

    Example:
        >>> install()
    """
    global _installed
    if _installed:
        return
    from keras.src.backend.jax.trainer import JAXTrainer

    original_compile = JAXTrainer.compile
    original_make = JAXTrainer.make_train_function

    @functools.wraps(original_compile)
    def compile(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original_compile(self, *args, **kwargs)
        object.__setattr__(self, _MARK, _current_ps_strategy())
        return result

    @functools.wraps(original_make)
    def make_train_function(self: Any, force: bool = False) -> Any:
        strategy = getattr(self, _MARK, None) or _current_ps_strategy()
        if strategy is not None:
            raise unattached_error(self, strategy)
        return original_make(self, force)

    JAXTrainer.compile = compile
    JAXTrainer.make_train_function = make_train_function
    _installed = True
