"""Keras callbacks for jaxdist: chief-only writers, and ``TensorBoard`` without TensorFlow.

Keras 3's own ``keras.callbacks.TensorBoard`` imports ``tensorflow.summary`` and so fails on
a JAX-only install. ``jaxdist.keras.TensorBoard`` writes the same scalars (``epoch_loss``,
``epoch_accuracy``, ... under ``<log_dir>/train`` and ``<log_dir>/validation``, and
``batch_*`` with an integer ``update_freq``) with tensorboardX, and only on the chief process
(``jax.process_index() == 0``), as TF's Keras writes summaries only from the chief under a
multi-worker strategy.

Keras 3's ``ModelCheckpoint`` and ``BackupAndRestore`` know nothing of processes: under
``MultiWorkerMirroredStrategy`` every process would write the same files at once.
``jaxdist.keras.ModelCheckpoint`` and ``jaxdist.keras.BackupAndRestore`` write from the chief
only (the state is mirrored, so the chief's copy is everyone's); every process reads the backup
when ``fit`` starts, so a relaunched job resumes from the chief's last epoch on all workers.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import jax
import keras

from jaxdist._src.compat import keras_internals as ki
from jaxdist._src.distributed import preemption


class TensorBoard(keras.callbacks.Callback):
    """Epoch (and batch) scalars for TensorBoard, written by the chief process only.

    Args:
        log_dir: where the event files go (``train`` and ``validation`` subdirectories).
        update_freq: ``"epoch"``, or a number of batches between ``batch_*`` scalars.

    Raises:
        ValueError: ``update_freq`` is neither ``"epoch"`` nor a positive integer.

    Example:
        >>> import jaxdist, keras  # doctest: +NEEDS_KERAS
        >>> import numpy as np
        >>> x, y = np.ones((32, 4), np.float32), np.ones((32, 1), np.float32)
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> history = model.fit(x, y, verbose=0, callbacks=[jaxdist.keras.TensorBoard("logs")])
    """

    def __init__(self, log_dir: str | os.PathLike = "logs", update_freq: str | int = "epoch"):
        super().__init__()
        if update_freq != "epoch" and not (
            isinstance(update_freq, int) and not isinstance(update_freq, bool) and update_freq > 0
        ):
            raise ValueError(
                f"update_freq={update_freq!r} is not valid; expected 'epoch' or a positive "
                f"number of batches"
            )
        self.log_dir = os.fspath(log_dir)
        self.update_freq = update_freq
        self._writers: dict[str, Any] = {}
        self._step = 0

    @property
    def is_chief(self) -> bool:
        """Whether this process writes (process 0 of the JAX cluster)."""
        return jax.process_index() == 0

    def _writer(self, phase: str) -> Any:
        if phase not in self._writers:
            from tensorboardX import SummaryWriter

            self._writers[phase] = SummaryWriter(logdir=os.path.join(self.log_dir, phase))
        return self._writers[phase]

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._step += 1
        if self.update_freq == "epoch" or not self.is_chief or self._step % self.update_freq:
            return
        for k, v in (logs or {}).items():
            self._writer("train").add_scalar(f"batch_{k}", float(v), self._step)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not self.is_chief:
            return
        for k, v in (logs or {}).items():
            try:
                value = float(v)
            except (TypeError, ValueError):
                continue
            phase, tag = ("validation", k[4:]) if k.startswith("val_") else ("train", k)
            self._writer(phase).add_scalar(f"epoch_{tag}", value, epoch)
        for w in self._writers.values():
            w.flush()

    def on_train_end(self, logs: dict | None = None) -> None:
        for w in self._writers.values():
            w.close()
        self._writers.clear()


def _is_chief() -> bool:
    return jax.process_index() == 0


_ChiefModelCheckpoint, _ChiefBackupAndRestore = ki.chief_only_file_callbacks(_is_chief)


class ModelCheckpoint(_ChiefModelCheckpoint):
    """Keras's ``ModelCheckpoint``, written by the chief process only.

    Takes Keras's arguments. On a single process it is Keras's callback.

    Example:
        >>> import jaxdist, keras, os  # doctest: +NEEDS_KERAS
        >>> import numpy as np
        >>> x, y = np.ones((32, 4), np.float32), np.ones((32, 1), np.float32)
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> history = model.fit(x, y, verbose=0, callbacks=[jaxdist.keras.ModelCheckpoint(
        ...     "ckpt/{epoch}.weights.h5", save_weights_only=True)])
        >>> os.listdir("ckpt")
        ['1.weights.h5']
    """


class BackupAndRestore(_ChiefBackupAndRestore):
    """Keras's ``BackupAndRestore``: every process restores, only the chief backs up, and a
    preemption notice saves the step every process agreed on before the job exits.

    Takes Keras's arguments (``backup_dir`` on storage every process can read), and:

    Args:
        save_before_preemption: answer SIGTERM (or ``termination_config``'s watcher) while
            ``fit`` runs, as TF's Keras does with ``save_before_preemption=True``: every
            process stops before one agreed batch, the chief backs up the weights, the
            optimizer state and the position (epoch and batch), and every process exits with
            the restart code (42). The resumed ``fit`` continues that epoch at that batch
            (the batches before it are read and skipped, not trained again; the epoch's
            logged metrics cover the batches trained after the restart). Default True
            (TF's default is False, which leaves SIGTERM to end the process).
        termination_config: a ``jaxdist.TerminationConfig`` (grace period, exit code,
            platform watcher); default ``TerminationConfig()``.

    Example:
        >>> import jaxdist, keras  # doctest: +NEEDS_KERAS
        >>> import numpy as np
        >>> x, y = np.ones((32, 4), np.float32), np.ones((32, 1), np.float32)
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> history = model.fit(x, y, epochs=2, verbose=0,
        ...                     callbacks=[jaxdist.keras.BackupAndRestore("backup")])
    """

    def __init__(self, backup_dir: str | os.PathLike, save_freq: str | int = "epoch",
                 double_checkpoint: bool = False, delete_checkpoint: bool = True,
                 save_before_preemption: bool = True, termination_config: Any = None):
        super().__init__(backup_dir, save_freq=save_freq, double_checkpoint=double_checkpoint,
                         delete_checkpoint=delete_checkpoint)
        self.save_before_preemption = bool(save_before_preemption)
        self.termination_config = termination_config
        self._watching: contextlib.ExitStack | None = None
        self._calls = 0
        self._epoch = 0

    def on_train_begin(self, logs: dict | None = None) -> None:
        super().on_train_begin(logs)
        _, meta_path = ki.backup_paths(self)
        if os.path.exists(meta_path):
            with open(meta_path) as f:
                meta = json.load(f)
            if meta.get("preempted") and int(meta.get("batch", 0)) > 0:
                ki.skip_batches(self.model, int(meta["batch"]))
        self._calls = 0
        if self.save_before_preemption:
            watcher = preemption.install(self.termination_config)
            self._watching = contextlib.ExitStack()
            self._watching.enter_context(watcher.consume())

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch
        super().on_epoch_begin(epoch, logs)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        super().on_train_batch_begin(batch, logs)
        if self._watching is None:
            return
        watcher = preemption.installed()
        if watcher is not None and watcher.should_stop(self._calls):
            watcher.finish(self._calls, lambda: self._save_preempted(batch),
                           is_chief=_is_chief(), what="backup")
        self._calls += 1

    def _save_preempted(self, batch: int) -> None:
        """Backs up the weights and the position ``(epoch, batch)`` before ``batch``."""
        weights_path, meta_path = ki.backup_paths(self)
        os.makedirs(self.backup_dir, exist_ok=True)
        self.model.save_weights(filepath=weights_path, overwrite=True)
        tmp = f"{meta_path}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump({"epoch": self._epoch, "batch": int(batch), "preempted": True}, f)
            os.replace(tmp, meta_path)
        except BaseException:  # a full disk: no temp file is left
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._watching is not None:
            self._watching.close()
            self._watching = None
        super().on_train_end(logs)
