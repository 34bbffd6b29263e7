"""Parameter-server checkpoints: the file format, writing, reading, confinement, pruning.

``ParameterService.save`` / ``restore`` gather and rebuild a task's variables and call
``write_task_checkpoint`` / ``read_task_checkpoint`` here; ``checkpoint_directory`` keeps a
requested directory under the server's checkpoint root.

``strategy.extended.save(directory, step)`` makes every ps write its shards to
``directory/ps-<i>/ckpt-<step>/state.jdw`` and then the chief writes ``directory/checkpoint``
naming the step every ps saved. ``PSCheckpointReader`` reassembles a pytree of variables from
those files (shards of a partitioned leaf are concatenated on axis 0) without any ps running.

Example:
    >>> import jaxdist
    >>> import jax.numpy as jnp
    >>> import numpy as np
    >>> from jaxdist.ps import PSCheckpointReader
    >>> strategy = jaxdist.ParameterServerStrategy()   # no TF_CONFIG: trains locally
    >>> with strategy.scope():
    ...     params = strategy.create_variables(lambda: {"w": jnp.ones(3)})
    >>> _ = strategy.extended.save("ckpt", 7)
    >>> reader = PSCheckpointReader("ckpt")
    >>> step = reader.latest_step()
    >>> reader.restore_tree(step, like={"w": np.zeros(3, np.float32)}, collection="variables")
    {'w': array([1., 1., 1.], dtype=float32)}
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import threading
import uuid
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from jaxdist._src.compat.filesystem import MARGIN_BYTES, free_bytes
from jaxdist._src.ps.errors import (
    PSCheckpointWriteError,
    PSError,
    PSInvalidArgumentError,
    PSNotFoundError,
)
from jaxdist._src.ps.variables import leaf_names
from jaxdist._src.transport import wire

CHECKPOINT_POINTER = "checkpoint"  # written by the chief under the checkpoint directory
_TASK_DIR = re.compile(r"ps-\d+|local")
_PART = re.compile(r"(.+)/part_(\d+)")


class PSCheckpointReader:
    """Read-only view of the ps checkpoints in ``directory``.

    Args:
        directory: the directory passed to ``strategy.extended.save`` (``checkpoint.dir``).
    """

    def __init__(self, directory: str):
        self.directory = os.path.abspath(directory)

    def _pointer(self) -> dict[str, Any] | None:
        try:
            with open(os.path.join(self.directory, CHECKPOINT_POINTER)) as f:
                data = json.load(f)
            return {"step": int(data["step"]), "final": bool(data.get("final", False))}
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def task_dirs(self) -> list[str]:
        """The per-task directories (``ps-0``, ``ps-1``, ... or ``local``) that hold checkpoints."""
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return []
        return [os.path.join(self.directory, n) for n in names
                if _TASK_DIR.fullmatch(n) and os.path.isdir(os.path.join(self.directory, n))]

    def all_steps(self) -> list[int]:
        """Steps every task directory holds a complete checkpoint of, oldest first."""
        common: set[int] | None = None
        for d in self.task_dirs():
            steps = {int(n[5:]) for n in os.listdir(d) if re.fullmatch(r"ckpt-\d+", n)}
            common = steps if common is None else common & steps
        return sorted(common or ())

    def latest_step(self) -> int | None:
        """The step the chief marked complete (``None``: no complete checkpoint yet)."""
        pointer = self._pointer()
        if pointer is None or pointer["step"] not in self.all_steps():
            return None
        return pointer["step"]

    def is_final(self, step: int) -> bool:
        """Whether ``step`` is the last checkpoint of a finished training run."""
        pointer = self._pointer()
        return pointer is not None and pointer["final"] and pointer["step"] == int(step)

    def read(self, step: int) -> dict[str, np.ndarray]:
        """Every variable (shard) of checkpoint ``step``: ``{ps key: array}``.

        Raises:
            FileNotFoundError: a task directory lacks that step (pruned or never written).
        """
        values: dict[str, np.ndarray] = {}
        dirs = self.task_dirs()
        if not dirs:
            raise FileNotFoundError(f"no ps checkpoint directories under {self.directory}")
        for d in dirs:
            path = os.path.join(d, f"ckpt-{int(step)}", "state.jdw")
            with open(path, "rb") as f:
                _, arrays = wire.decode([f.read()])
            for name, x in arrays.items():
                if name.startswith("v/"):
                    values[name[2:]] = x
        return values

    def restore_tree(self, step: int, like: Any, collection: str = "model") -> Any:
        """The variables of ``collection`` at ``step`` as a pytree shaped like ``like``.

        Raises:
            FileNotFoundError: the checkpoint is gone.
            ValueError: a leaf of ``like`` has no variable in the checkpoint, or another shape.
        """
        values = self.read(step)
        parts: dict[str, list[tuple[int, np.ndarray]]] = {}
        for key, x in values.items():
            m = _PART.fullmatch(key)
            name, index = (m.group(1), int(m.group(2))) if m else (key, 0)
            parts.setdefault(name, []).append((index, x))
        leaves, treedef = jax.tree.flatten(like)
        out = []
        for name, leaf in zip(leaf_names(like), leaves, strict=True):
            key = f"{collection}/{name}"
            if key not in parts:
                have = sorted(k for k in parts if k.startswith(f"{collection}/"))[:6]
                raise ValueError(f"checkpoint step {step} in {self.directory} has no variable "
                                 f"{key!r} (it has {have}...): expected the collection "
                                 f"{collection!r} of the same model")
            pieces = [x for _, x in sorted(parts[key], key=lambda p: p[0])]
            x = pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=0)
            if x.shape != np.shape(leaf):
                raise ValueError(f"variable {key!r} of checkpoint step {step} has shape "
                                 f"{x.shape}, expected {np.shape(leaf)}")
            out.append(x)
        return treedef.unflatten(out)


def _task_dir(directory: str, task: str) -> str:
    return os.path.join(directory, task.replace(":", "-"))


def checkpoint_directory(task: str, requested: str | None, what: str, *, confined: bool,
                         root: str | None, default: str | None) -> str | None:
    """The directory ``task`` may ``what`` (save / restore) for the ``requested`` one.

    Unconfined: ``requested`` or ``default``. Confined: ``requested`` resolved under ``root``
    (relative to it, symlinks followed) and refused unless it lies under ``root``, as is a
    task directory that is a link out of it.

    Raises:
        PSInvalidArgumentError: ``requested`` is not a string, there is no root, or the path
            resolves outside the root.

    Example:
        >>> from jaxdist._src.ps.checkpoints import checkpoint_directory
        >>> checkpoint_directory("ps:0", "run1", "save", confined=True, root="/ckpt",
        ...                      default="/ckpt")
        '/ckpt/run1'
    """
    if requested is not None and not isinstance(requested, str):
        raise PSInvalidArgumentError(
            f"{task}: {what} directory {requested!r}: expected a string path", task=task)
    if requested:
        _check_path_shape(task, requested, what)
    if not confined:
        return requested or default
    if not root:
        raise PSInvalidArgumentError(
            f"{task} refuses {what}: the server has no checkpoint root; start it with "
            f"--checkpoint_root or --checkpoint_dir (jaxdist.Server(checkpoint_root=...)) "
            f"and save under it",
            task=task)
    real_root = os.path.realpath(root)
    path = os.path.realpath(os.path.join(real_root, requested or real_root))
    if os.path.commonpath([path, real_root]) != real_root:
        raise PSInvalidArgumentError(
            f"{task} refuses {what} to {requested!r}: it resolves to {path!r}, outside "
            f"the server's checkpoint root {real_root!r} (start the server with "
            f"--checkpoint_root set to the training's checkpoint directory; under "
            f"python -m jaxdist.launch: --checkpoint-root DIR)",
            task=task)
    task_dir = _task_dir(path, task)
    if os.path.lexists(task_dir) and os.path.commonpath(
            [os.path.realpath(task_dir), real_root]) != real_root:
        raise PSInvalidArgumentError(
            f"{task} refuses {what}: {task_dir!r} is a link out of the checkpoint "
            f"root {real_root!r}", task=task)
    return path


MAX_PATH_CHARS = 1024  # a requested checkpoint directory: at most this many characters
MAX_PATH_PARTS = 64  # ... and this many path components


def _check_path_shape(task: str, requested: str, what: str) -> None:
    """Refuses a directory no checkpoint needs: too long, too deep, or with a NUL byte."""
    parts = [p for p in requested.split("/") if p]
    reason = None
    if len(requested) > MAX_PATH_CHARS:
        reason = f"it has {len(requested)} characters, more than {MAX_PATH_CHARS}"
    elif len(parts) > MAX_PATH_PARTS:
        reason = f"it has {len(parts)} path components, more than {MAX_PATH_PARTS}"
    elif "\0" in requested:
        reason = "it contains a NUL byte"
    if reason:
        raise PSInvalidArgumentError(
            f"{task} refuses {what} to {requested[:80]!r}{'...' if len(requested) > 80 else ''}"
            f": {reason}; expected a directory path of at most {MAX_PATH_CHARS} characters and "
            f"{MAX_PATH_PARTS} components", task=task)


def _open_below(task: str, task_dir: str, names: tuple[str, ...]) -> int:
    """Opens ``task_dir/names[0]/.../names[-1]`` (a regular file) without following a link.

    Each component below ``task_dir`` is opened relative to its parent with ``O_NOFOLLOW``, so
    a symbolic link planted in a task's checkpoint directory (``ckpt-<step>`` or
    ``state.jdw`` pointing out of the checkpoint root) is refused, not followed, and no
    check-then-open race lets one be swapped in. A FIFO or device is refused too (it could
    block the reader forever). Returns an open file descriptor.

    Raises:
        PSNotFoundError: a component does not exist.
        PSInvalidArgumentError: a component is a link, or the file is not a regular file.
    """
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(task_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        for i, name in enumerate(names):
            last = i == len(names) - 1
            flags = os.O_RDONLY | nofollow | (os.O_NONBLOCK if last else
                                              getattr(os, "O_DIRECTORY", 0))
            try:
                new = os.open(name, flags, dir_fd=fd)
            except FileNotFoundError:
                raise PSNotFoundError(f"{task}: checkpoint file "
                                      f"{os.path.join(task_dir, *names)} does not exist",
                                      task=task) from None
            except OSError:
                new = None
            if new is None or not (stat.S_ISREG if last else stat.S_ISDIR)(
                    os.fstat(new).st_mode):
                if new is not None:
                    os.close(new)
                link = os.path.join(task_dir, *names[:i + 1])
                raise PSInvalidArgumentError(
                    f"{task} refuses to read {link!r}: it is a symbolic link or not a "
                    f"{'regular file' if last else 'directory'}; a task's checkpoint "
                    f"directory holds only the directories and files the ps writes",
                    task=task)
            os.close(fd)
            fd = new
        return fd
    except BaseException:
        os.close(fd)
        raise


def _read_below(task: str, task_dir: str, *names: str) -> bytes:
    """The bytes of ``task_dir/names...`` read through ``_open_below`` (no link followed)."""
    with os.fdopen(_open_below(task, task_dir, names), "rb") as f:
        return f.read()


def check_keep(task: str, keep: int | None) -> None:
    """Raises ``PSInvalidArgumentError`` unless ``keep`` is ``None`` or at least 1."""
    if keep is not None and int(keep) < 1:
        raise PSInvalidArgumentError(f"{task}: keep must be >= 1 checkpoints, got "
                                     f"{keep!r}", task=task)


def write_task_checkpoint(directory: str | None, task: str, step: int,
                          variables: dict[str, dict[str, Any]], arrays: dict[str, np.ndarray],
                          markers: Iterable[str] = (), keep: int | None = None) -> str:
    """Writes ``task``'s checkpoint ``<directory>/<task>/ckpt-<step>/state.jdw`` atomically.

    The file holds ``arrays`` (``v/<key>`` values, ``s/<key>/<i>`` optimizer state leaves) and
    a header with ``variables`` (per key: kind, optimizer spec, version, number of state
    leaves), the markers and the step. It is written to a temp directory that is then renamed;
    then ``<task>/latest`` names the step, and with ``keep`` older checkpoints are pruned
    (``prune_checkpoints``). Returns the checkpoint directory.

    When the filesystem has less free space than the checkpoint needs, what pruning would
    delete after this save goes first (``make_room``): leftovers of interrupted saves, then,
    with ``keep``, the oldest checkpoints beyond ``keep``; never the newest complete one nor
    the one the chief's pointer names. A write that fails all the same (a full, read-only or
    failing disk) removes what it wrote: the earlier checkpoints stay as they were, and
    ``PSCheckpointWriteError`` says how many bytes were needed and how many are free.

    Raises:
        PSInvalidArgumentError: no ``directory``, or ``keep`` < 1.
        PSCheckpointWriteError: the checkpoint could not be written (nothing of it is left).

    Example:
        >>> import numpy as np
        >>> from jaxdist._src.ps.checkpoints import write_task_checkpoint
        >>> write_task_checkpoint("ckpt", "ps:0", 100, {"w": {"kind": "dense",
        ...     "optimizer": None, "version": 3, "num_state": 0}}, {"v/w": np.zeros(4)})
        'ckpt/ps-0/ckpt-100'
    """
    check_keep(task, keep)
    if not directory:
        raise PSInvalidArgumentError(
            f"{task}: save needs a directory (none given, and the server was started "
            f"without checkpoint_dir)",
            task=task,
        )
    task_dir = _task_dir(directory, task)
    meta: dict[str, Any] = {"step": int(step), "task": task, "variables": variables,
                            "markers": sorted(markers)}
    needed = wire.encoded_nbytes(meta, arrays)
    final = os.path.join(task_dir, f"ckpt-{int(step)}")
    tmp = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
    renamed = False
    with _task_lock(task_dir):
        try:
            os.makedirs(task_dir, exist_ok=True)
            make_room(directory, task, keep, int(step), needed)
            os.makedirs(tmp)
            with open(os.path.join(tmp, "state.jdw"), "wb") as f:
                for chunk in wire.encode(meta, arrays):
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            _remove(final)
            os.replace(tmp, final)
            renamed = True
            _atomic_write(os.path.join(task_dir, "latest"), json.dumps({"step": int(step)}))
        except BaseException as e:
            _remove(tmp)
            if renamed:  # ``latest`` could not name it: the save failed as a whole
                _remove(final)
            if isinstance(e, OSError):
                raise _write_error(task, task_dir, int(step), needed, e) from None
            raise
        if keep is not None:
            prune_checkpoints(directory, task, int(keep), just_saved=int(step))
    return final


_TASK_LOCKS: dict[str, threading.Lock] = {}
_TASK_LOCKS_GUARD = threading.Lock()


def _task_lock(task_dir: str) -> threading.Lock:
    """One lock per task directory: saves of one task in this process take turns, so a
    ``ckpt-*.tmp-*`` found while holding it is a leftover, not a save under way."""
    key = os.path.abspath(task_dir)
    with _TASK_LOCKS_GUARD:
        return _TASK_LOCKS.setdefault(key, threading.Lock())


def _write_error(task: str, task_dir: str, step: int, needed: int,
                 e: OSError) -> PSCheckpointWriteError:
    free = free_bytes(task_dir)
    latest = _complete_steps(task_dir)
    kept = (f"ckpt-{latest[0]} is still its newest complete checkpoint" if latest else
            "it has no complete checkpoint")
    space = (f"the checkpoint needs {needed} bytes, {free} are free" if free is not None
             else f"the checkpoint needs {needed} bytes")
    hint = {errno.ENOSPC: "free space on that disk, save fewer checkpoints (keep), or save "
                          "elsewhere",
            errno.EDQUOT: "raise the disk quota, save fewer checkpoints (keep), or save "
                          "elsewhere",
            errno.EROFS: "the filesystem is read-only: save elsewhere"}.get(
        e.errno, "check that disk")
    code = f" ({errno.errorcode.get(e.errno, e.errno)})" if e.errno is not None else ""
    return PSCheckpointWriteError(
        f"{task} could not write checkpoint {step} under {task_dir}: "
        f"{e.strerror or e or type(e).__name__}{code}; "
        f"{space}; the partial checkpoint was removed and {kept}; {hint}",
        task=task, needed=needed, free=free, errno=e.errno)


def _complete_steps(task_dir: str) -> list[int]:
    """The steps of the complete checkpoints in ``task_dir``, newest first."""
    try:
        names = os.listdir(task_dir)
    except OSError:
        return []
    return sorted((int(n[5:]) for n in names if re.fullmatch(r"ckpt-\d+", n)), reverse=True)


def _protected_step(directory: str) -> int | None:
    """The step the chief's pointer names (the last one every ps saved), if any."""
    try:
        with open(os.path.join(directory, CHECKPOINT_POINTER)) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def make_room(directory: str, task: str, keep: int | None, step: int, needed: int
              ) -> list[str]:
    """Before ``task`` saves ``step`` (``needed`` bytes): when its filesystem has less free,
    deletes what pruning would delete after the save, until there is room: leftovers of
    interrupted saves (``ckpt-*.tmp-*``) first, then, with ``keep``, the oldest checkpoints
    beyond the newest ``keep`` (counting ``step``). The newest complete checkpoint and the one
    the chief's pointer names are never deleted, so a save that still fails leaves one.
    Returns the deleted paths.

    Example:
        >>> make_room("/ckpt", "ps:0", keep=2, step=900, needed=4 << 30)  # doctest: +SKIP
        ['/ckpt/ps-0/ckpt-700.tmp-3f2a9c1b', '/ckpt/ps-0/ckpt-500']
    """
    task_dir = _task_dir(directory, task)
    free = free_bytes(task_dir)
    if free is None or free >= needed + MARGIN_BYTES:
        return []
    names = os.listdir(task_dir)
    leftovers = sorted(n for n in names if ".tmp-" in n and (
        _step_of(n) is not None or n.startswith("latest.tmp-")))
    complete = _complete_steps(task_dir)
    protected = {_protected_step(directory), *complete[:1]}
    ranked = sorted({*complete, step}, reverse=True)  # as pruning will see them after the save
    beyond = [] if keep is None else [s for s in reversed(ranked[keep:])
                                      if s not in protected and s != step]
    deleted = []
    for name in leftovers + [f"ckpt-{s}" for s in beyond]:
        path = os.path.join(task_dir, name)
        _remove(path)
        deleted.append(path)
        free = free_bytes(task_dir)
        if free is None or free >= needed + MARGIN_BYTES:
            break
    return deleted


