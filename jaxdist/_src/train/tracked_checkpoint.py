"""``Checkpoint`` and ``CheckpointManager``: tf.train's names over orbax, for a JAX user's
mutable state.

A ``Checkpoint(**objects)`` names the objects a custom training loop keeps (TF's
``tf.train.Checkpoint(model=..., optimizer=...)``). Each keyword is one of:

* a flax NNX object (``nnx.Module``, ``nnx.Optimizer``, an ``nnx.Metric``, ``nnx.Rngs``, any
  ``nnx.Pytree``) or an ``nnx.Variable``: saved from ``nnx.state`` and restored **in place**
  (``nnx.update``), so every reference the loop holds sees the restored values;
* a pytree of arrays (a params dict, an optax state): a value has no identity to restore into,
  so the checkpoint holds it: read it back from the attribute (``ckpt.params``) after a restore,
  and keep the attribute current in the loop (``ckpt.params, ckpt.opt_state = step(...)``);
  wrapping it in an ``nnx.Variable`` gives in-place restores instead;
* a JSON scalar (``int``, ``float``, ``bool``, ``str``; e.g. ``epoch=0``): kept in the
  checkpoint's JSON record, restored as the attribute's value (a restore sets every scalar the
  checkpoint holds, e.g. the ``checkpointed_runs`` a ``PreemptionCheckpointHandler`` records).

Attributes set later (``ckpt.epoch = 3``) are tracked too. A Keras model is refused: Keras models
are saved by ``jaxdist.keras.BackupAndRestore``.

A ``CheckpointManager(checkpoint, directory, max_to_keep)`` writes numbered checkpoints
(``directory/1``, ``directory/2``, ...: orbax's atomic step directories, through the Trainer's
``Checkpointer``), keeps the newest ``max_to_keep`` and restores the latest. In a multi-process
job only the chief writes: on the other processes ``save`` writes nothing and returns the path
the chief writes (every process restores on its own).

Example:
    >>> from jaxdist import Checkpoint, CheckpointManager
    >>> import jax.numpy as jnp
    >>> ckpt = Checkpoint(params={"w": jnp.zeros(3)}, epoch=0)
    >>> manager = CheckpointManager(ckpt, "run/ckpt", max_to_keep=2)
    >>> ckpt.params, ckpt.epoch = {"w": jnp.ones(3)}, 1
    >>> path = manager.save()                         # run/ckpt/1
    >>> ckpt.params, ckpt.epoch = {"w": jnp.zeros(3)}, 0
    >>> ckpt.restore(path).epoch, ckpt.params["w"].tolist()
    (1, [1.0, 1.0, 1.0])
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxdist._src.distributed import bringup
from jaxdist._src.train.checkpoint import Checkpointer, CheckpointMismatchError

_JSON_SCALARS = (bool, int, float, str)
_SAVE_COUNTER = "save_counter"
_FORMAT = "jaxdist.Checkpoint/1"


class CheckpointError(ValueError):
    """An object a ``Checkpoint`` cannot track, or a checkpoint path that is not one."""


def _is_keras(value: Any) -> bool:
    return any(c.__module__.split(".")[0] in ("keras", "tf_keras") for c in type(value).__mro__)


def _nnx():
    from flax import nnx

    return nnx


def _kind(name: str, value: Any) -> str:
    """``"nnx"``, ``"variable"``, ``"json"`` or ``"tree"``; ``CheckpointError`` otherwise."""
    if _is_keras(value):
        raise CheckpointError(
            f"Checkpoint({name}=<{type(value).__name__}>): Keras models and optimizers are "
            f"saved and restored by jaxdist.keras.BackupAndRestore (Keras' own callback), not by "
            f"jaxdist.Checkpoint; pass flax NNX objects or pytrees of arrays here")
    if isinstance(value, _JSON_SCALARS):
        return "json"
    nnx = _nnx()
    if isinstance(value, nnx.Variable):
        return "variable"
    if isinstance(value, nnx.Pytree):
        return "nnx"
    leaves = jax.tree.leaves(value)
    bad = [leaf for leaf in leaves
           if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, bool))]
    if bad or value is None:
        what = type(bad[0]).__name__ if bad else "None"
        raise CheckpointError(
            f"Checkpoint({name}=...): holds a value of type {what}; expected a flax NNX "
            f"object (nnx.Module, nnx.Optimizer, nnx.Rngs, a metric), an nnx.Variable, a "
            f"pytree of arrays, or a JSON scalar (int, float, bool, str)")
    return "tree"


def _to_saved(x: Any) -> Any:
    """A typed PRNG key as its raw key data (what orbax can write); other leaves as they are."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x


