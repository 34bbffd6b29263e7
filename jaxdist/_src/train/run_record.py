"""The settings that shaped a checkpoint, recorded next to it and compared on resume.

The chief writes ``run_settings.json`` into the checkpoint directory with every checkpoint:
the settings that shape training (the ``Trainer``'s global batch size, seed, data order,
precision, BatchNorm mode and strategy, plus whatever its ``CheckpointConfig.settings`` adds:
the CLI adds its config's model, optimizer and data keys), the position of the checkpoint
(``step``, ``epoch``, ``step_in_epoch``) and the history of changes allowed on resume.

A resume with other settings stops with ``SettingsChangedError`` (one line listing each
``key: old -> new`` and the ways forward) unless every changed key is in
``CheckpointConfig.allow_changes``; an allowed change is written into the record with the next
checkpoint. A resume that has nothing left to train raises ``TrainingCompleteError`` unless
``CheckpointConfig.allow_finished``. A checkpoint directory without a record (written before
jaxdist kept one) resumes unchecked, with a note.

A changed global batch keeps epochs meaning epochs: the position inside the epoch is converted
by the examples seen (rounded down to whole new batches, so at most one new batch's worth of
examples is seen twice in that epoch).

Example:
    >>> import os
    >>> from jaxdist._src.train.run_record import RunRecord
    >>> record = RunRecord("ckpt", {"train.global_batch_size": 64, "seed": 0})
    >>> record.check()                 # the first run: no record yet, nothing to compare
    []
    >>> os.makedirs("ckpt/100")              # the checkpoint (orbax writes it)
    >>> record.saved(step=100, epoch=4, step_in_epoch=10)
    >>> RunRecord("ckpt", {"train.global_batch_size": 32, "seed": 0}).check()
    Traceback (most recent call last):
        ...
    jaxdist._src.train.run_record.SettingsChangedError: the checkpoint in ... (step 100) was
    trained with other settings: \
train.global_batch_size: 64 -> 32; ...
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from jaxdist._src.distributed.exit_codes import EXIT_ALREADY_DONE
from jaxdist._src.train.checkpoint import CheckpointMismatchError
from jaxdist._src.train.state import TrainState

#: The record's file name inside the checkpoint directory.
RECORD_FILE = "run_settings.json"
_FORMAT = 1

#: The settings the ``Trainer`` itself records (config-key names, as the CLI's config).
TRAINER_KEYS = ("strategy.name", "seed", "data.shuffle", "train.global_batch_size",
                "train.precision", "train.batch_norm")


class SettingsChangedError(CheckpointMismatchError):
    """A resume whose settings differ from those recorded with the checkpoint
    ([trainer.md](trainer.md#reruns-what-a-checkpoint-records)).

    Attributes:
        directory: the checkpoint directory.
        differences: ``[(key, recorded value, value now), ...]``.
    """

    def __init__(self, message: str, directory: str,
                 differences: Sequence[tuple[str, Any, Any]]):
        super().__init__(message)
        self.directory = directory
        self.differences = list(differences)


class TrainingCompleteError(CheckpointMismatchError):
    """A resume from a checkpoint that already completes the training asked for (nothing left
    to train; exit 3 from the CLI: ``exit_code`` is ``EXIT_ALREADY_DONE``)."""

    exit_code = EXIT_ALREADY_DONE


def trainer_settings(strategy: Any, global_batch_size: int | None, seed: int, shuffle: bool,
                     precision: str, batch_norm: str) -> dict[str, Any]:
    """The settings a ``Trainer`` knows, under the job config's key names.

    Example:
        >>> import jaxdist
        >>> from jaxdist._src.train.run_record import trainer_settings
        >>> trainer_settings(jaxdist.MirroredStrategy(), 64, 0, True, "float32", "sync")
        {'strategy.name': 'MirroredStrategy', 'seed': 0, 'data.shuffle': True, \
'train.global_batch_size': 64, 'train.precision': 'float32', 'train.batch_norm': 'sync'}
    """
    values = (type(strategy).__name__, int(seed), bool(shuffle),
              None if global_batch_size is None else int(global_batch_size), precision,
              batch_norm)
    return dict(zip(TRAINER_KEYS, values))


def plain(value: Any) -> Any:
    """``value`` as JSON keeps it (tuples become lists), so old and new compare equal.

    Example:
        >>> from jaxdist._src.train.run_record import plain
        >>> plain({"sizes": (128, 64)})
        {'sizes': [128, 64]}
    """
    return json.loads(json.dumps(value, default=str))


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def read_record(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The record in checkpoint directory ``directory``, or ``None`` when it has none (or
    nothing else: a record whose checkpoints were deleted describes nothing).

    Raises:
        CheckpointMismatchError: the file is there but is not a record jaxdist wrote.
    """
    path = os.path.join(os.fspath(directory), RECORD_FILE)
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CheckpointMismatchError(
            f"{path} is not a readable run record ({type(e).__name__}: {e}); expected the JSON "
            f"jaxdist writes next to its checkpoints: remove it, or use another "
            f"checkpoint.dir") from None
    if not any(not name.startswith(RECORD_FILE) for name in os.listdir(directory)):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("settings"), dict):
        raise CheckpointMismatchError(
            f"{path} is not a run record (no 'settings' mapping); expected the JSON jaxdist "
            f"writes next to its checkpoints: remove it, or use another checkpoint.dir")
    return record


def differences(recorded: Mapping[str, Any], current: Mapping[str, Any]
                ) -> list[tuple[str, Any, Any]]:
    """``[(key, old, new), ...]`` for the keys recorded in both whose values differ.

    Example:
        >>> from jaxdist._src.train.run_record import differences
        >>> differences({"a": 1, "b": [1]}, {"a": 2, "b": (1,), "c": 3})
        [('a', 1, 2)]
    """
    return [(k, recorded[k], plain(v)) for k, v in current.items()
            if k in recorded and plain(recorded[k]) != plain(v)]


def describe(diffs: Sequence[tuple[str, Any, Any]]) -> str:
    """``"key: old -> new, ..."``.

    Example:
        >>> from jaxdist._src.train.run_record import describe
        >>> describe([("optimizer.learning_rate", 0.001, 0.1)])
        'optimizer.learning_rate: 0.001 -> 0.1'
    """
    return ", ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, a, b in diffs)


def _position(record: Mapping[str, Any]) -> Mapping[str, Any]:
    position = record.get("position")
    return position if isinstance(position, Mapping) else {}


class RunRecord:
    """The record of one checkpoint directory, for one run (see the module docstring).

    Args:
        directory: the checkpoint directory.
        settings: the settings of this run (``{key: value}``, config-key names).
        allow_changes: keys that may differ from the record (the change is recorded).
        writer: whether this process writes the record (the chief).

    Example:
        >>> from jaxdist._src.train.run_record import RunRecord
        >>> RunRecord("ckpt", {"seed": 0}).check()   # no checkpoint yet: nothing to compare
        []
    """

    def __init__(self, directory: str | os.PathLike, settings: Mapping[str, Any],
                 allow_changes: Sequence[str] = (), writer: bool = True):
        self.directory = os.path.abspath(os.fspath(directory))
        self.settings = {k: plain(v) for k, v in settings.items()}
        self.allow_changes = tuple(allow_changes)
        self.writer = writer
        self.recorded: dict[str, Any] | None = None
        self._pending: list[tuple[str, Any, Any]] = []
        self._history: list[Any] = []

    @property
    def path(self) -> str:
        return os.path.join(self.directory, RECORD_FILE)

    def check(self) -> list[str]:
        """Compares this run's settings with the record; returns note lines.

        Raises:
            SettingsChangedError: a setting differs and its key is not in ``allow_changes``.
        """
        self.recorded = read_record(self.directory)
        if self.recorded is None:
            return []
        self._history = list(self.recorded.get("changes") or [])
        diffs = differences(self.recorded["settings"], self.settings)
        refused = [d for d in diffs if d[0] not in self.allow_changes]
        if refused:
            keys = ", ".join(k for k, _, _ in refused)
            step = _position(self.recorded).get("step")
            at = f" (step {step})" if step is not None else ""
            raise SettingsChangedError(
                f"the checkpoint in {self.directory}{at} was trained with other settings: "
                f"{describe(refused)}; to train on from it with them, allow the change "
                f"(checkpoint.allow_changes: [{keys}], or CheckpointConfig(allow_changes=...)), "
                f"which is recorded in {self.path}; to start anew, use another "
                f"checkpoint.dir", self.directory, refused)
        self._pending = diffs
        if not diffs:
            return []
        return [f"resuming with changed settings (allowed by checkpoint.allow_changes): "
                f"{describe(diffs)}; recorded in {self.path} with the next checkpoint"]

    def notes_after_restore(self, restored_step: int | None) -> list[str]:
        """The note for a checkpoint restored without a record (written before jaxdist kept
        one)."""
        if restored_step is not None and self.recorded is None:
            return [f"the checkpoint in {self.directory} (step {restored_step}) has no record "
                    f"of the settings it was trained with ({RECORD_FILE}): resuming without "
                    f"comparing them; this run's settings are recorded from now on"]
        return []

    def changed(self, prefix: str) -> bool:
        """Whether an allowed change of this resume has a key starting with ``prefix``."""
        return any(k.startswith(prefix) for k, _, _ in self._pending)

    def recorded_value(self, key: str) -> Any:
        """The recorded value of ``key`` (``None``: no record, or not recorded)."""
        return None if self.recorded is None else self.recorded["settings"].get(key)

    def converted(self, state: TrainState, global_batch_size: int | None,
                  steps_per_epoch: int, fresh_opt_state: Any = None
                  ) -> tuple[TrainState, list[str]]:
        """``state`` restored from a checkpoint, made to follow the allowed changes: the
        optimizer's injected hyperparameters (learning rate, ...) taken from
        ``fresh_opt_state`` when an ``optimizer.*`` setting changed, and the position inside
        the epoch converted by the examples seen when the global batch size changed
        (``convert_position``); and a note."""
        if fresh_opt_state is not None and state.opt_state is not None \
                and self.changed("optimizer."):
            from jaxdist._src.train.learning_rate import with_hyperparams_of

            state = state.replace(opt_state=with_hyperparams_of(state.opt_state,
                                                                fresh_opt_state))
        old = self.recorded_value("train.global_batch_size")
        sie, ends = convert_position(state.step_in_epoch, old, global_batch_size,
                                     steps_per_epoch)
        if (sie, ends) == (state.step_in_epoch, False):
            return state, []
        new = state.replace(epoch=state.epoch + 1, step_in_epoch=0) if ends \
            else state.replace(step_in_epoch=sie)
        return new, [f"the global batch size changed {old} -> {global_batch_size}: step "
                     f"{state.step_in_epoch} of epoch {state.epoch} "
                     f"({state.step_in_epoch * old} examples) is now step "
                     f"{new.step_in_epoch} of epoch {new.epoch} ({steps_per_epoch} steps "
                     f"each); the epochs are counted as before"]

    def saved(self, step: int, epoch: int, step_in_epoch: int) -> None:
        """Writes the record of the checkpoint just saved at ``step`` (the writer only;
        atomically: a temporary file renamed over the old record)."""
        if not self.writer:
            return
        if self._pending:
            self._history.append({
                "step": int(step),
                "time": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"),
                "changes": {k: [a, b] for k, a, b in self._pending}})
            self._pending = []
        record = {"format": _FORMAT, "settings": self.settings,
                  "position": {"step": int(step), "epoch": int(epoch),
                               "step_in_epoch": int(step_in_epoch)},
                  "changes": self._history}
        self.recorded = record
        os.makedirs(self.directory, exist_ok=True)
        tmp = f"{self.path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(record, f, indent=1, sort_keys=False)
                f.write("\n")
            os.replace(tmp, self.path)
        except BaseException:  # a full disk: the old record stays, no temp file is left
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def convert_position(step_in_epoch: int, old_batch: int | None, new_batch: int | None,
                     steps_per_epoch: int) -> tuple[int, bool]:
    """The step inside the epoch under a new global batch size, by the examples seen
    (rounded down to whole new batches); and whether that completes the epoch.

    Example:
        >>> from jaxdist._src.train.run_record import convert_position
        >>> convert_position(10, 64, 32, 45)      # 640 examples: 20 batches of 32
        (20, False)
        >>> convert_position(3, 32, 64, 22)       # 96 examples: 1 batch of 64 (32 seen again)
        (1, False)
    """
    if not old_batch or not new_batch or old_batch == new_batch:
        return step_in_epoch, False
    converted = (int(step_in_epoch) * int(old_batch)) // int(new_batch)
    if converted >= steps_per_epoch:
        return 0, True
    return converted, False


def finished_message(directory: str, step: int, epochs: int | None, steps: int | None) -> str:
    """The one line of a resume with nothing left to train."""
    what = f"{steps} steps" if steps is not None else f"{epochs} epochs"
    key = "train.steps" if steps is not None else "train.epochs"
    return (f"the checkpoint at step {step} in {directory} already completes the configured "
            f"{what}: nothing to train; raise {key} to train further, use another "
            f"checkpoint.dir to start anew, or set checkpoint.allow_finished=true "
            f"(CheckpointConfig(allow_finished=True)) to only evaluate it")


def check_not_finished(directory: str | os.PathLike, epochs: int | None,
                       steps: int | None) -> None:
    """Raises ``TrainingCompleteError`` when the record of ``directory`` says its latest
    checkpoint already completes ``epochs`` epochs (or ``steps`` steps, when set).

    Example:
        >>> from jaxdist._src.train.run_record import check_not_finished
        >>> check_not_finished("no/such/dir", epochs=10, steps=None)   # no record: nothing
    """
    record = read_record(directory)
    if record is None:
        return
    position = _position(record)
    if "step" not in position:
        return
    step, epoch = int(position["step"]), int(position.get("epoch", 0))
    if steps is not None:
        done = step >= steps
    else:
        done = epochs is not None and epoch >= epochs
    if done:
        raise TrainingCompleteError(finished_message(
            os.path.abspath(os.fspath(directory)), step, epochs, steps))


__all__ = ["RECORD_FILE", "TRAINER_KEYS", "RunRecord", "SettingsChangedError",
           "TrainingCompleteError", "check_not_finished", "convert_position", "describe",
           "differences", "finished_message", "plain", "read_record", "trainer_settings"]
