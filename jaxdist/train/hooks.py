"""Strategy-specific parts of the ``Trainer``: where the state lives and what one step does.

The ``Trainer`` is written for the synchronous strategies (state placed by the strategy, the
optax update applied in every replica). A strategy whose state lives elsewhere (the parameter
servers of ``ParameterServerStrategy``, later the TF2 ``ClusterCoordinator``) registers a
``TrainerHook`` for its class; the ``Trainer`` then asks the hook to create the state, run a
training step, resume, checkpoint and finish, and keeps its own data order, metrics, logging,
NaN checks and evaluation. Strategies without a hook keep the ``Trainer``'s own code.

Hooks are registered by ``"module:attribute"`` strings, so registering imports nothing.

Example:
    >>> register_trainer_hook("jaxdist.strategies.parameter_server.ParameterServerStrategy",
    ...                       "jaxdist.train.ps_step:ParameterServerHook")
    >>> hook_for(jaxdist.ParameterServerStrategy())
    <jaxdist.train.ps_step.ParameterServerHook object at ...>
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import numpy as np


class TrainerHook:
    """What a strategy with its own state handling does inside ``Trainer``.

    Every method gets the ``Trainer`` (``trainer``) and may read and set its attributes
    (``params``, ``rest``, ``opt_state``, ``step``, ``epoch``, ``step_in_epoch``,
    ``last_checkpoint``). The defaults do nothing special; a subclass overrides what differs.

    Example:
        >>> class MyHook(TrainerHook):
        ...     def train_step(self, trainer, x, y, num_steps):
        ...         ...
    """

    #: Whether this task evaluates and logs validation metrics.
    should_evaluate: bool = True
    #: Whether the hook feeds its steps itself (e.g. per-worker datasets on remote workers):
    #: the ``Trainer`` then builds no batches and passes ``x = y = None`` to ``train_step``.
    owns_input: bool = False

    def optimizer_from_config(self, section: Mapping[str, Any]) -> Any:
        """The optimizer a validated ``optimizer`` config section asks for (job configs)."""
        from jaxdist.train.job import optimizer_from_config

        return optimizer_from_config(section)

    def check_config(self, cfg: Mapping[str, Any]) -> None:
        """Raises ``ConfigError`` for config values this strategy cannot run."""

    def begin_fit(self, trainer: Any, train: Any) -> None:
        """Called at the start of ``fit`` with the training data (an ``ArrayData``)."""

    def init_state(self, trainer: Any, params: Any, rest: Any) -> tuple[Any, Any, Any]:
        """Creates the training state; returns ``(params, rest, opt_state)`` for the trainer."""
        raise NotImplementedError

    def epoch_order(self, trainer: Any, num_examples: int, epoch: int) -> np.ndarray:
        """The example indices this task trains on in ``epoch``, in order."""
        from jaxdist.train import data as data_lib

        return data_lib.epoch_order(num_examples, epoch, trainer.seed, trainer.shuffle)

    def train_step(self, trainer: Any, x: Any, y: Any, num_steps: int,
                   w: Any = None) -> dict[str, Any]:
        """Runs ``num_steps`` steps on the distributed chunk ``(x, y)`` with sample weights
        ``w`` (ordered as the trainer's ``_local_rows``); returns ``{"loss", "correct",
        "weight"}`` with one entry per step (``weight``: the sum of the sample weights)."""
        raise NotImplementedError

    def current_params(self, trainer: Any) -> Any:
        """The parameters to evaluate or predict with now."""
        return trainer.params

    def resume(self, trainer: Any, steps_per_epoch: int) -> None:
        """Restores the state and position (``step``, ``epoch``, ``step_in_epoch``) from
        ``trainer.checkpoint_dir`` if there is a checkpoint."""

    def save(self, trainer: Any) -> None:
        """Checkpoints the state at ``trainer.step`` (called on every task; the hook decides)."""

    def end_training(self, trainer: Any) -> None:
        """Called when this task has run its last step, before the final checkpoint and
        evaluation."""

    def state_version(self, trainer: Any) -> Any:
        """A value that changes when the parameters change outside this task's own steps
        (``None``: they never do). The ``Trainer`` validates again at the end of ``fit`` when
        it differs from the last validation's: other workers' last pushes count."""
        return None

    def end_fit(self, trainer: Any) -> None:
        """Called at the very end of ``fit``, after the final checkpoint and evaluation."""


_HOOKS: dict[str, str | type[TrainerHook]] = {}


def register_trainer_hook(strategy_class: str, hook: str | type[TrainerHook]) -> None:
    """Uses ``hook`` for strategies of ``strategy_class`` (and its subclasses).

    Args:
        strategy_class: the class's ``"module.QualifiedName"``.
        hook: a ``TrainerHook`` subclass (or a function returning a hook), or
            ``"module:attribute"`` naming it; it is called with the strategy.
    """
    _HOOKS[strategy_class] = hook


def hook_for(strategy: Any) -> TrainerHook | None:
    """The hook registered for ``strategy``'s class (nearest in its MRO), or ``None``."""
    for cls in type(strategy).__mro__:
        hook = _HOOKS.get(f"{cls.__module__}.{cls.__qualname__}")
        if hook is None:
            continue
        if isinstance(hook, str):
            module, _, attr = hook.partition(":")
            hook = getattr(importlib.import_module(module), attr)
        return hook(strategy)
    return None


# Between-graph training (ps_step), or the ClusterCoordinator's hook when the strategy has one.
register_trainer_hook("jaxdist.strategies.parameter_server.ParameterServerStrategy",
                      "jaxdist.train.coordinator_step:parameter_server_hook")

__all__ = ["TrainerHook", "hook_for", "register_trainer_hook"]