def _from_saved(saved: Any, like: Any) -> Any:
    if isinstance(like, jax.Array) and jax.dtypes.issubdtype(like.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(saved, impl=jax.random.key_impl(like))
    return saved


class Checkpoint:
    """The objects a custom loop checkpoints, by name: flax NNX objects (restored in place), pytrees
    and JSON scalars (``tf.train.Checkpoint``).

    Args:
        **objects: NNX objects and ``nnx.Variable`` s (restored in place), pytrees of arrays
            (restored into the attribute) and JSON scalars (``epoch=0``), by name.

    Raises:
        CheckpointError: a Keras model (use ``jaxdist.keras.BackupAndRestore``), or a value
            that is none of the above.

    Example:
        >>> import jaxdist
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> ckpt = jaxdist.Checkpoint(model=model, step=0)
        >>> ckpt.step += 1
        >>> sorted(ckpt.tracked())
        ['model', 'step']
    """

    def __init__(self, **objects: Any):
        object.__setattr__(self, "_objects", {})
        object.__setattr__(self, _SAVE_COUNTER, 0)
        for name, value in objects.items():
            setattr(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == _SAVE_COUNTER:
            raise AttributeError(f"Checkpoint.{_SAVE_COUNTER} is counted by save, not set")
        if name.startswith("_"):
            raise CheckpointError(
                f"Checkpoint attribute {name!r}: names starting with '_' are not tracked")
        _kind(name, value)
        self._objects[name] = value
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        self._objects.pop(name, None)
        object.__delattr__(self, name)

    def tracked(self) -> dict[str, Any]:
        """The tracked objects by name (the current values of the attributes)."""
        return dict(self._objects)

    # ------------------------------------------------------------------ state <-> objects
    def _split(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(arrays, scalars)``: the array state of every non-JSON object, and the JSON
        scalars."""
        nnx = _nnx()
        arrays: dict[str, Any] = {}
        scalars: dict[str, Any] = {}
        for name, value in self._objects.items():
            kind = _kind(name, value)
            if kind == "json":
                scalars[name] = value
            elif kind == "variable":
                arrays[name] = _to_saved(value.get_value())
            elif kind == "nnx":
                arrays[name] = jax.tree.map(_to_saved, nnx.to_pure_dict(nnx.state(value)))
            else:
                arrays[name] = value
        return arrays, scalars

    def _meta(self) -> dict[str, Any]:
        _, scalars = self._split()
        return {"format": _FORMAT, "scalars": scalars, _SAVE_COUNTER: self.save_counter}

    def _assign(self, arrays: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
        """Puts restored state back: NNX objects in place, pytrees and scalars as attributes."""
        nnx = _nnx()
        scalars = dict(meta.get("scalars", {}))
        for name, value in list(self._objects.items()):
            kind = _kind(name, value)
            if kind == "json":
                continue
            if kind == "variable":
                value.set_value(_from_saved(arrays[name], value.get_value()))
            elif kind == "nnx":
                state = nnx.state(value)
                like = nnx.to_pure_dict(state)
                restored = jax.tree.map(_from_saved, arrays[name], like)
                nnx.replace_by_pure_dict(state, restored)
                nnx.update(value, state)
            else:
                object.__setattr__(self, name, arrays[name])
                self._objects[name] = arrays[name]
        for name, value in scalars.items():  # the checkpoint's scalars, tracked or not
            if not (name in self._objects and _kind(name, self._objects[name]) != "json"):
                self._objects[name] = value
                object.__setattr__(self, name, value)
        object.__setattr__(self, _SAVE_COUNTER, int(meta.get(_SAVE_COUNTER, 0)))

    def _count_save(self) -> int:
        n = self.save_counter + 1
        object.__setattr__(self, _SAVE_COUNTER, n)
        return n

    # ------------------------------------------------------------------ restore
    def restore(self, save_path: str | os.PathLike) -> Checkpoint:
        """Restores the checkpoint at ``save_path`` (a path ``CheckpointManager.save``
        returned, or its ``latest_checkpoint``) into the tracked objects.

        Returns:
            this ``Checkpoint``.

        Raises:
            CheckpointError: ``save_path`` is not a checkpoint written by a ``CheckpointManager``.
            jaxdist.train.Checkpointer's ``CheckpointMismatchError``: the checkpoint holds
                other objects or arrays of other shapes (the message names the first one).

        Example:
            >>> import jaxdist
            >>> import jax.numpy as jnp
            >>> manager = jaxdist.CheckpointManager(jaxdist.Checkpoint(w=jnp.ones(2)), "ck", 1)
            >>> path = manager.save()
            >>> ckpt = jaxdist.Checkpoint(w=jnp.zeros(2))
            >>> ckpt.restore(manager.latest_checkpoint).w.tolist()
            [1.0, 1.0]
        """
        path = os.path.abspath(os.fspath(save_path))
        directory, base = os.path.split(path)
        if not base.isdigit() or not os.path.isdir(path):
            raise CheckpointError(
                f"Checkpoint.restore({os.fspath(save_path)!r}): expected a checkpoint written "
                f"by jaxdist.CheckpointManager (a numbered directory such as "
                f"{os.path.join(directory, '1')!r}, e.g. manager.latest_checkpoint)")
        reader = Checkpointer(directory, read_only=True)
        try:
            arrays, _ = self._split()
            what = f"Checkpoint({', '.join(sorted(arrays))})"
            try:  # with no arrays to restore into: read the scalars only
                restored, meta = reader.restore(int(base), like=arrays or None, what=what)
            except CheckpointMismatchError as e:
                detail = str(e).split("; use another checkpoint.dir")[0]
                raise CheckpointMismatchError(
                    f"{detail}; restore into a Checkpoint with the same objects, or save into "
                    f"another directory") from None
        finally:
            reader.close()
        self._assign(restored, meta)
        return self


def _is_writer() -> bool:
    """Whether this process writes checkpoints: the chief of a multi-process job, or the only
    process."""
    return bringup.should_save_checkpoint()


class CheckpointManager:
    """Numbered, atomic orbax checkpoints of a ``Checkpoint`` in one directory, the newest
    ``max_to_keep`` kept; only the chief writes (``tf.train.CheckpointManager``).

    Args:
        checkpoint: the ``Checkpoint`` to save and restore.
        directory: where the numbered checkpoints go (created by the writing process).
        max_to_keep: how many of the newest checkpoints to keep (``None``: all).

    In a multi-process job only the chief writes (the other processes' ``save`` writes nothing
    and returns the chief's path); every process restores on its own.

    Raises:
        CheckpointError: ``checkpoint`` is not a ``Checkpoint``, ``max_to_keep`` is not a
            positive integer or ``None``, or ``directory`` cannot be created or written.

    Example:
        >>> import jaxdist, os
        >>> import jax.numpy as jnp
        >>> ckpt = jaxdist.Checkpoint(params={"w": jnp.zeros(2)})
        >>> manager = jaxdist.CheckpointManager(ckpt, "run/ckpt", max_to_keep=1)
        >>> manager.restore_or_initialize() is None      # nothing saved yet
        True
        >>> os.path.basename(manager.save())
        '1'
    """

    def __init__(self, checkpoint: Checkpoint, directory: str | os.PathLike,
                 max_to_keep: int | None):
        if not isinstance(checkpoint, Checkpoint):
            raise CheckpointError(
                f"CheckpointManager(checkpoint={type(checkpoint).__name__}): expected a "
                f"jaxdist.Checkpoint")
        if max_to_keep is not None and (isinstance(max_to_keep, bool)
                                        or not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise CheckpointError(
                f"CheckpointManager(max_to_keep={max_to_keep!r}): expected a positive integer "
                f"or None (keep every checkpoint)")
        self._checkpoint = checkpoint
        self._directory = os.path.abspath(os.fspath(directory))
        self._max_to_keep = max_to_keep
        self._writer = _is_writer()
        if self._writer:
            _check_writable(self._directory)
        self._checkpointer: Checkpointer | None = None

    @property
    def checkpoint(self) -> Checkpoint:
        """The managed ``Checkpoint``."""
        return self._checkpoint

    @property
    def directory(self) -> str:
        """The directory of the numbered checkpoints (absolute)."""
        return self._directory

    def _ckpt(self) -> Checkpointer | None:
        if self._checkpointer is None:
            if self._writer:
                self._checkpointer = Checkpointer(self._directory, keep=self._max_to_keep or 2**31,
                                                  read_only=False)
            elif os.path.isdir(self._directory):
                self._checkpointer = Checkpointer(self._directory, read_only=True)
        return self._checkpointer

    @property
    def checkpoints(self) -> list[str]:
        """The paths of the kept checkpoints, oldest first."""
        ckpt = self._ckpt()
        return [] if ckpt is None else [os.path.join(self._directory, str(s))
                                        for s in ckpt.all_steps()]

    @property
    def latest_checkpoint(self) -> str | None:
        """The path of the newest checkpoint, or ``None``."""
        ckpt = self._ckpt()
        step = None if ckpt is None else ckpt.latest_step()
        return None if step is None else os.path.join(self._directory, str(step))

    def save(self, checkpoint_number: int | None = None) -> str:
        """Writes a checkpoint (atomically) and deletes the oldest beyond ``max_to_keep``.

        Args:
            checkpoint_number: its number (default: ``checkpoint.save_counter`` after this
                save, i.e. 1, 2, ...).

        Returns:
            its path, ``directory/<number>``.
        """
        number = self._checkpoint._count_save()
        if checkpoint_number is not None:
            if isinstance(checkpoint_number, bool) or not isinstance(
                    checkpoint_number, (int, np.integer)) or checkpoint_number < 0:
                raise CheckpointError(
                    f"CheckpointManager.save(checkpoint_number={checkpoint_number!r}): expected "
                    f"a non-negative integer")
            number = int(checkpoint_number)
        path = os.path.join(self._directory, str(number))
        ckpt = self._ckpt()
        if self._writer and ckpt is not None:
            arrays, _ = self._checkpoint._split()
            ckpt.save(number, arrays, self._checkpoint._meta())
        return path

    def restore_or_initialize(self) -> str | None:
        """Restores the latest checkpoint, if there is one.

        Returns:
            the restored checkpoint's path, or ``None`` (nothing to restore: the objects keep
            their initial values).
        """
        path = self.latest_checkpoint
        if path is not None:
            self._checkpoint.restore(path)
        return path

    def close(self) -> None:
        """Releases orbax's manager."""
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None


def _check_writable(directory: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"checkpoint directory {directory!r} cannot be created ({e.strerror}): expected a "
            f"writable directory") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise CheckpointError(
            f"checkpoint directory {directory!r} is not writable: expected a directory this "
            f"process can write")


__all__ = ["Checkpoint", "CheckpointError", "CheckpointManager"]
