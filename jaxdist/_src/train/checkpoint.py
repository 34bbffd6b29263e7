"""Checkpoints with orbax-checkpoint: atomic, the last K kept, resumable (TF's BackupAndRestore).

A checkpoint holds the training state (model parameters, other model state, optimizer state) and
a small JSON record of where training was: the global step, the epoch and the step inside it
(the data position), and the seed. orbax writes each checkpoint to a temporary directory and
renames it when complete, so a process killed mid-save leaves the previous checkpoint intact;
a save that fails (a full or read-only disk) removes that temporary directory and raises
``CheckpointWriteError`` saying the bytes needed and free, and on a short disk the checkpoints
beyond ``keep`` go before the write (never the newest complete one).

Example:
    >>> import jax.numpy as jnp
    >>> from jaxdist.train import Checkpointer
    >>> ckpt = Checkpointer("run/ckpt", keep=3)
    >>> state = {"params": {"w": jnp.ones(3)}, "step": jnp.int32(100)}
    >>> ckpt.save(100, state, {"epoch": 1, "step_in_epoch": 78})
    >>> state, meta = ckpt.restore_latest(like=state)
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxdist._src.compat.filesystem import MARGIN_BYTES, free_bytes

#: How orbax names the temporary directory of a checkpoint it is writing (``<step>`` + this).
ORBAX_TMP_MARK = ".orbax-checkpoint-tmp"
ORBAX_THREAD_WAIT_S = 60.0  # how long a failed save waits for orbax's other writer threads


class CheckpointMismatchError(ValueError):
    """A checkpoint that does not fit: another model, or other settings (exit 2 from the CLI).

    ``exit_code`` is 2 for the CLI: the config must change before the job can run.
    """

    exit_code = 2


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full, read-only or failing disk): what was
    written of it was removed and the earlier checkpoints are intact. The message says how
    many bytes it needed and how many were free.

    Attributes:
        needed: bytes of the arrays it holds (orbax may compress them).
        free: bytes free on the checkpoint directory's filesystem afterwards (``None``:
            unknown).
    """

    def __init__(self, message: str, needed: int, free: int | None):
        super().__init__(message)
        self.needed, self.free = needed, free


class CheckpointDirError(ValueError):
    """A checkpoint directory that cannot be created or written (exit 2 from the CLI).

    ``exit_code`` is 2 for the CLI: the config must change before the job can run.
    """

    exit_code = 2


def check_checkpoint_dir(directory: str | os.PathLike, create: bool = False) -> str:
    """Checks that the chief can write checkpoints into ``directory``: it is a writable
    directory, or can be created (its nearest existing parent is a writable directory);
    creates it when ``create``. Returns its absolute path.

    Raises:
        CheckpointDirError: one line naming the path and what was expected.

    Example:
        >>> from jaxdist._src.train.checkpoint import check_checkpoint_dir
        >>> check_checkpoint_dir("run/ckpt")                  # can be created
        '/.../run/ckpt'
        >>> _ = open("file", "w").close()
        >>> check_checkpoint_dir("file/ckpt")
        Traceback (most recent call last):
            ...
        jaxdist._src.train.checkpoint.CheckpointDirError: checkpoint.dir 'file/ckpt' cannot be
        created: /.../file is a file; \
expected a directory, or a path where one can be created
    """
    path = os.path.abspath(os.fspath(directory))
    shown = f"checkpoint.dir {os.fspath(directory)!r}"
    expected = "expected a directory, or a path where one can be created"
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        problem = "is a file" if existing == path else f"cannot be created: {existing} is a file"
        raise CheckpointDirError(f"{shown} {problem}; {expected}")
    if not _writable(existing):
        where = "" if existing == path else f" (its parent {existing} is not)"
        raise CheckpointDirError(
            f"{shown} is not writable{where}; expected a directory this process can write "
            f"checkpoints into")
    if create:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise CheckpointDirError(f"{shown} cannot be created: {e.strerror or e}; "
                                     f"{expected}") from None
    return path


