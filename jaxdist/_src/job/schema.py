"""The job-config schema: every key's type, default, help, and the Trainer option it sets.

This module is the one home of the config defaults. ``Field.arg`` names the ``Trainer`` option
a key sets: ``"loss"`` (the constructor's argument), ``"<group>.<field>"`` (a field of the
``Trainer``'s ``TrainConfig`` (``config``), ``CheckpointConfig`` (``checkpoint``) or
``LoggingConfig`` (``logging``), ``jaxdist._src.train.options``), or ``"fit.<name>"`` (a
``fit`` argument). ``trainer_options(cfg)`` / ``fit_kwargs(cfg)`` turn a validated config into
the arguments a job passes, so no key is mapped by hand twice; ``trainer_defaults()`` gives the
library's defaults of those options, and a test keeps them equal to the keys' defaults. A key
whose library default differs on purpose (``logging.dir``: the CLI writes run directories, a
``Trainer`` made in Python writes none) says so with ``arg_default``.

The ``strategy`` section's keys are declared by each strategy in
``jaxdist._src.job.strategy_registry``.

Example:
    >>> from jaxdist._src.job.schema import SCHEMA, trainer_defaults
    >>> SCHEMA["train"]["epochs"].default
    10
    >>> trainer_defaults()["checkpoint.every_steps"]
    100
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any


class _Same:
    def __repr__(self) -> str:
        return "SAME"


#: ``Field.arg_default``: the argument's default is the key's default.
SAME: Any = _Same()


class ConfigError(ValueError):
    """A config that does not validate (the CLI prints it on one line and exits 2)."""


@dataclasses.dataclass(frozen=True)
class Field:
    """One config key: its type, default, allowed values and help text.

    Args:
        kind: ``int``, ``float``, ``str``, ``bool`` or ``list`` (of ``item``).
        default: the value used when the key is absent.
        help: one line for ``--help`` and the docs.
        choices: the allowed values, if restricted.
        optional: ``null`` is allowed.
        minimum: the smallest allowed number (or list length for lists).
        item: the element type of a list.
        arg: the ``Trainer`` option this key sets (``"loss"``, ``"<group>.<field>"`` of its
            config dataclasses, ``"fit.<name>"``: a ``fit`` argument).
        arg_default: the library's default of that option: ``SAME`` (this key's default), or
            a different value (with the reason next to it in the schema).
    """

    kind: type
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None
    optional: bool = False
    minimum: float | None = None
    item: type | None = None
    arg: str | None = None
    arg_default: Any = SAME

    def describe(self) -> str:
        if self.kind is list:
            t = f"list[{self.item.__name__ if self.item else 'any'}]"
        else:
            t = self.kind.__name__
        if self.optional:
            t += " | null"
        if self.choices:
            t = " | ".join(repr(c) for c in self.choices)
        return t


# The sections other than ``strategy`` have a fixed set of keys (see docs/trainer.md).
SCHEMA: dict[str, dict[str, Field]] = {
    "data": {
        "name": Field(str, "digits", "dataset: scikit-learn digits, a synthetic "
                      "classification problem, or your own .npz file",
                      choices=("digits", "synthetic", "npz")),
        "path": Field(str, None, "npz: file with arrays 'x' and 'y' (optionally "
                      "'x_val'/'y_val')", optional=True),
        "validation_split": Field(float, 0.2, "fraction of examples held out for "
                                  "validation (when the data has no own validation set)",
                                  minimum=0.0),
        "split_seed": Field(int, 0, "seed of the train/validation split (independent of 'seed')"),
        "shuffle": Field(bool, True, "reshuffle the training examples every epoch "
                         "(deterministic from 'seed' and the epoch)", arg="config.shuffle"),
        "num_examples": Field(int, 4096, "synthetic: number of examples", minimum=1),
        "num_features": Field(int, 32, "synthetic: features per example", minimum=1),
        "num_classes": Field(int, 10, "synthetic: number of classes", minimum=2),
    },
    "model": {
        "name": Field(str, "mlp", "model architecture", choices=("mlp", "cnn")),
        "hidden_sizes": Field(list, [128], "mlp: widths of the hidden layers", item=int),
        "features": Field(list, [16, 32], "cnn: channels of the 3x3 conv layers (each "
                          "followed by 2x2 average pooling)", item=int, minimum=1),
        "num_classes": Field(int, None, "output classes (null: inferred from the labels)",
                             optional=True, minimum=2),
    },
    "optimizer": {
        "name": Field(str, "adam", "optax optimizer", choices=("sgd", "adam", "adamw",
                                                                "rmsprop")),
        "learning_rate": Field(float, 1e-3, "step size (the peak of a warm-up schedule)",
                               minimum=0.0),
        "schedule": Field(str, "constant", "learning-rate schedule over the update count "
                          "(optax; on a ps, each shard's update count = the global step)",
                          choices=("constant", "cosine", "warmup_cosine", "exponential",
                                   "linear")),
        "decay_steps": Field(int, None, "cosine/warmup_cosine/linear: steps until the end "
                             "rate (warmup_cosine: warm-up included); exponential: steps per "
                             "decay_rate factor", optional=True, minimum=1),
        "warmup_steps": Field(int, 0, "warmup_cosine: steps of linear warm-up from 0",
                              minimum=0),
        "end_learning_rate": Field(float, 0.0, "cosine/warmup_cosine/linear: the rate at "
                                   "decay_steps", minimum=0.0),
        "decay_rate": Field(float, 0.5, "exponential: factor applied every decay_steps",
                            minimum=0.0),
        "momentum": Field(float, 0.0, "sgd/rmsprop: momentum", minimum=0.0),
        "weight_decay": Field(float, 1e-4, "adamw: decoupled weight decay", minimum=0.0),
        "clipnorm": Field(float, None, "clip the global gradient norm to this value",
                          optional=True, minimum=0.0),
    },
    "train": {
        "global_batch_size": Field(int, 64, "examples per step over all replicas; must "
                                   "divide by the replica count", minimum=1,
                                   arg="config.global_batch_size",
                                   arg_default=None),  # Trainer: fit's batch_size, else 32
        "epochs": Field(int, 10, "passes over the training data (ignored when 'steps' is "
                        "set)", minimum=1, arg="fit.epochs",
                        arg_default=None),  # fit: one epoch when neither is given
        "steps": Field(int, None, "train for exactly this many steps instead of "
                       "'epochs'", optional=True, minimum=1, arg="fit.steps"),
        "steps_per_execution": Field(int, 1, "steps folded into one compiled dispatch "
                                     "(a lax.scan over k batches)", minimum=1,
                                     arg="config.steps_per_execution"),
        "loss": Field(str, "sparse_categorical_crossentropy", "per-example loss",
                      choices=("sparse_categorical_crossentropy",), arg="loss"),
        "precision": Field(str, "float32", "float32, or bfloat16 (Keras' mixed_bfloat16: "
                           "compute in bfloat16, parameters and optimizer in float32)",
                           choices=("float32", "bfloat16"), arg="config.precision"),
        "batch_norm": Field(str, "sync", "BatchNorm statistics over the global batch (sync, "
                            "TF's SyncBatchNormalization) or each replica's rows "
                            "(per_replica, TF's default)", choices=("sync", "per_replica"),
                            arg="config.batch_norm"),
        "validation_freq": Field(int, 1, "validate every this many epochs (0: never)",
                                 minimum=0, arg="fit.validation_freq"),
        "halt_on_nan": Field(bool, True, "stop with an error when the loss becomes NaN or "
                             "inf (TF's TerminateOnNaN); the last good checkpoint is kept",
                             arg="config.halt_on_nan"),
        "metrics": Field(list, ["accuracy"], "Keras metrics: names (accuracy, "
                         "sparse_top_k_categorical_accuracy, auc, ...) or {name: ..., k: 3}",
                         arg="config.metrics",
                         arg_default=None),  # Trainer: None = ["accuracy"] if accuracy=True
        "weighted_metrics": Field(list, [], "Keras weighted_metrics: metrics weighted by "
                                  "the sample/class weights (the metrics above are not); a "
                                  "name also in metrics is logged as weighted_<name>",
                                  arg="config.weighted_metrics", arg_default=None),
    },
    "checkpoint": {
        "dir": Field(str, None, "checkpoint directory (null: no checkpoints); on start the "
                     "job resumes from the latest checkpoint in it", optional=True,
                     arg="checkpoint.dir"),
        "every_steps": Field(int, 100, "save every this many steps (and always at the end)",
                             minimum=1, arg="checkpoint.every_steps"),
        "keep": Field(int, 3, "keep the last K checkpoints", minimum=1, arg="checkpoint.keep"),
        "resume": Field(bool, True, "resume from the latest checkpoint in 'dir'",
                        arg="checkpoint.resume"),
        "allow_changes": Field(list, [], "settings (keys such as optimizer.learning_rate) that "
                               "may differ from those the checkpoint was trained with; the "
                               "change is recorded in <dir>/run_settings.json (any other "
                               "difference stops the job with exit 2)", item=str,
                               arg="checkpoint.allow_changes",
                               arg_default=()),  # Trainer: a tuple
        "allow_finished": Field(bool, False, "resume from a checkpoint that already completes "
                                "the configured epochs/steps: train nothing, only evaluate "
                                "(otherwise exit 3)", arg="checkpoint.allow_finished"),
    },
    "logging": {
        "dir": Field(str, "runs/default", "parent of the run directories: each run writes "
                     "metrics.jsonl, config.yaml and TensorBoard files (train/, validation/) "
                     "into its own <dir>/<timestamp> (null: no files)", optional=True,
                     arg="logging.dir",
                     arg_default=None),  # a Trainer made in Python writes no files
        "run_name": Field(str, None, "the run directory's name instead of the start time "
                          "(--run-name); it must not hold an earlier run", optional=True,
                          arg="logging.run_name"),
        "verbose": Field(int, 1, "console output as Keras' verbose: 0 silent, 1 progress bar "
                         "(log lines when not on a terminal), 2 one line per epoch",
                         choices=(0, 1, 2), arg="fit.verbose",
                         arg_default="auto"),  # fit: Keras' "auto" (1)
        "every_steps": Field(int, 10, "log training metrics every this many steps",
                             minimum=1, arg="logging.every_steps"),
        "tensorboard": Field(bool, True, "also write TensorBoard event files",
                             arg="logging.tensorboard"),
        "progress_bar": Field(str, "auto", "tqdm bar: auto (when stdout is a terminal), "
                              "always, never", choices=("auto", "always", "never"),
                              arg="logging.progress_bar"),
    },
    # How a preemption notice (SIGTERM) is answered while training with a checkpoint.dir.
    "preemption": {
        "grace_period": Field(float, 30.0, "seconds between the notice (SIGTERM) and the "
                              "platform's SIGKILL: every process stops at one agreed step, "
                              "the chief saves it and all exit with exit_code before then "
                              "(Kubernetes' terminationGracePeriodSeconds)", minimum=1e-6),
        "exit_code": Field(int, 42, "the exit status after the preemption checkpoint: the "
                           "code that tells a scheduler to restart the job (1..127, not 2 or 3)"),
    },
    # Used only by an `evaluator` task of TF_CONFIG (side-car evaluation of the checkpoints).
    "evaluator": {
        "log_dir": Field(str, None, "where the evaluator's metrics.jsonl and TensorBoard files "
                         "go (null: <logging.dir>/eval)", optional=True),
        "poll_seconds": Field(float, 1.0, "how often the checkpoint directory is checked",
                              minimum=0.01),
        "idle_timeout_seconds": Field(float, 600.0, "stop with an error when no new "
                                      "checkpoint appears for this long", minimum=0.1),
    },
}

TOP_LEVEL: dict[str, Field] = {
    "seed": Field(int, 0, "seed of the model initialisation and the data order",
                  arg="config.seed"),
    "callbacks": Field(list, [], "Keras callbacks by class name with their arguments, e.g. "
                       "[{name: EarlyStopping, monitor: val_loss, patience: 3}]; relative "
                       "paths are inside the run directory"),
}

SECTIONS = ("strategy", *SCHEMA)


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def check(where: str, field: Field, value: Any) -> Any:
    """Returns ``value`` converted to ``field``'s type, or raises ``ConfigError``."""
    if value is None:
        if field.optional:
            return None
        raise ConfigError(f"{where}: null is not allowed; expected {field.describe()}")
    kind = field.kind
    out: Any
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {value!r} ({type_name(value)}) is not a bool; "
                              f"expected true or false")
        out = value
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: {value!r} ({type_name(value)}) is not an int")
        out = value
    elif kind is float:
        if isinstance(value, str):
            try:
                value = float(value)  # YAML reads 1e-3 (no dot) as a string
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: {value!r} ({type_name(value)}) is not a number")
        out = float(value)
    elif kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: {value!r} ({type_name(value)}) is not a string")
        out = value
    elif kind is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: {value!r} ({type_name(value)}) is not a list; "
                              f"expected {field.describe()}")
        item = Field(field.item, None, "") if field.item else None
        out = [check(f"{where}[{i}]", item, v) if item else v for i, v in enumerate(value)]
        if field.minimum is not None and len(out) < field.minimum:
            raise ConfigError(f"{where}: {value!r} needs at least {int(field.minimum)} "
                              f"entries")
        return out
    else:  # pragma: no cover - schema bug
        raise TypeError(f"unsupported field kind {kind}")
    if field.choices is not None and out not in field.choices:
        valid = ", ".join(str(c) for c in field.choices)
        raise ConfigError(f"{where}: {value!r} is not valid; expected one of: {valid}")
    if field.minimum is not None and out < field.minimum:
        raise ConfigError(f"{where}: {value!r} is too small; expected >= {field.minimum:g}")
    return out