def read_task_checkpoint(directory: str | None, task: str, step: int | None = None
                         ) -> tuple[int, dict[str, Any], dict[str, np.ndarray]]:
    """Reads ``task``'s checkpoint ``step`` (default: ``latest_step``) written by
    ``write_task_checkpoint``; returns ``(step, header, arrays)``.

    Raises:
        PSNotFoundError: no checkpoint under ``directory``, or that step's file is missing.

    Example:
        >>> import numpy as np
        >>> from jaxdist._src.ps.checkpoints import read_task_checkpoint, write_task_checkpoint
        >>> _ = write_task_checkpoint("ckpt", "ps:0", 100, {"w": {"kind": "dense",
        ...     "optimizer": None, "version": 3, "num_state": 0}}, {"v/w": np.zeros(4)})
        >>> step, meta, arrays = read_task_checkpoint("ckpt", "ps:0")
        >>> step, meta["variables"]["w"]["version"], arrays["v/w"].shape
        (100, 3, (4,))
    """
    if step is None:
        step = latest_step(directory, task) if directory else None
    if step is None:
        raise PSNotFoundError(f"{task}: no checkpoint under {directory!r}", task=task)
    task_dir = _task_dir(directory, task)
    if not os.path.isdir(task_dir):
        raise PSNotFoundError(f"{task}: checkpoint directory {task_dir} does not exist",
                              task=task)
    meta, arrays = wire.decode([_read_below(task, task_dir, f"ckpt-{int(step)}", "state.jdw")])
    return int(step), meta, arrays


