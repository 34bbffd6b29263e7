"""Side-car evaluation: an ``evaluator`` task evaluates each new checkpoint the chief writes.

TensorFlow's ``SidecarEvaluator`` (and the evaluator task of ``train_and_evaluate``): a process
outside the training cluster (``TF_CONFIG`` task type ``evaluator``; it never joins
``jax.distributed``) runs the same ``python -m jaxdist.train --config ...`` command as the
training tasks. Instead of training, it polls ``checkpoint.dir``, restores the newest complete
checkpoint into the configured model on its own devices, evaluates the validation data and writes
``{"event": "evaluation", "step": ..., "loss": ..., "accuracy": ...}`` to its own log directory
(``metrics.jsonl`` and TensorBoard). It stops after evaluating the job's final step (the last
checkpoint ``fit`` writes), or fails with ``EvaluatorTimeoutError`` when no new checkpoint appears
within ``evaluator.idle_timeout_seconds``.

Example:
    >>> evaluator = SidecarEvaluator(  # doctest: +SKIP
    ...     trainer, (x_val, y_val), "runs/mw/ckpt", final_step=330, log_dir="runs/mw/eval")
    >>> records = evaluator.start()  # one record per checkpoint the chief writes  # doctest: +SKIP
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from jaxdist._src.cluster.errors import ClusterTimeoutError
from jaxdist._src.cluster.task_info import evaluator_task


class EvaluatorTimeoutError(ClusterTimeoutError):
    """No new checkpoint appeared within the evaluator's idle timeout."""


class SidecarEvaluator:
    """Evaluates every new checkpoint in a directory (``tf.keras.utils.SidecarEvaluator``).

    Args:
        trainer: a ``Trainer`` whose model and optimizer match the checkpoints (its state is
            the restore target; it writes nothing itself).
        data: the ``(x, y)`` pair to evaluate.
        checkpoint_dir: the chief's checkpoint directory (read only).
        final_step: stop after evaluating this step (the job's last); ``None``: run until idle.
        log_dir: where ``metrics.jsonl`` and TensorBoard files go (``None``: console only).
        poll_seconds: how often the directory is checked.
        idle_timeout_seconds: fail when no new checkpoint appears for this long.
        tensorboard: write TensorBoard event files.
        task: this task's name, for messages.
        sleep: the sleep function (tests).
        reader: where checkpoints come from (``latest_step()``, ``all_steps()``,
            ``restore(step, like)``, ``is_final(step)``, ``close()``); default: the Trainer's
            ``Checkpointer`` on ``checkpoint_dir``. ``PSCheckpointState`` reads the
            checkpoints parameter servers write; the evaluator also stops after a step the
            reader calls final.

    Example:
        >>> SidecarEvaluator(  # doctest: +SKIP
        ...     trainer, (x_val, y_val), "ckpt", final_step=100).start()
    """

    def __init__(self, trainer: Any, data: Any, checkpoint_dir: str, *,
                 final_step: int | None = None, log_dir: str | None = None,
                 poll_seconds: float = 1.0, idle_timeout_seconds: float = 600.0,
                 tensorboard: bool = True, task: str = "evaluator:0",
                 sleep: Callable[[float], None] = time.sleep, reader: Any = None):
        if poll_seconds <= 0 or idle_timeout_seconds <= 0:
            raise ValueError(f"poll_seconds={poll_seconds!r} and idle_timeout_seconds="
                             f"{idle_timeout_seconds!r}: expected positive numbers of seconds")
        self.trainer = trainer
        self.data = data
        self.checkpoint_dir = os.path.abspath(checkpoint_dir)
        self.final_step = final_step
        self.log_dir = log_dir
        self.poll_seconds = float(poll_seconds)
        self.idle_timeout_seconds = float(idle_timeout_seconds)
        self.tensorboard = tensorboard
        self.task = task
        self._sleep = sleep
        self._reader = reader
        self.last_evaluated: int | None = None

    def start(self) -> list[dict[str, Any]]:
        """Evaluates checkpoints as they appear until the final one; returns the records.

        Raises:
            EvaluatorTimeoutError: no new checkpoint within ``idle_timeout_seconds``.
        """
        from jaxdist._src.train.checkpoint import Checkpointer
        from jaxdist._src.train.metrics import MetricsLogger

        ckpt = self._reader or Checkpointer(self.checkpoint_dir, read_only=True)
        logger = MetricsLogger(self.log_dir, tensorboard=self.tensorboard, progress_bar="never")
        records: list[dict[str, Any]] = []
        until = (f"final step {self.final_step}" if self.final_step is not None
                 else "until the chief marks one final")
        logger.message(f"{self.task}: evaluating new checkpoints in {self.checkpoint_dir} "
                       f"({until})")
        idle_since = time.monotonic()
        try:
            while True:
                step = ckpt.latest_step()
                if step is not None and (self.last_evaluated is None
                                         or step > self.last_evaluated):
                    record = self._evaluate(ckpt, step, logger)
                    if record is not None:
                        records.append(record)
                        idle_since = time.monotonic()
                        if ckpt.is_final(step) or (self.final_step is not None
                                                   and step >= self.final_step):
                            logger.message(f"{self.task}: evaluated the final checkpoint "
                                           f"(step {step}); done")
                            return records
                    continue
                idle = time.monotonic() - idle_since
                if idle > self.idle_timeout_seconds:
                    seen = ("no checkpoint yet" if self.last_evaluated is None
                            else f"the last was step {self.last_evaluated}")
                    raise EvaluatorTimeoutError(
                        f"{self.task}: no new checkpoint in {self.checkpoint_dir} within "
                        f"{self.idle_timeout_seconds:g} s ({seen}; expected up to step "
                        f"{self.final_step}); is the chief still training?",
                        tasks=("chief",), timeout_seconds=self.idle_timeout_seconds)
                self._sleep(self.poll_seconds)
        finally:
            logger.close()
            ckpt.close()

    def _evaluate(self, ckpt: Any, step: int, logger: Any) -> dict[str, Any] | None:
        t = self.trainer
        try:
            state, meta = ckpt.restore(step, like=t.state)
        except (FileNotFoundError, ValueError, OSError, KeyError):
            # The chief pruned it (keep K) between listing and reading: take the next newest.
            if step in ckpt.all_steps():
                raise
            return None
        t.train_state = t.train_state.replace(params=state["params"], rest=state["rest"],
                                              opt_state=state["opt_state"])
        values = t.evaluate(self.data)
        self.last_evaluated = step
        epoch = {} if meta.get("epoch") is None else {"epoch": int(meta["epoch"])}
        return logger.write("evaluation", step, **epoch, **values)


