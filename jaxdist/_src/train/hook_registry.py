"""Which ``TrainerHook`` the ``Trainer`` delegates to, per strategy class.

``hook_for(strategy)`` is called once, in ``Trainer.__init__``: the hook registered for the
strategy's class (nearest in its MRO), else ``SyncHook`` (the synchronous strategies).
``ParameterServerStrategy`` gets the parameter-server hooks (``parameter_server_hook``).

Example:
    >>> import jaxdist
    >>> from jaxdist._src.train.hook_registry import hook_for
    >>> hook_for(jaxdist.MirroredStrategy())
    SyncHook()
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from jaxdist._src.train import hooks

_HOOKS: dict[type, Callable[[Any], hooks.TrainerHook]] = {}
_PS_STRATEGY_MODULE = "jaxdist._src.strategies.parameter_server"
_ps_hook_registered = False


def _register_ps_hook() -> None:
    """Registers the parameter-server hooks once ``ParameterServerStrategy`` exists (its module
    is imported): a synchronous job never imports the parameter-server packages."""
    global _ps_hook_registered
    module = sys.modules.get(_PS_STRATEGY_MODULE)
    if _ps_hook_registered or module is None:
        return
    # Between-graph training, or the ClusterCoordinator's hook when the strategy has one.
    from jaxdist._src.train.parameter_server.coordinated import parameter_server_hook

    _HOOKS.setdefault(module.ParameterServerStrategy, parameter_server_hook)
    _ps_hook_registered = True


def register_trainer_hook(strategy_class: type,
                          hook: Callable[[Any], hooks.TrainerHook]) -> None:
    """Makes the ``Trainer`` delegate to a ``TrainerHook`` for a strategy class and its subclasses.

    Example:
        >>> import jaxdist
        >>> from jaxdist.train import register_trainer_hook
        >>> from jaxdist.train import TrainerHook
        >>> class MyStrategy(jaxdist.MirroredStrategy):
        ...     pass
        >>> class MyHook(TrainerHook):
        ...     def __init__(self, strategy):
        ...         self.strategy = strategy
        >>> register_trainer_hook(MyStrategy, MyHook)  # a Trainer on MyStrategy uses MyHook
    """
    _register_ps_hook()
    _HOOKS[strategy_class] = hook


def hook_for(strategy: Any) -> hooks.TrainerHook:
    """The hook of ``strategy``'s class (nearest in its MRO), else ``SyncHook``.

    Example:
        >>> import jaxdist
        >>> from jaxdist._src.train.hook_registry import hook_for
        >>> hook_for(jaxdist.MirroredStrategy())
        SyncHook()
    """
    _register_ps_hook()
    for cls in type(strategy).__mro__:
        hook = _HOOKS.get(cls)
        if hook is not None:
            return hook(strategy)
    return hooks.SyncHook(strategy)


__all__ = ["hook_for", "register_trainer_hook"]
