"""The Trainer's checkpoints: its ``CheckpointConfig`` (replaced whole, never field by field),
the ``Checkpointer`` of its directory, the record of the settings written with each checkpoint
(``run_record``), the resume at the start of the first ``fit`` and the saves.

``CheckpointWiring`` is a mixin of ``Trainer``; the strategy's ``TrainerHook`` does the
restoring and the writing (``resume``, ``save``) and returns the new ``TrainState``.

Example:
    >>> from jaxdist._src.train.checkpoint_wiring import CheckpointWiring
    >>> class Trainer(CheckpointWiring): ...
"""

from __future__ import annotations

from jaxdist._src.train import run_record
from jaxdist._src.train.checkpoint import Checkpointer
from jaxdist._src.train.options import CheckpointConfig


class CheckpointWiring:
    """Mixin of ``Trainer``: its checkpoint options, directory handle, settings record,
    resume and saves.

    Example:
        >>> trainer.save_checkpoint()   # the current state and data position  # doctest: +SKIP
    """

    def replace_checkpoint_config(self, checkpoint: CheckpointConfig) -> None:
        """Makes ``checkpoint`` the trainer's checkpoint options: the one way to change them
        (``BackupAndRestore`` returns its new ``CheckpointConfig``, built with
        ``dataclasses.replace``, and ``fit`` passes it here). A new directory gets its own
        ``Checkpointer`` and settings record.

        Raises:
            TypeError: ``checkpoint`` is not a ``CheckpointConfig``.

        Example:
            >>> import dataclasses, jaxdist, optax
            >>> from flax import nnx
            >>> trainer = jaxdist.Trainer(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1))
            >>> trainer.replace_checkpoint_config(
            ...     dataclasses.replace(trainer.checkpoint_config, every_steps=50))
            >>> trainer.checkpoint_every_steps
            50
        """
        if not isinstance(checkpoint, CheckpointConfig):
            raise TypeError(f"replace_checkpoint_config takes a jaxdist.train.CheckpointConfig, "
                            f"got {type(checkpoint).__name__}: {checkpoint!r}")
        if checkpoint.dir != self.checkpoint_config.dir:
            self.close_checkpointer()
            self._run_record = None
        self.checkpoint_config = checkpoint

    def _checkpointer_or_none(self) -> Checkpointer | None:
        if self._checkpointer is None:
            ck = self.checkpoint_config
            if ck.dir is None:
                return None
            # Only the chief writes; the other workers read it (to resume) and create nothing.
            self._checkpointer = Checkpointer(ck.dir, keep=ck.keep,
                                              read_only=not self.should_checkpoint)
        return self._checkpointer

    def _record(self, refresh: bool = False) -> run_record.RunRecord:
        """The record of the settings written with this trainer's checkpoints; ``refresh``
        (at the start of each ``fit``, which may take another batch size): with the settings
        as they are now."""
        if self._run_record is not None and not refresh:
            return self._run_record
        ck, config = self.checkpoint_config, self.config
        settings = {**run_record.trainer_settings(
            self.strategy, config.global_batch_size, config.seed, config.shuffle,
            config.precision, config.batch_norm), **(ck.settings or {})}
        if self._run_record is None:
            self._run_record = run_record.RunRecord(
                ck.dir, settings, ck.allow_changes, writer=self.should_checkpoint)
        self._run_record.settings = run_record.plain(settings)
        return self._run_record

    def _maybe_resume(self, steps_per_epoch: int) -> list[str] | None:
        """Refreshes the settings record; restores the latest checkpoint (the first ``fit``
        only) once its recorded settings match (``run_record``); returns note lines, or
        ``None`` when nothing was restored."""
        ctx = self.context
        ck = self.checkpoint_config
        if ck.dir is None:
            return None
        record = self._record(refresh=True)
        if not ck.resume or self._resumed:
            return None
        self._resumed = True  # only the first fit resumes; later calls continue in memory
        notes = record.check()   # raises SettingsChangedError before anything is restored
        fresh = self._state.opt_state
        self.train_state, self._restored_position = self._hook.resume(
            ctx, self._state, steps_per_epoch)
        if self.last_checkpoint is None:
            return None
        if not self._hook.local_state:   # the ps hooks derive the position from the step
            return notes + record.notes_after_restore(self.last_checkpoint)
        self.train_state, more = record.converted(self._state, ctx.global_batch_size,
                                                  steps_per_epoch, fresh)
        return notes + more + record.notes_after_restore(self.last_checkpoint)

    def save_checkpoint(self) -> None:
        """Writes a checkpoint of the current state and data position (chief only)."""
        ctx = self.context
        if ctx.checkpoint_dir is not None:
            self.train_state = self._hook.save(ctx, self._state, self._data_position)
            if self.last_checkpoint == self.step:
                self._record().saved(self.step, self.epoch, self.step_in_epoch)


__all__ = ["CheckpointWiring"]