class PSCheckpointState:
    """Serves parameter-server checkpoints to ``SidecarEvaluator`` as Trainer states.

    The parameters come from the ps shards (``jaxdist._src.ps.checkpoints``); the rest of the
    state (non-parameter model state, optimizer state) stays the evaluating Trainer's own, which
    evaluation does not use.

    Args:
        directory: the job's ``checkpoint.dir``.
        collection: the variables' collection name (the Trainer's is ``"model"``).
        steps_per_epoch: the chief's steps per epoch, to report the epoch of a step
            (``None``: records carry no epoch).

    Example:
        >>> SidecarEvaluator(  # doctest: +SKIP
        ...     trainer, (x, y), "ckpt", reader=PSCheckpointState("ckpt")).start()
    """

    def __init__(self, directory: str, collection: str = "model",
                 steps_per_epoch: int | None = None):
        from jaxdist._src.ps.checkpoints import PSCheckpointReader

        self.reader = PSCheckpointReader(directory)
        self.collection = collection
        self.steps_per_epoch = steps_per_epoch

    def latest_step(self) -> int | None:
        return self.reader.latest_step()

    def all_steps(self) -> list[int]:
        return self.reader.all_steps()

    def is_final(self, step: int) -> bool:
        return self.reader.is_final(step)

    def close(self) -> None:
        pass

    def restore(self, step: int, like: Mapping[str, Any]) -> tuple[dict[str, Any], dict]:
        params = self.reader.restore_tree(step, like["params"], self.collection)
        epoch = step // self.steps_per_epoch if self.steps_per_epoch else None
        return {**like, "params": params}, {"step": step, "epoch": epoch}


__all__ = ["EvaluatorTimeoutError", "PSCheckpointState", "SidecarEvaluator", "evaluator_task"]
