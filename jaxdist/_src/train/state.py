"""The explicit state contract between the ``Trainer`` and its ``TrainerHook``.

``TrainState`` is the training state (a frozen dataclass): the model's parameters, its other
variables, the optimizer state and the position (``step``, ``epoch``, ``step_in_epoch``,
``last_checkpoint``). A hook gets it as an argument and returns the new one; it never assigns
an attribute of the ``Trainer``.

``TrainerContext`` is what a hook may read besides the state (a frozen dataclass the
``Trainer`` builds): the strategy, the optimizer, the loss, the batch size, the data order's
seed, where checkpoints go, the split model, the compiled replica step and the random streams.

Example:
    >>> from jaxdist.train import TrainState
    >>> state = TrainState(params={"w": 1.0}, rest={}, opt_state=None)
    >>> state.replace(step=3).step
    3
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jaxdist._src.train import keras_metrics


@dataclasses.dataclass(frozen=True)
class TrainState:
    """The training state a ``TrainerHook`` takes and returns (``params``, ``rest``, ``opt_state``,
    ``step``, ``epoch``, ...), a frozen dataclass.

    Attributes:
        params: the model's ``nnx.Param`` variables (placed by the strategy; under the
            parameter-server strategies the last pulled copy).
        rest: the model's other variables (e.g. ``BatchNorm``'s running statistics).
        opt_state: the optax state (``None`` when the optimizer runs elsewhere, on ps tasks).
        step: steps run so far (the global step).
        epoch: the current epoch.
        step_in_epoch: steps of the current epoch run so far.
        last_checkpoint: the step of the last checkpoint written or restored (``None``: none).

    Example:
        >>> from jaxdist.train import TrainState
        >>> s = TrainState(params={"w": 1.0}, rest={}, opt_state=None)
        >>> s.replace(step=s.step + 1).step
        1
    """

    params: Any
    rest: Any
    opt_state: Any
    step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    last_checkpoint: int | None = None

    def replace(self, **changes: Any) -> TrainState:
        """A copy with ``changes`` applied (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def checkpoint_meta(self) -> dict[str, int]:
        """The position written with a checkpoint (``step``, ``epoch``, ``step_in_epoch``)."""
        return {"step": self.step, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch}


@dataclasses.dataclass(frozen=True)
class TrainerContext:
    """What a ``TrainerHook`` reads of its Trainer (strategy, optimizer, loss, batch size,
    checkpoint settings, the compiled step).

    Attributes:
        strategy: the distribution strategy.
        optimizer: the optax optimizer (a ``jaxdist.ps.optimizers`` spec on parameter servers).
        loss_fn: ``(logits, labels) -> per-example loss``.
        global_batch_size: examples per step over all replicas (``None`` until ``fit`` knows).
        seed: seed of the data order.
        shuffle: whether the data order is reshuffled every epoch.
        checkpoint_dir: where checkpoints go (``None``: none).
        keep_checkpoints: how many checkpoints are kept.
        should_checkpoint: whether this task writes checkpoints (the chief).
        batch_norm: ``"sync"`` or ``"per_replica"``.
        model_state: the split model (``ModelState``: graph definition, random streams).
        compute_dtype: mixed precision's compute dtype, or ``None``.
        metric_specs: the ``(logged name, metric, weighted)`` triples of the metrics.
        rngs: the model's random streams, placed by the strategy.
        train_replica: the synchronous replica step (``strategy.run``'s function).
        checkpointer: ``() -> Checkpointer | None``: the trainer's checkpoint directory handle.

    Example:
        >>> trainer.context.global_batch_size      # doctest: +SKIP
        64
    """

    strategy: Any
    optimizer: Any
    loss_fn: Callable[..., Any]
    global_batch_size: int | None
    seed: int
    shuffle: bool
    checkpoint_dir: str | None
    keep_checkpoints: int
    should_checkpoint: bool
    batch_norm: str
    model_state: Any
    compute_dtype: Any
    metric_specs: Sequence[Any]
    rngs: Any
    train_replica: Callable[..., Any] | None = None
    checkpointer: Callable[[], Any] = lambda: None

    def metric_stats(self, logits: Any, y: Any, mask: Any, w: Any = None) -> dict[str, Any]:
        """``{"metrics": {name: sums}}`` of one replica's rows (``keras_metrics.metric_sums``)."""
        return keras_metrics.metric_sums(self.metric_specs, logits, y, mask, w)

    def replace(self, **changes: Any) -> TrainerContext:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


__all__ = ["TrainState", "TrainerContext"]
