"""``Trainer.fit``'s epochs: the loop that composes the epoch plan, the step runner and the
reporter of ``jaxdist._src.train.loop`` with the trainer's inputs, checkpoints, preemption and
callbacks.

``FitLoop`` is a mixin of ``Trainer``. The state lives in ``train_state`` between steps, so
callbacks that change it (the learning rate, ``set_weights``) take effect; a stop requested
through ``stop_training`` ends the loop after the current batch.

Example:
    >>> from jaxdist._src.train.fit_loop import FitLoop
    >>> class Trainer(FitLoop): ...
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from jaxdist._src.train import data as data_lib
from jaxdist._src.train import inputs as inputs_lib
from jaxdist._src.train import loop as loop_lib


class FitLoop:
    """Mixin of ``Trainer``: the epochs of ``fit`` (``_fit_loop``) and their steps
    (``_run_epoch``).

    Example:
        >>> trainer._fit_loop(train, val, total, spe, 1, logger, history, cbs, 1)  # doctest: +SKIP
    """

    def _run_epoch(self, settings: loop_lib.FitSettings, train: Any, total: int, spe: int,
                   num_epochs: int,
                   runner: loop_lib.StepRunner, reporter: loop_lib.FitReporter, logger: Any,
                   cbs: Any, blocks: bool, block_sizes: Mapping[int, int]) -> bool:
        """Runs the steps of the current epoch up to its end, ``total`` steps or a stop;
        returns whether a stream ran out before the epoch's end."""
        order = (None if isinstance(train, inputs_lib.StreamSource)
                 else self._epoch_order(len(train), self.epoch))
        start = self.step_in_epoch
        cbs.on_epoch_begin(self.epoch)
        logger.begin_epoch(self.epoch, num_epochs, min(spe, start + total - self.step), start)
        chunks, groups = loop_lib.plan_epoch(
            start, min(spe, start + (total - self.step)), settings.steps_per_execution,
            blocks=blocks, block_sizes=block_sizes)
        positions: list[Any] = []
        ran_out = [False]
        timer = self._dispatch_timer
        inputs = self._epoch_inputs(train, order, chunks, groups, block_sizes, blocks,
                                    positions, ran_out)
        try:
            for j, (s, kk), (xb, yb, wb) in loop_lib.epoch_steps(groups, inputs):
                if self._preemption is not None and self._preemption.should_stop(self.step, kk):
                    self._status.preempted = True
                    break
                if positions:
                    self._data_position = positions.pop(0)
                reporter.batch_begin(s + kk - 1)
                before = self.step
                if timer is not None:
                    timer.before()
                self.train_state, stats = runner.run(self._state, xb, yb, wb, s, kk, chunk=j)
                if timer is not None and timer.count < 2:
                    timer.after(stats, kk)
                reporter.record(stats, self._state, self.last_checkpoint)
                logger.advance(kk)
                crossed = lambda every: self.step // every > before // every  # noqa: B023
                if crossed(settings.log_every_steps) or self.step >= total:
                    reporter.check_nan(self.last_checkpoint)
                    reporter.log_train(self._state)
                if settings.checkpoint_dir is not None and crossed(
                        settings.checkpoint_every_steps):
                    reporter.check_nan(self.last_checkpoint)
                    self.save_checkpoint()
                reporter.batch_end(s + kk - 1)
                if self.stop_training:
                    break
        finally:
            inputs.close()
        return ran_out[0]

    def _fit_loop(self, settings: loop_lib.FitSettings, train, val, total, spe, validation_freq,
                  logger, history, cbs, num_epochs) -> None:
        """The epochs of ``fit``: the epoch plan and inputs, the step runner, the reporter
        (``jaxdist._src.train.loop``). The state lives in ``self._state`` between steps, so
        callbacks that change it (the learning rate, ``set_weights``) take effect."""
        hook, ctx = self._hook, self.context
        reporter = loop_lib.FitReporter(
            logger, history, cbs, batch_size=ctx.global_batch_size, accuracy=self.accuracy,
            metric_results=self._metric_results, learning_rate=self.current_learning_rate,
            halt_on_nan=settings.halt_on_nan, checkpoint_dir=settings.checkpoint_dir,
            initial_step=self.step)
        cbs.on_train_begin()
        # With a hook that takes input blocks, consecutive chunks of the same length share
        # one block (one host-to-device transfer for several dispatches).
        blocks = hook.input_blocks and not hook.owns_input
        block_sizes = self._block_sizes(train, spe, settings.steps_per_execution)
        runner = loop_lib.StepRunner(hook, ctx, spe, blocks)

        def validate() -> dict[str, float]:
            return reporter.validate(
                self._state, lambda callbacks: self.evaluate(val, callback_list=callbacks),
                lambda: hook.state_version(self.context, self._state))

        while self.step < total and not self.stop_training:
            epoch_start_time = time.perf_counter()
            ran_out = self._run_epoch(settings, train, total, spe, num_epochs, runner, reporter,
                                      logger, cbs, blocks, block_sizes)
            if self._status.preempted:
                reporter.log_train(self._state)
                saved = settings.checkpoint_dir is None or self.last_checkpoint == self.step
                self._preemption.finish(self.step, (lambda: None) if saved
                                        else self.save_checkpoint,
                                        is_chief=self.should_checkpoint)
                self.stop_training = True  # a custom exit_fn returned: fit stops here
                return
            if ran_out:  # a stream ended before the epoch length it announced
                if self.step_in_epoch == 0 and not reporter.epoch_stats:
                    raise data_lib.DataError(
                        f"train_data ran out of data at step {self.step} (epoch "
                        f"{self.epoch}); pass a repeating dataset or fewer steps/epochs")
                if total != self.step and self.step_in_epoch < spe:
                    total -= spe - self.step_in_epoch   # the epoch was shorter: as many epochs
                    spe = runner.steps_per_epoch = self.step_in_epoch
                self.train_state = self._state.replace(epoch=self.epoch + 1, step_in_epoch=0)
            reporter.check_nan(self.last_checkpoint)
            if self.step_in_epoch == 0 or self.stop_training:  # the epoch ended
                logs = reporter.epoch_logs()
                if logs is not None:
                    if val is not None and validation_freq and self.epoch % validation_freq == 0:
                        logs.update({f"val_{k}": v for k, v in validate().items()})
                    ended = self.epoch - 1 if self.step_in_epoch == 0 else self.epoch
                    reporter.end_epoch(ended, num_epochs, logs,
                                       time.perf_counter() - epoch_start_time)
        self.train_state = hook.end_training(self.context, self._state)
        reporter.log_train(self._state)
        if settings.checkpoint_dir is not None and self.last_checkpoint != self.step:
            self.save_checkpoint()
        # With parameter servers, other workers may push after this task's last validation.
        changed = hook.state_version(self.context, self._state) != reporter.last_val_version
        if val is not None and (reporter.last_val_step != self.step or changed):
            history.add("val_", validate())
        end = reporter.end(self._state, val is not None)
        hook.end_fit(self.context, self._state)
        cbs.on_train_end(end)


__all__ = ["FitLoop"]