def latest_step(directory: str, task: str) -> int | None:
    """The step to restore: the chief's pointer (every ps saved it) else this task's latest.

    Neither file is read through a symbolic link, a FIFO or a device.
    """
    for parent, name in ((directory, CHECKPOINT_POINTER),
                         (_task_dir(directory, task), "latest")):
        try:
            step = int(json.loads(_read_below(task, parent, name))["step"])
        except (OSError, ValueError, KeyError, TypeError, PSError):
            continue
        ckpt = os.path.join(directory, task.replace(":", "-"), f"ckpt-{step}")
        if os.path.isdir(ckpt):
            return step
    return None


def _step_of(name: str) -> int | None:
    match = re.fullmatch(r"ckpt-(\d+)(\.tmp-[0-9a-f]+)?", name)
    return int(match.group(1)) if match else None


def prune_checkpoints(directory: str, task: str, keep: int, just_saved: int) -> list[str]:
    """Deletes ``task``'s checkpoints beyond the newest ``keep``; returns the deleted paths.

    The checkpoint the chief's pointer names is kept whatever its age: it is the last step every
    ps saved, the one a restarted cluster restores. Leftovers of interrupted saves
    (``ckpt-<step>.tmp-*``) older than ``just_saved`` go too.

    Example:
        >>> prune_checkpoints("/ckpt", "ps:0", keep=3, just_saved=900)  # doctest: +SKIP
        ['/ckpt/ps-0/ckpt-500']
    """
    task_dir = os.path.join(directory, task.replace(":", "-"))
    protected = _protected_step(directory)
    complete, partial = [], []
    for name in os.listdir(task_dir):
        step = _step_of(name)
        if step is None:
            continue
        (partial if ".tmp-" in name else complete).append((step, name))
    complete.sort(reverse=True)
    doomed = [name for i, (step, name) in enumerate(complete) if i >= keep and step != protected]
    doomed += [name for step, name in partial if step < just_saved]
    deleted = []
    for name in doomed:
        path = os.path.join(task_dir, name)
        _remove(path)
        deleted.append(path)
    return deleted


def _remove(path: str) -> None:
    """Deletes ``path``: a link itself (never what it points to), or a directory tree."""
    if os.path.islink(path):
        os.unlink(path)
    elif os.path.exists(path):
        shutil.rmtree(path, ignore_errors=True)


def _atomic_write(path: str, text: str) -> None:
    """Writes ``path`` through a temporary file renamed over it; a failed write (a full
    disk) removes the temporary file and leaves ``path`` as it was."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_checkpoint_pointer(directory: str, step: int, final: bool = False) -> None:
    """Marks ``step`` as complete on every ps (the chief calls it after all saves succeed).

    Args:
        final: the step is the last of a finished run (a side-car evaluator stops after it).
    """
    os.makedirs(directory, exist_ok=True)
    _atomic_write(os.path.join(directory, CHECKPOINT_POINTER),
                  json.dumps({"step": int(step), "final": bool(final)}))


__all__ = [
    "CHECKPOINT_POINTER",
    "PSCheckpointReader",
    "check_keep",
    "checkpoint_directory",
    "latest_step",
    "make_room",
    "prune_checkpoints",
    "read_task_checkpoint",
    "write_checkpoint_pointer",
    "write_task_checkpoint",
]