def unknown_key(where: str, key: str, valid: Sequence[str]) -> ConfigError:
    return ConfigError(f"{where}{key}: unknown key; valid keys: {', '.join(sorted(valid))}")


def fill(section: str, fields: Mapping[str, Field], raw: Any) -> dict[str, Any]:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{section}: {raw!r} ({type_name(raw)}) is not a mapping; expected "
                          f"keys {', '.join(sorted(fields))}")
    for key in raw:
        if key not in fields:
            raise unknown_key(f"{section}.", str(key), list(fields))
    return {k: check(f"{section}.{k}", f, raw.get(k, copy.deepcopy(f.default)))
            for k, f in fields.items()}


def _args() -> dict[str, tuple[str, str, Field]]:
    """``{option: (section, key, field)}`` of the keys that set a ``Trainer`` option."""
    out: dict[str, tuple[str, str, Field]] = {}
    for section, fields in (("", TOP_LEVEL), *SCHEMA.items()):
        for key, f in fields.items():
            if f.arg is not None:
                out[f.arg] = (section, key, f)
    return out


def trainer_defaults() -> dict[str, Any]:
    """The library's defaults of the options the config sets (``{"config.seed": 0, ...,
    "fit.epochs": None}``), as the schema states them (``SAME`` or ``arg_default``).

    Example:
        >>> from jaxdist._src.job.schema import trainer_defaults
        >>> trainer_defaults()["checkpoint.keep"], trainer_defaults()["fit.validation_freq"]
        (3, 1)
    """
    return {name: copy.deepcopy(f.default if f.arg_default is SAME else f.arg_default)
            for name, (_, _, f) in _args().items()}


