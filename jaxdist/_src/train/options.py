"""The ``Trainer``'s options, grouped as a job config groups them: ``TrainConfig``,
``CheckpointConfig`` and ``LoggingConfig`` (the config's ``train``, ``checkpoint`` and
``logging`` sections). These dataclasses hold the library's defaults, written once; the job
config's schema names, for each key, the field it sets.

``Trainer(..., **kwargs)`` also takes each field under its flat name (``checkpoint_dir=``,
``log_every_steps=``, ...): ``FLAT_NAMES`` maps those names to ``(group, field)``.

Example:
    >>> from jaxdist.train import CheckpointConfig, TrainConfig
    >>> CheckpointConfig(dir="/tmp/ckpt", every_steps=50).keep
    3
    >>> TrainConfig(global_batch_size=64).steps_per_execution
    1
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
from collections.abc import Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The Trainer's training options (``global_batch_size``, ``steps_per_execution``, precision,
    ...): the config's ``train`` section.

    Attributes:
        global_batch_size: examples per step over all replicas (``None``: ``fit``'s
            ``batch_size``, the batch size of an already batched dataset, else 32).
        steps_per_execution: steps per compiled dispatch (TF's ``steps_per_execution``).
        seed: seed of the data order.
        shuffle: reshuffle the training data every epoch.
        precision: ``"float32"`` or ``"bfloat16"`` (Keras' ``mixed_bfloat16``).
        batch_norm: ``"sync"`` (statistics over the global batch) or ``"per_replica"``.
        halt_on_nan: raise ``NaNLossError`` when the loss is NaN or inf.
        metrics: Keras metrics (``None``: ``["accuracy"]`` when ``accuracy``).
        weighted_metrics: Keras' ``weighted_metrics``.
        accuracy: compute accuracy when ``metrics`` is ``None``.

    Example:
        >>> from jaxdist.train import TrainConfig
        >>> TrainConfig(global_batch_size=64, steps_per_execution=4).seed
        0
    """

    global_batch_size: int | None = None
    steps_per_execution: int = 1
    seed: int = 0
    shuffle: bool = True
    precision: str = "float32"
    batch_norm: str = "sync"
    halt_on_nan: bool = True
    metrics: Sequence[Any] | None = None
    weighted_metrics: Sequence[Any] | None = None
    accuracy: bool = True


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """The Trainer's checkpoint options (``dir``, ``every_epochs``, ``keep``, ...): the config's
    ``checkpoint`` section.

    Attributes:
        dir: the checkpoint directory (``None``: no checkpoints); ``fit`` resumes from the
            latest checkpoint in it (TF's ``BackupAndRestore``).
        every_steps: save every this many steps (and at the end of ``fit``).
        keep: keep the newest K checkpoints.
        resume: resume from ``dir`` at the start of ``fit``.
        termination: a ``jaxdist.TerminationConfig``: how a preemption notice (SIGTERM, a
            platform's watcher function) is answered while ``fit`` trains with a ``dir``:
            every process stops at one agreed step, the chief saves it and every process
            exits with the restart code (42) within the grace period. ``None``: the
            defaults (SIGTERM, 30 s, 42).
        allow_changes: settings (config-key names, e.g. ``"train.global_batch_size"``) that
            may differ from those recorded with the checkpoint: the resume goes on and the
            change is recorded (``jaxdist._src.train.run_record``); any other difference
            stops ``fit`` with ``SettingsChangedError``.
        allow_finished: resume even when the checkpoint already completes the training asked
            for (``fit`` then trains nothing and only evaluates); otherwise
            ``TrainingCompleteError``.
        settings: more settings that shaped training, recorded with each checkpoint and
            compared on resume besides the ``Trainer``'s own (the CLI adds its config's
            model, optimizer and data keys).

    Example:
        >>> from jaxdist.train import CheckpointConfig
        >>> CheckpointConfig(dir="/tmp/ckpt").every_steps
        100
        >>> CheckpointConfig(dir="/tmp/ckpt", allow_changes=["optimizer.learning_rate"]).keep
        3
    """

    dir: str | None = None
    every_steps: int = 100
    keep: int = 3
    resume: bool = True
    termination: Any = None
    allow_changes: Sequence[str] = ()
    allow_finished: bool = False
    settings: Mapping[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """The Trainer's logging options (directory, TensorBoard, progress bar): the config's
    ``logging`` section.

    Attributes:
        dir: the parent of the run directories: each ``Trainer`` writes ``metrics.jsonl`` and
            TensorBoard events into its own new ``<dir>/<timestamp>`` (or ``<dir>/<run_name>``)
            (``None``: console only).
        run_name: the run directory's name instead of the start time.
        every_steps: training metrics are logged every this many steps.
        tensorboard: write TensorBoard event files.
        progress_bar: ``"auto"``, ``"always"`` or ``"never"``.

    Example:
        >>> from jaxdist.train import LoggingConfig
        >>> LoggingConfig(dir="runs", every_steps=50).tensorboard
        True
    """

    dir: str | None = None
    run_name: str | None = None
    every_steps: int = 10
    tensorboard: bool = True
    progress_bar: str = "auto"


#: The ``Trainer`` keyword arguments of the groups' fields: ``{name: (group, field)}``.
FLAT_NAMES: dict[str, tuple[str, str]] = {
    **{f.name: ("config", f.name) for f in dataclasses.fields(TrainConfig)},
    "checkpoint_dir": ("checkpoint", "dir"),
    "checkpoint_every_steps": ("checkpoint", "every_steps"),
    "keep_checkpoints": ("checkpoint", "keep"),
    "resume": ("checkpoint", "resume"),
    "allow_changes": ("checkpoint", "allow_changes"),
    "allow_finished": ("checkpoint", "allow_finished"),
    "termination_config": ("checkpoint", "termination"),
    "log_dir": ("logging", "dir"),
    "run_name": ("logging", "run_name"),
    "log_every_steps": ("logging", "every_steps"),
    "tensorboard": ("logging", "tensorboard"),
    "progress_bar": ("logging", "progress_bar"),
}

_CLASSES = {"config": TrainConfig, "checkpoint": CheckpointConfig, "logging": LoggingConfig}


def resolve(config: TrainConfig | None, checkpoint: CheckpointConfig | None,
            logging: LoggingConfig | None, flat: Mapping[str, Any]
            ) -> tuple[TrainConfig, CheckpointConfig, LoggingConfig]:
    """The three groups from the ``Trainer``'s arguments: the groups given (default: the
    defaults) with the flat keyword arguments ``flat`` applied.

    Raises:
        TypeError: a group of the wrong type, an unknown keyword (naming the field it may
            mean), or a flat keyword for a group that was also given.

    Example:
        >>> from jaxdist._src.train.options import resolve
        >>> resolve(None, None, None, {"checkpoint_dir": "/tmp/c"})[1].dir
        '/tmp/c'
    """
    given = {"config": config, "checkpoint": checkpoint, "logging": logging}
    for group, value in given.items():
        if value is not None and not isinstance(value, _CLASSES[group]):
            raise TypeError(f"Trainer({group}=...) takes a jaxdist.train."
                            f"{_CLASSES[group].__name__}, got {type(value).__name__}: "
                            f"{value!r}")
    changes: dict[str, dict[str, Any]] = {g: {} for g in _CLASSES}
    for name, value in flat.items():
        if name not in FLAT_NAMES:
            raise TypeError(_unknown_message(name))
        group, field = FLAT_NAMES[name]
        if given[group] is not None:
            raise TypeError(f"Trainer() got {name}={value!r} and {group}="
                            f"{_CLASSES[group].__name__}(...); set {field}= in the "
                            f"{_CLASSES[group].__name__} instead")
        changes[group][field] = value
    out = [dataclasses.replace(given[g] or cls(), **changes[g]) for g, cls in _CLASSES.items()]
    return out[0], out[1], out[2]


@dataclasses.dataclass(frozen=True)
class TrainerOptions:
    """A ``Trainer``'s options, resolved and checked once, at construction: the three groups
    and what they determine (the metrics, the compute dtype).

    Attributes:
        config: the ``TrainConfig``.
        checkpoint: the ``CheckpointConfig``.
        logging: the ``LoggingConfig``.
        metrics: the ``MetricSetup`` of ``config`` (``jaxdist._src.train.keras_metrics``).
        compute_dtype: mixed precision's compute dtype (``None``: float32).
    """

    config: TrainConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    metrics: Any
    compute_dtype: Any


def resolve_checked(config: TrainConfig | None, checkpoint: CheckpointConfig | None,
                    logging: LoggingConfig | None, flat: Mapping[str, Any]) -> TrainerOptions:
    """``resolve``, then the checks of the values (``steps_per_execution``, ``batch_norm``,
    ``precision``, the metrics), all before the ``Trainer`` builds anything.

    Raises:
        TypeError: as ``resolve``.
        ValueError: a value out of range, naming it and what is expected.

    Example:
        >>> from jaxdist._src.train.options import resolve_checked
        >>> resolve_checked(None, None, None, {"precision": "bfloat16"}).compute_dtype
        dtype(bfloat16)
    """
    from jaxdist._src.train.keras_metrics import MetricSetup
    from jaxdist._src.train.model_state import check_batch_norm
    from jaxdist._src.train.precision import compute_dtype

    config, checkpoint, logging = resolve(config, checkpoint, logging, flat)
    if isinstance(config.steps_per_execution, bool) or not isinstance(
            config.steps_per_execution, numbers.Integral) or config.steps_per_execution < 1:
        raise ValueError(f"steps_per_execution must be an int >= 1, got "
                         f"{config.steps_per_execution!r}")
    check_batch_norm(config.batch_norm)
    dtype = compute_dtype(config.precision)
    return TrainerOptions(config, checkpoint, logging, MetricSetup.from_config(config), dtype)


def _unknown_message(name: str) -> str:
    known = {**FLAT_NAMES, **{f"{g}.{f.name}": (g, f.name) for g, cls in _CLASSES.items()
                              for f in dataclasses.fields(cls)}}
    near = difflib.get_close_matches(name, list(FLAT_NAMES), n=1)
    hint = ""
    if near:
        group, field = known[near[0]]
        hint = (f"; did you mean {near[0]}= (or {group}="
                f"{_CLASSES[group].__name__}({field}=...))?")
    return (f"Trainer() got an unexpected keyword argument {name!r}{hint} The options are "
            f"Trainer(model, optimizer, loss, strategy=..., config=TrainConfig(...), "
            f"checkpoint=CheckpointConfig(...), logging=LoggingConfig(...)) "
            f"(jaxdist.train), or their fields by name: {', '.join(sorted(FLAT_NAMES))}")


__all__ = ["FLAT_NAMES", "CheckpointConfig", "LoggingConfig", "TrainConfig", "TrainerOptions",
           "resolve", "resolve_checked"]
