"""The parts of ``Trainer.fit``'s loop: the epoch plan, the step runner, the reporting.

* ``plan_epoch`` (the epoch iterator's plan): which steps of an epoch run in which compiled
  dispatch (chunks of ``steps_per_execution`` steps, then single steps) and which chunks share
  one input block;
* ``StepRunner``: runs one chunk through the strategy's ``TrainerHook`` and advances the
  ``TrainState``'s position;
* ``FitReporter``: what happens around the steps: the logging intervals, the NaN checks, the
  epoch summaries, validation, and the callbacks' batch and epoch hooks.

``FitLoop._fit_loop`` (``jaxdist._src.train.fit_loop``, a mixin of ``Trainer``) composes them;
each is usable (and tested) alone.

Example:
    >>> from jaxdist._src.train.loop import plan_epoch
    >>> chunks, groups = plan_epoch(0, 5, 2, blocks=True, block_sizes={2: 4, 1: 1})
    >>> chunks
    [(0, 2), (2, 2), (4, 1)]
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxdist._src.train.state import TrainerContext, TrainState


class NaNLossError(RuntimeError):
    """The loss became NaN or infinite (with ``halt_on_nan``).

    Attributes:
        step: the first step whose loss is not finite.
        last_checkpoint: the step of the last good checkpoint (``None``: none written).
    """

    def __init__(self, message: str, step: int, last_checkpoint: int | None):
        super().__init__(message)
        self.step = step
        self.last_checkpoint = last_checkpoint


@dataclasses.dataclass(frozen=True)
class FitSettings:
    """What ``fit``'s loop reads of the Trainer's options, read from its config groups once,
    when ``fit`` starts (the loop itself reads no config).

    Attributes:
        steps_per_execution: steps per compiled dispatch (``TrainConfig``).
        halt_on_nan: raise ``NaNLossError`` on a NaN or inf loss (``TrainConfig``).
        log_every_steps: the logging interval (``LoggingConfig.every_steps``).
        checkpoint_dir: where checkpoints go, ``None``: none (``CheckpointConfig.dir``).
        checkpoint_every_steps: the checkpoint interval (``CheckpointConfig.every_steps``).

    Example:
        >>> from jaxdist._src.train.loop import FitSettings
        >>> FitSettings(steps_per_execution=4, halt_on_nan=True, log_every_steps=10,
        ...             checkpoint_dir=None, checkpoint_every_steps=100).log_every_steps
        10
    """

    steps_per_execution: int
    halt_on_nan: bool
    log_every_steps: int
    checkpoint_dir: str | None
    checkpoint_every_steps: int


# ---------------------------------------------------------------------- the epoch plan
def plan_epoch(start: int, stop: int, steps_per_execution: int, *, blocks: bool,
               block_sizes: Mapping[int, int]
               ) -> tuple[list[tuple[int, int]], list[list[tuple[int, int]]]]:
    """The dispatches of steps ``[start, stop)`` of an epoch.

    Returns ``(chunks, groups)``: ``chunks`` are ``(first step in the epoch, steps)``: full
    chunks of ``steps_per_execution`` steps, then single steps (at most two compiled programs,
    however the epoch length, the resume position or ``steps`` cut the epoch); ``groups``
    are consecutive chunks of one length that share an input block (up to
    ``block_sizes[length]`` chunks each; one chunk per group without ``blocks``).

    Example:
        >>> from jaxdist._src.train.loop import plan_epoch
        >>> plan_epoch(1, 4, 2, blocks=False, block_sizes={2: 1, 1: 1})
        ([(1, 2), (3, 1)], [[(1, 2)], [(3, 1)]])
    """
    k = steps_per_execution
    chunks, s = [], start
    while s < stop:
        kk = k if stop - s >= k else 1
        chunks.append((s, kk))
        s += kk
    groups: list[list[tuple[int, int]]] = []
    for chunk in chunks:
        if (blocks and groups and groups[-1][0][1] == chunk[1]
                and len(groups[-1]) < block_sizes[chunk[1]]):
            groups[-1].append(chunk)
        else:
            groups.append([chunk])
    return chunks, groups


def epoch_steps(groups: Sequence[Sequence[tuple[int, int]]], inputs: Any):
    """The epoch iterator: ``(chunk index in its block, (first step, steps), (x, y, w))`` for
    every chunk of ``groups``, ``inputs`` giving one ``(x, y, w)`` per group.

    Example:
        >>> from jaxdist._src.train.loop import epoch_steps
        >>> list(epoch_steps([[(0, 1), (1, 1)]], iter([("x", "y", "w")])))[1]
        (1, (1, 1), ('x', 'y', 'w'))
    """
    for group, xyw in zip(groups, inputs):
        for j, chunk in enumerate(group):
            yield j, chunk, xyw


# ---------------------------------------------------------------------- the step runner
@dataclasses.dataclass
class StepRunner:
    """Runs one chunk of steps through a ``TrainerHook`` and advances the position.

    Args:
        hook: the strategy's ``TrainerHook``.
        ctx: the ``TrainerContext`` the hook reads.
        steps_per_epoch: steps of an epoch (the epoch rolls over after its last step).
        blocks: whether the inputs are input blocks (``chunk`` names the chunk to run).

    Example:
        >>> from jaxdist._src.train.loop import StepRunner
        >>> from jaxdist.train import TrainState
        >>> class AddSteps:      # a hook that adds the number of steps to the "parameters"
        ...     def train_step(self, ctx, state, x, y, num_steps, w=None, chunk=0):
        ...         return state.replace(params=state.params + num_steps), {}
        >>> runner = StepRunner(AddSteps(), ctx=None, steps_per_epoch=2)
        >>> state, _ = runner.run(TrainState(0, None, None), None, None, None, first=0,
        ...                       num_steps=2)
        >>> state.params, state.step, state.epoch, state.step_in_epoch
        (2, 2, 1, 0)
    """

    hook: Any
    ctx: TrainerContext
    steps_per_epoch: int
    blocks: bool = False

    def run(self, state: TrainState, x: Any, y: Any, w: Any, first: int, num_steps: int,
            chunk: int = 0) -> tuple[TrainState, Mapping[str, Any]]:
        """Runs steps ``first .. first + num_steps`` of the current epoch; returns the new
        state (``step``, ``step_in_epoch``, ``epoch`` advanced) and the steps' statistics."""
        new, stats = self.hook.train_step(self.ctx, state, x, y, num_steps, w,
                                          chunk=chunk if self.blocks else 0)
        in_epoch, epoch = first + num_steps, new.epoch
        if in_epoch >= self.steps_per_epoch:
            epoch, in_epoch = epoch + 1, 0
        return new.replace(step=state.step + num_steps, step_in_epoch=in_epoch,
                           epoch=epoch), stats