def _join_new_orbax_threads(before: set[threading.Thread], timeout: float) -> None:
    """Waits (at most ``timeout`` seconds in all) for the threads orbax started since
    ``before`` was taken: after one writer fails, the others still run for a while."""
    deadline = time.monotonic() + timeout
    for t in threading.enumerate():
        if t in before or t is threading.current_thread():
            continue
        if not type(t).__module__.startswith("orbax"):
            continue
        # threading's own join: orbax's thread class re-raises its writer's error from join().
        threading.Thread.join(t, max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            logging.getLogger(__name__).warning(
                "orbax thread %r still runs %.0f s after a failed save; removing the partial "
                "checkpoint anyway", t.name, timeout)
            return


def _writable(directory: str) -> bool:
    """Whether a file can be created in ``directory`` (tried: root ignores mode bits but not
    read-only mounts)."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _shapes_with_paths(tree: Any) -> list[tuple[str, tuple[int, ...]]]:
    leaves = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: hasattr(x, "shape") and not isinstance(x, dict))[0]
    return [("/".join(_key_name(k) for k in path), tuple(int(d) for d in leaf.shape))
            for path, leaf in leaves if hasattr(leaf, "shape")]


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
        self.keep = int(keep)
        if not read_only:
            check_checkpoint_dir(directory, create=True)
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
        needed = sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(state))
        self._make_room(int(step), needed)
        before = set(threading.enumerate())
        try:
            self._manager.save(
                int(step),
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta))
                ),
                force=True,
            )
            self._manager.wait_until_finished()
        except Exception as e:
            # One of orbax's writer threads failed; the others may still be writing into the
            # temporary directory: wait for them, or the removal races their writes.
            _join_new_orbax_threads(before, timeout=ORBAX_THREAD_WAIT_S)
            self._remove_partial()
            free = free_bytes(self.directory)
            kept = self.all_steps()
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            if len(first) > 400:  # orbax's messages name the OS error last
                first = f"{first[:200]} ... {first[-200:]}"
            raise CheckpointWriteError(
                f"could not write checkpoint {int(step)} under {self.directory}: {first}; "
                f"it holds {needed} bytes of arrays, {free} bytes are free; the partial "
                f"checkpoint was removed and "
                f"{f'step {kept[-1]} is still the newest' if kept else 'there is no other'}"
                f"; free space on that disk, keep fewer checkpoints, or save elsewhere",
                needed, free) from e

    def _remove_partial(self) -> list[str]:
        """Deletes orbax's temporary directories (``<step>.orbax-checkpoint-tmp*``): what a
        failed or killed save left (only the chief saves, and saves do not overlap)."""
        removed = []
        try:
            names = os.listdir(self.directory)
        except OSError:
            return removed
        for name in names:
            if ORBAX_TMP_MARK in name:
                path = os.path.join(self.directory, name)
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        return removed

    def _make_room(self, step: int, needed: int) -> None:
        """When the disk has less free space than ``needed``: deletes leftovers of failed
        saves, then the oldest checkpoints orbax would delete after saving ``step`` (beyond the
        newest ``keep``), never the newest complete one, until there is room."""
        free = free_bytes(self.directory)
        if free is None or free >= needed + MARGIN_BYTES:
            return
        self._remove_partial()
        steps = self.all_steps()
        newest = steps[-1] if steps else None
        ranked = sorted({*steps, step}, reverse=True)
        beyond = [s for s in reversed(ranked[self.keep:]) if s not in (step, newest)]
        for old in beyond:
            free = free_bytes(self.directory)
            if free is None or free >= needed + MARGIN_BYTES:
                return
            self._manager.delete(old)

    def check_compatible(self, step: int, like: Any, what: str = "model") -> None:
        """Raises ``CheckpointMismatchError`` if checkpoint ``step`` holds arrays of other
        shapes (or other arrays) than ``like``: one line naming the first difference.

        Example:
            >>> import jax.numpy as jnp
            >>> from jaxdist.train import Checkpointer
            >>> ckpt = Checkpointer("run/ckpt")
            >>> state = {"w": jnp.ones(3)}
            >>> ckpt.save(1, state, {})
            >>> ckpt.check_compatible(ckpt.latest_step(), state)   # raises if they differ
        """
        from pathlib import Path

        try:
            handler = self._ocp.StandardCheckpointHandler()
            stored_tree = handler.metadata(Path(self.directory) / str(int(step)) / "state")
            stored_tree = getattr(stored_tree, "tree", stored_tree)
        except Exception:  # noqa: BLE001 - no metadata to compare: restore will tell
            return
        if stored_tree is None:
            return
        stored, here = _shapes_with_paths(stored_tree), _shapes_with_paths(like)
        fix = "use another checkpoint.dir or checkpoint.resume=false"
        where = f"the checkpoint in {self.directory} was written for another {what}"
        if len(stored) == len(here):
            for (_, a), (name, b) in zip(stored, here):
                if a != b:
                    raise CheckpointMismatchError(
                        f"{where}: {name} has {a} there and {b} here; {fix}")
            return
        there = {n for n, _ in stored}
        missing = [n for n, _ in here if n not in there]
        detail = f"; {missing[0]} is not in it" if missing else ""
        raise CheckpointMismatchError(
            f"{where}: it holds {len(stored)} arrays and this {what} has {len(here)}{detail}; "
            f"{fix}")

    def restore(self, step: int, like: Any = None, what: str = "model"
                ) -> tuple[Any, dict[str, Any]]:
        """Reads checkpoint ``step``.

        Args:
            step: which checkpoint.
            like: a pytree with the structure, shapes and placements to restore into (e.g.
                the current state); ``None`` gives nested dicts of arrays as stored.
            what: what ``like`` is, for the mismatch message.

        Returns:
            ``(state, meta)``.

        Raises:
            CheckpointMismatchError: the checkpoint does not fit ``like``.
        """
        if like is not None:
            self.check_compatible(step, like, what)
        ocp = self._ocp
        target = None
        if like is not None and self._process_local:
            # Read host arrays, then place them as ``like`` is placed (across processes).
            target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), like)
        elif like is not None:
            target = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like
            )
        try:
            out = self._manager.restore(
                int(step),
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
                ),
            )
        except (ValueError, KeyError, TypeError) as e:
            if like is None:
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointMismatchError(
                f"the checkpoint in {self.directory} (step {step}) does not fit this {what}: "
                f"{first[:300]}; use another checkpoint.dir or checkpoint.resume=false"
            ) from None
        state = out.state
        if like is not None and self._process_local:
            state = jax.tree.map(lambda v, x: jax.device_put(np.asarray(v), x.sharding),
                                 state, like)
        return state, dict(out.meta)

    def restore_latest(self, like: Any = None, what: str = "model"
                       ) -> tuple[Any, dict[str, Any]] | None:
        """``restore(latest_step())``, or ``None`` when the directory has no checkpoint."""
        step = self.latest_step()
        if step is None:
            return None
        return self.restore(step, like, what)

    def is_final(self, step: int) -> bool:
        """Whether ``step`` ends a finished run: not recorded here (the Trainer's checkpoints
        end at the step its config computes), so always False."""
        return False

    def close(self) -> None:
        self._manager.close()
