"""Checkpoints with orbax-checkpoint: atomic, the last K kept, resumable (TF's BackupAndRestore).

A checkpoint holds the training state (model parameters, other model state, optimizer state) and
a small JSON record of where training was: the global step, the epoch and the step inside it
(the data position), and the seed. orbax writes each checkpoint to a temporary directory and
renames it when complete, so a process killed mid-save leaves the previous checkpoint intact.

Example:
    >>> ckpt = Checkpointer("/tmp/run/ckpt", keep=3)
    >>> ckpt.save(100, state, {"epoch": 1, "step_in_epoch": 78})
    >>> state, meta = ckpt.restore_latest(like=state)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np


class Checkpointer:
    """Saves and restores the training state in one directory.

    Args:
        directory: where the numbered checkpoint directories go (created if missing).
        keep: how many of the newest checkpoints to keep.
        read_only: only read (a worker that is not the chief, a side-car evaluator): the
            directory is neither created nor written, and ``save`` is an error.
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 3, read_only: bool = False):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.directory = os.path.abspath(os.fspath(directory))
        # In a multi-process job only the chief saves and every process restores on its own:
        # orbax must not wait at barriers for the others (it would hang without a timeout), so
        # each process is its own primary host and the only active process.
        self._process_local = jax.process_count() > 1
        me = jax.process_index()
        multiprocessing = (
            ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
            if self._process_local else ocp.options.MultiprocessingOptions()
        )
        self.read_only = read_only
        if not read_only:
            os.makedirs(self.directory, exist_ok=True)
        absl_log = logging.getLogger("absl")
        level = absl_log.level
        if read_only:  # orbax warns about each option read-only mode overrides: expected here
            absl_log.setLevel(logging.ERROR)
        try:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=False, read_only=read_only,
                enable_async_checkpointing=False,
                multiprocessing_options=multiprocessing,
            )
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        finally:
            absl_log.setLevel(level)

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or ``None``."""
        self._manager.reload()
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps of every complete checkpoint, oldest first."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: Mapping[str, Any]) -> None:
        """Writes a checkpoint for ``step`` (synchronously; atomic) and prunes old ones."""
        if self.read_only:
            raise RuntimeError(f"Checkpointer({self.directory!r}) is read-only: this process "
                               f"does not write checkpoints")
        ocp = self._ocp
        if self._process_local:
            # The state is replicated over every process's devices: save this process's copy.
            state = jax.device_get(state)
        self._manager.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta))
            ),
            force=True,
        )
        self._manager.wait_until_finished()

    def restore(self, step: int, like: Any = None) -> tuple[Any, dict[str, Any]]:
        """Reads checkpoint ``step``.

        Args:
            step: which checkpoint.
            like: a pytree with the structure, shapes and placements to restore into (e.g.
                the current state); ``None`` gives nested dicts of arrays as stored.

        Returns:
            ``(state, meta)``.
        """
        ocp = self._ocp
        target = None
        if like is not None and self._process_local:
            # Read host arrays, then place them as ``like`` is placed (across processes).
            target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), like)
        elif like is not None:
            target = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like
            )
        out = self._manager.restore(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
            ),
        )
        state = out.state
        if like is not None and self._process_local:
            state = jax.tree.map(lambda v, x: jax.device_put(np.asarray(v), x.sharding),
                                 state, like)
        return state, dict(out.meta)

    def restore_latest(self, like: Any = None) -> tuple[Any, dict[str, Any]] | None:
        """``restore(latest_step())``, or ``None`` when the directory has no checkpoint."""
        step = self.latest_step()
        if step is None:
            return None
        return self.restore(step, like)

    def is_final(self, step: int) -> bool:
        """Whether ``step`` ends a finished run: not recorded here (the Trainer's checkpoints
        end at the step its config computes), so always False."""
        return False

    def close(self) -> None:
        self._manager.close()
