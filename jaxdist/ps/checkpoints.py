"""Reading parameter-server checkpoints outside the cluster (side-car evaluation, export).

``strategy.extended.save(directory, step)`` makes every ps write its shards to
``directory/ps-<i>/ckpt-<step>/state.jdw`` and then the chief writes ``directory/checkpoint``
naming the step every ps saved. ``PSCheckpointReader`` reassembles a pytree of variables from
those files (shards of a partitioned leaf are concatenated on axis 0) without any ps running.

Example:
    >>> reader = PSCheckpointReader("runs/parameter_server/ckpt")
    >>> step = reader.latest_step()
    >>> params = reader.restore_tree(step, like=params_template, collection="model")
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import jax
import numpy as np

from jaxdist.ps import wire
from jaxdist.ps.service import CHECKPOINT_POINTER
from jaxdist.ps.variables import leaf_names

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


__all__ = ["PSCheckpointReader"]
