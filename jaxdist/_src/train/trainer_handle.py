"""What callbacks reach through ``self.model``: the ``Trainer`` parts Keras' ``Model`` offers.

``stop_training`` (Keras' flag: set it to end ``fit`` after the current batch),
``learning_rate`` (read and set at run time), ``get_weights``/``set_weights``,
``save_checkpoint_to``/``load_weights`` (orbax directories), ``run_dir`` (this run's own
directory) and ``describe_run`` (the start-up line). ``Trainer`` inherits them.

Example:
    >>> import jaxdist
    >>> import optax
    >>> from flax import nnx
    >>> trainer = jaxdist.Trainer(nnx.Linear(4, 2, rngs=nnx.Rngs(0)),
    ...                           optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
    ...                           global_batch_size=32)
    >>> trainer.learning_rate = trainer.learning_rate * 0.5
    >>> best = trainer.get_weights()
    >>> trainer.set_weights(best)
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

from jaxdist._src.train import learning_rate as lr_lib
from jaxdist._src.train import runs


@dataclasses.dataclass
class FitStatus:
    """How the current (or last) ``fit`` stands: the one record behind ``stop_training``.

    Attributes:
        stop_requested: a callback (or a preemption) asked ``fit`` to stop after the current
            batch (Keras' ``model.stop_training = True``).
        failed: ``fit`` ended with an exception (``stop_training_by_error``).
        preempted: a preemption notice stopped ``fit`` at the agreed step.

    Example:
        >>> from jaxdist._src.train.trainer_handle import FitStatus
        >>> FitStatus().stop_requested
        False
    """

    stop_requested: bool = False
    failed: bool = False
    preempted: bool = False


class TrainerHandle:
    """Mixin of ``Trainer``: the handle callbacks get as ``self.model``.

    Expects ``train_state`` (a ``TrainState``, with its one setter), ``context`` (a
    ``TrainerContext``), ``strategy``, ``logging_config``, ``should_save_summary``, ``_hook``
    and ``_status`` (a ``FitStatus``, a new one for every ``fit``) on the instance.

    Example:
        >>> from jaxdist._src.train.trainer_handle import TrainerHandle
        >>> class Trainer(TrainerHandle): ...
    """

    _run_dir: str | None = None

    # ------------------------------------------------------------------ stopping
    @property
    def stop_training(self) -> bool:
        """Keras' ``model.stop_training``: set it to ``True`` (e.g. in a callback) to end
        ``fit`` after the current batch; every ``fit`` starts with it ``False``.

        Example:
            >>> import jaxdist, optax
            >>> import numpy as np
            >>> from flax import nnx
            >>> from jaxdist.train.callbacks import LambdaCallback
            >>> trainer = jaxdist.Trainer(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1),
            ...                           global_batch_size=8)
            >>> def stop(batch, logs):
            ...     trainer.stop_training = True
            >>> x, y = np.ones((64, 4), np.float32), np.zeros((64,), np.int32)
            >>> history = trainer.fit((x, y), epochs=3, verbose=0,
            ...                       callbacks=[LambdaCallback(on_train_batch_end=stop)])
            >>> int(trainer.step)
            1
        """
        return self._status.stop_requested

    @stop_training.setter
    def stop_training(self, value: bool) -> None:
        self._status.stop_requested = bool(value)

    @property
    def stop_training_by_error(self) -> bool:
        """Whether the last ``fit`` ended with an exception (read only)."""
        return self._status.failed

    # ------------------------------------------------------------------ learning rate
    @property
    def learning_rate(self) -> float:
        """The optimizer's current learning rate (settable; no recompilation).

        Under the parameter-server strategies the optimizers run on the ps tasks: reading
        asks them, setting changes the rate every ps applies from its next push.

        Raises:
            ValueError: the optimizer was not built with ``optax.inject_hyperparams``, or the
                rate follows a schedule.
        """
        if not self._hook.local_state:
            return self._hook.get_learning_rate(self.context, self.train_state)
        value = lr_lib.get_learning_rate(self.opt_state)
        if value is None:
            raise ValueError(f"the learning rate is not readable from this optimizer; "
                             f"{lr_lib.HOW_TO_INJECT}")
        if lr_lib.is_scheduled(self.opt_state):
            raise ValueError("the learning rate follows a schedule and cannot be set; use a "
                             "constant learning rate to change it at run time")
        return value

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        state = self.train_state
        if not self._hook.local_state:
            self.train_state = self._hook.set_learning_rate(self.context, state, float(value))
            return
        self.train_state = state.replace(
            opt_state=lr_lib.set_learning_rate(state.opt_state, float(value)))

    def current_learning_rate(self) -> float | None:
        """The rate of the last update, for the logs (``None`` when it cannot be read)."""
        if not self._hook.local_state:
            return self._hook.current_learning_rate(self.context, self.train_state)
        return lr_lib.get_learning_rate(self.opt_state)

    # ------------------------------------------------------------------ weights
    def get_weights(self) -> Any:
        """The model's variables (``{"params", "rest"}``), for ``set_weights``."""
        return {"params": self._current_params(), "rest": self.rest}

    def set_weights(self, weights: Any) -> None:
        """Puts back variables from ``get_weights`` (the optimizer state is kept). Under the
        parameter-server strategies the ps tasks' variables are assigned."""
        state = self.train_state
        if not self._hook.local_state:
            state = self._hook.set_weights(self.context, state, weights["params"])
            self.train_state = state.replace(rest=weights["rest"])
            return
        self.train_state = state.replace(params=weights["params"], rest=weights["rest"])

    def save_checkpoint_to(self, path: str | os.PathLike, weights_only: bool = False) -> None:
        """Writes an orbax checkpoint into ``path`` (replacing what is there).

        Args:
            path: a directory.
            weights_only: only ``params`` and ``rest``; else the whole state and position.
        """
        from jaxdist._src.train.checkpoint import Checkpointer

        state = self.get_weights() if weights_only else \
            {**self.get_weights(), "opt_state": self.opt_state}
        meta = {"step": self.step, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                "weights_only": bool(weights_only)}
        ckpt = Checkpointer(path, keep=1)
        try:
            ckpt.save(self.step, state, meta)
        finally:
            ckpt.close()

    def load_weights(self, path: str | os.PathLike) -> None:
        """Restores the model's variables from a ``save_checkpoint_to``/``ModelCheckpoint``
        directory (the optimizer state too, when it was saved)."""
        from jaxdist._src.train.checkpoint import Checkpointer

        ckpt = Checkpointer(path, keep=1, read_only=True)
        try:
            step = ckpt.latest_step()
            if step is None:
                raise FileNotFoundError(f"load_weights: no checkpoint in {os.fspath(path)}")
            like = {**self.get_weights(), "opt_state": self.opt_state}
            try:
                state, meta = ckpt.restore(step, like=like)
            except Exception:  # noqa: BLE001 - a weights-only checkpoint has no opt_state
                state, meta = ckpt.restore(step, like=self.get_weights())
        finally:
            ckpt.close()
        self.set_weights(state)
        if "opt_state" in state:
            self.train_state = self.train_state.replace(opt_state=state["opt_state"])

    def close_checkpointer(self) -> None:
        """Releases the checkpoint directory (before ``BackupAndRestore`` deletes it)."""
        ckpt = getattr(self, "_checkpointer", None)
        if ckpt is not None:
            ckpt.close()
            self._checkpointer = None

    # ------------------------------------------------------------------ runs
    @property
    def run_dir(self) -> str | None:
        """This run's own directory (created on first use; ``None`` without ``log_dir`` or on
        a process that does not write summaries)."""
        if self._run_dir is None and self.should_save_summary:
            logging = self.logging_config
            if logging.dir is not None:
                self._run_dir = runs.new_run_dir(logging.dir, logging.run_name)
        return self._run_dir

    def describe_run(self) -> str:
        """The start-up line: strategy, replicas, devices, processes, output directory."""
        strategy = self.strategy
        devices = list(strategy.extended.worker_devices)
        kinds = sorted({d.platform for d in devices})
        procs = jax.process_count()
        out = self.run_dir or "nowhere (no log_dir)"
        return (f"jaxdist: {type(strategy).__name__} with {strategy.num_replicas_in_sync} "
                f"replica(s) on {len(devices)} {'/'.join(kinds)} device(s), {procs} "
                f"process(es); writing to {out}")


__all__ = ["FitStatus", "TrainerHandle"]