# ---------------------------------------------------------------------- reporting
def summarize(fetched: Sequence[Mapping[str, Any]], batch_size: int, accuracy: bool,
              metric_results: Callable[[Sequence[Any]], dict[str, float]]
              ) -> dict[str, float]:
    """The mean loss, the accuracy and the metrics over fetched step statistics.

    Example:
        >>> from jaxdist._src.train.loop import summarize
        >>> summarize([{"loss": [1.0, 3.0], "correct": [2, 2], "weight": [4, 4]}], 4, True,
        ...           lambda sums: {})
        {'loss': 2.0, 'accuracy': 0.5}
    """
    losses = np.concatenate([np.asarray(f["loss"]).reshape(-1) for f in fetched])
    correct = np.concatenate([np.asarray(f["correct"]).reshape(-1) for f in fetched])
    weight = (np.concatenate([np.asarray(f["weight"]).reshape(-1) for f in fetched])
              if all("weight" in f for f in fetched) else losses.size * batch_size)
    out = {"loss": float(np.mean(losses))}
    if accuracy:
        out["accuracy"] = float(np.sum(correct) / max(float(np.sum(weight)), 1e-12))
    out.update(metric_results([  # per-step sums: add the steps up first
        jax.tree.map(lambda x: np.sum(np.asarray(x, np.float64), axis=0), f["metrics"])
        for f in fetched if "metrics" in f]))
    return out