def _values(cfg: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """``{name: value}`` of the options ``<prefix>.<name>`` a validated config sets."""
    out = {}
    for arg, (section, key, _) in _args().items():
        owner, _, name = arg.rpartition(".")
        if owner == prefix:
            out[name] = cfg[key] if not section else cfg[section][key]
    return out


def trainer_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The ``Trainer`` arguments a validated config sets: ``loss``, and ``config``,
    ``checkpoint``, ``logging`` (``TrainConfig``, ``CheckpointConfig``, ``LoggingConfig``).

    Example:
        >>> from jaxdist._src.job.config import load_config, trainer_options
        >>> trainer_options(load_config(raw={"checkpoint": {"keep": 5}}))["checkpoint"].keep
        5
    """
    from jaxdist._src.distributed.termination import TerminationConfig
    from jaxdist._src.train.options import CheckpointConfig, LoggingConfig, TrainConfig

    termination = TerminationConfig(grace_period=cfg["preemption"]["grace_period"],
                                    exit_code=cfg["preemption"]["exit_code"])
    return {**_values(cfg, ""),
            "config": TrainConfig(**_values(cfg, "config")),
            "checkpoint": CheckpointConfig(**_values(cfg, "checkpoint"),
                                           termination=termination),
            "logging": LoggingConfig(**_values(cfg, "logging"))}


def fit_kwargs(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``Trainer.fit``'s arguments from a validated config (``epochs`` only without ``steps``).

    Example:
        >>> from jaxdist._src.job.schema import fit_kwargs
        >>> from jaxdist._src.job.config import load_config
        >>> fit_kwargs(load_config(raw={"train": {"steps": 7}}))["epochs"] is None
        True
    """
    out = _values(cfg, "fit")
    if out.get("steps") is not None:
        out["epochs"] = None
    return out