class FitReporter:
    """The logging and callback dispatch of one ``fit``: what happens around the steps.

    It keeps the statistics of the current logging interval and epoch, checks them for NaN
    (``halt_on_nan``), writes the ``train``/``validation``/``end`` records, and calls the
    callbacks' batch and epoch hooks (the batch hooks only when a callback implements them).

    Args:
        logger: the ``MetricsLogger``.
        history: the ``History`` the records go to.
        callbacks: the ``CallbackList``.
        batch_size: the global batch size (for ``examples_per_sec``).
        accuracy: whether the accuracy is logged.
        metric_results: ``fn(summed metric stats) -> {name: value}``.
        learning_rate: ``fn() -> current learning rate or None``.
        halt_on_nan: raise ``NaNLossError`` on a NaN or inf loss.
        checkpoint_dir: named in the ``NaNLossError`` message.

    Example:
        >>> reporter = FitReporter(logger, history, cbs, batch_size=32,  # doctest: +SKIP
        ...                        accuracy=True, metric_results=lambda s: {},
        ...                        learning_rate=lambda: None)
        >>> reporter.record(stats, state)                                 # doctest: +SKIP
    """

    def __init__(self, logger: Any, history: Any, callbacks: Any, *, batch_size: int,
                 accuracy: bool, metric_results: Callable[[Sequence[Any]], dict[str, float]],
                 learning_rate: Callable[[], float | None], halt_on_nan: bool = False,
                 checkpoint_dir: str | None = None, initial_step: int = 0):
        from jaxdist._src.train import callbacks as callbacks_lib

        self.logger, self.history, self.callbacks = logger, history, callbacks
        self.batch_size, self.accuracy = batch_size, accuracy
        self.metric_results, self.learning_rate = metric_results, learning_rate
        self.halt_on_nan, self.checkpoint_dir = halt_on_nan, checkpoint_dir
        self.window: list[tuple[Any, int]] = []        # stats of the current logging interval
        self.epoch_stats: list[tuple[Any, int]] = []
        self.unchecked: list[tuple[Any, int]] = []     # stats not yet checked for NaN
        self.last_log_step, self.last_log_time = initial_step, time.perf_counter()
        self.last_train: dict[str, float] = {}
        self.last_val_step = -1
        self.last_val_version: Any = None
        cbs = callbacks.callbacks
        self.batch_logs = callbacks_lib.needs_batch_logs(cbs)
        # The batch hooks are called only when a callback implements them (the others'
        # are no-ops): no per-step calls into the callback list otherwise.
        self.on_begin, self.on_end = (
            callbacks.overrides(h) or any(h in getattr(cb, "__dict__", {}) for cb in cbs)
            for h in ("on_train_batch_begin", "on_train_batch_end"))

    def summarize(self, items: Sequence[tuple[Any, int]]) -> dict[str, float]:
        """Loss, accuracy and metrics over ``(stats, end step)`` items."""
        return summarize(jax.device_get([s for s, _ in items]), self.batch_size,
                         self.accuracy, self.metric_results)

    # ------------------------------------------------------------------ steps
    def batch_begin(self, batch: int) -> None:
        """Before a chunk whose last step in the epoch is ``batch``."""
        if self.on_begin:
            self.callbacks.on_train_batch_begin(batch)

    def record(self, stats: Any, state: TrainState, last_checkpoint: int | None = None) -> None:
        """Keeps a chunk's statistics (``state``: after it); checks the one before for NaN."""
        item = (stats, state.step)
        self.window.append(item)
        self.epoch_stats.append(item)
        if self.halt_on_nan:
            self.unchecked.append(item)
            self.check_nan(last_checkpoint, keep_last=1)

    def batch_end(self, batch: int) -> None:
        """After a chunk whose last step in the epoch is ``batch``."""
        if self.on_end:
            self.callbacks.on_train_batch_end(
                batch, self.summarize(self.epoch_stats) if self.batch_logs else {})

    def check_nan(self, last_checkpoint: int | None, keep_last: int = 0) -> None:
        """Raises ``NaNLossError`` for a NaN or inf loss in the unchecked statistics (all but
        the newest ``keep_last``, which may still be running)."""
        if not self.halt_on_nan:
            return
        while len(self.unchecked) > keep_last:
            stats, end_step = self.unchecked.pop(0)
            losses = np.asarray(jax.device_get(stats)["loss"])
            bad = np.flatnonzero(~np.isfinite(losses))
            if bad.size:
                step = end_step - len(losses) + int(bad[0]) + 1
                where = (f"the last good checkpoint is step {last_checkpoint} in "
                         f"{self.checkpoint_dir}" if last_checkpoint is not None
                         else "no checkpoint was written")
                raise NaNLossError(
                    f"loss is {losses[bad[0]]} at step {step} (halt_on_nan); {where}",
                    step, last_checkpoint)

    def log_train(self, state: TrainState) -> None:
        """Writes the ``train`` record of the current logging interval (if it has steps)."""
        if not self.window:
            return
        values = self.summarize(self.window)
        now = time.perf_counter()
        n_steps = state.step - self.last_log_step
        dt = max(now - self.last_log_time, 1e-9)
        values["examples_per_sec"] = n_steps * self.batch_size / dt
        values["step_time_ms"] = 1000.0 * dt / max(n_steps, 1)
        lr = self.learning_rate()
        if lr is not None:
            values["learning_rate"] = lr
        self.last_train = values
        self.history.records.append(self.logger.write("train", state.step, epoch=state.epoch,
                                                      **values))
        self.window.clear()
        self.last_log_step, self.last_log_time = state.step, time.perf_counter()

    # ------------------------------------------------------------------ validation, epochs
    def validate(self, state: TrainState, evaluate: Callable[[Any], dict[str, float]],
                 version: Callable[[], Any] = lambda: None) -> dict[str, float]:
        """Runs ``evaluate(callbacks)`` between the callbacks' test hooks and logs it;
        ``version()``: the parameters' version after it (``TrainerHook.state_version``)."""
        self.callbacks.on_test_begin()
        values = evaluate(self.callbacks)
        self.callbacks.on_test_end(values)
        self.last_val_version = version()
        self.history.records.append(self.logger.write("validation", state.step,
                                                      epoch=state.epoch, **values))
        self.last_val_step = state.step
        self.last_log_time = time.perf_counter()  # evaluation time is not training time
        return values

    def epoch_logs(self) -> dict[str, float] | None:
        """The epoch's summary (and the learning rate), or ``None`` when it ran no step; starts
        the next epoch's statistics."""
        if not self.epoch_stats:
            return None
        logs = self.summarize(self.epoch_stats)
        lr = self.learning_rate()
        if lr is not None:
            logs["learning_rate"] = lr
        self.epoch_stats.clear()
        return logs

    def end_epoch(self, epoch: int, num_epochs: int, logs: dict[str, float],
                  seconds: float) -> None:
        """Prints the epoch line and calls ``on_epoch_end``."""
        self.logger.end_epoch(epoch, num_epochs, logs, seconds)
        self.callbacks.on_epoch_end(epoch, logs)

    def end(self, state: TrainState, has_validation: bool) -> dict[str, Any]:
        """Writes the ``end`` record; returns its values (``on_train_end``'s logs)."""
        end = {"epoch": state.epoch, **{f"final_{k}": v for k, v in self.last_train.items()
                                        if k in ("loss", "accuracy")}}
        history = self.history.history
        if has_validation and history.get("val_loss"):
            end["val_loss"] = history["val_loss"][-1]
            if "val_accuracy" in history:
                end["val_accuracy"] = history["val_accuracy"][-1]
        self.history.records.append(self.logger.write("end", state.step, **end))
        return end


__all__ = ["FitReporter", "FitSettings", "NaNLossError", "StepRunner", "epoch_steps",
           "plan_epoch", "summarize"]
