"""Job configs: YAML files, ``--set section.key=value`` overrides, and schema validation.

A config is a YAML mapping with the sections ``strategy``, ``data``, ``model``, ``optimizer``,
``train``, ``checkpoint`` and ``logging`` (plus a top-level ``seed``). Every key has a type and a
default (``schema_help()`` lists them, as does ``python -m jaxdist.train --help``). Validation
happens before any device work: a bad config raises ``ConfigError`` with one line naming the key,
the value and what is valid, and the CLI exits with status 2.

The keys of the ``strategy`` section depend on ``strategy.name``: each strategy registered with
``jaxdist.train.strategy_registry.register_strategy`` declares its own keys.

Example:
    >>> cfg = load_config("configs/default.yaml", overrides=["train.epochs=3"])
    >>> cfg["train"]["epochs"]
    3
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import yaml


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
    """

    kind: type
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None
    optional: bool = False
    minimum: float | None = None
    item: type | None = None

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
                         "(deterministic from 'seed' and the epoch)"),
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
                                   "divide by the replica count", minimum=1),
        "epochs": Field(int, 10, "passes over the training data (ignored when 'steps' is "
                        "set)", minimum=1),
        "steps": Field(int, None, "train for exactly this many steps instead of "
                       "'epochs'", optional=True, minimum=1),
        "steps_per_execution": Field(int, 1, "steps folded into one compiled dispatch "
                                     "(a lax.scan over k batches)", minimum=1),
        "loss": Field(str, "sparse_categorical_crossentropy", "per-example loss",
                      choices=("sparse_categorical_crossentropy",)),
        "precision": Field(str, "float32", "float32, or bfloat16 (Keras' mixed_bfloat16: "
                           "compute in bfloat16, parameters and optimizer in float32)",
                           choices=("float32", "bfloat16")),
        "batch_norm": Field(str, "sync", "BatchNorm statistics over the global batch (sync, "
                            "TF's SyncBatchNormalization) or each replica's rows "
                            "(per_replica, TF's default)", choices=("sync", "per_replica")),
        "validation_freq": Field(int, 1, "validate every this many epochs (0: never)",
                                 minimum=0),
        "halt_on_nan": Field(bool, True, "stop with an error when the loss becomes NaN or "
                             "inf (TF's TerminateOnNaN); the last good checkpoint is kept"),
        "metrics": Field(list, ["accuracy"], "Keras metrics: names (accuracy, "
                         "sparse_top_k_categorical_accuracy, auc, ...) or {name: ..., k: 3}"),
    },
    "checkpoint": {
        "dir": Field(str, None, "checkpoint directory (null: no checkpoints); on start the "
                     "job resumes from the latest checkpoint in it", optional=True),
        "every_steps": Field(int, 100, "save every this many steps (and always at the end)",
                             minimum=1),
        "keep": Field(int, 3, "keep the last K checkpoints", minimum=1),
        "resume": Field(bool, True, "resume from the latest checkpoint in 'dir'"),
    },
    "logging": {
        "dir": Field(str, "runs/default", "parent of the run directories: each run writes "
                     "metrics.jsonl, config.yaml and TensorBoard files (train/, validation/) "
                     "into its own <dir>/<timestamp> (null: no files)", optional=True),
        "run_name": Field(str, None, "the run directory's name instead of the start time "
                          "(--run-name); it must not hold an earlier run", optional=True),
        "verbose": Field(int, 1, "console output as Keras' verbose: 0 silent, 1 progress bar "
                         "(log lines when not on a terminal), 2 one line per epoch",
                         choices=(0, 1, 2)),
        "every_steps": Field(int, 10, "log training metrics every this many steps",
                             minimum=1),
        "tensorboard": Field(bool, True, "also write TensorBoard event files"),
        "progress_bar": Field(str, "auto", "tqdm bar: auto (when stdout is a terminal), "
                              "always, never", choices=("auto", "always", "never")),
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
    "seed": Field(int, 0, "seed of the model initialisation and the data order"),
    "callbacks": Field(list, [], "Keras callbacks by class name with their arguments, e.g. "
                       "[{name: EarlyStopping, monitor: val_loss, patience: 3}]; relative "
                       "paths are inside the run directory"),
}

SECTIONS = ("strategy", *SCHEMA)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check(where: str, field: Field, value: Any) -> Any:
    """Returns ``value`` converted to ``field``'s type, or raises ``ConfigError``."""
    if value is None:
        if field.optional:
            return None
        raise ConfigError(f"{where}: null is not allowed; expected {field.describe()}")
    kind = field.kind
    out: Any
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {value!r} ({_type_name(value)}) is not a bool; "
                              f"expected true or false")
        out = value
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: {value!r} ({_type_name(value)}) is not an int")
        out = value
    elif kind is float:
        if isinstance(value, str):
            try:
                value = float(value)  # YAML reads 1e-3 (no dot) as a string
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: {value!r} ({_type_name(value)}) is not a number")
        out = float(value)
    elif kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: {value!r} ({_type_name(value)}) is not a string")
        out = value
    elif kind is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: {value!r} ({_type_name(value)}) is not a list; "
                              f"expected {field.describe()}")
        item = Field(field.item, None, "") if field.item else None
        out = [_check(f"{where}[{i}]", item, v) if item else v for i, v in enumerate(value)]
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


def _unknown(where: str, key: str, valid: Sequence[str]) -> ConfigError:
    return ConfigError(f"{where}{key}: unknown key; valid keys: {', '.join(sorted(valid))}")


def _fill(section: str, fields: Mapping[str, Field], raw: Any) -> dict[str, Any]:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{section}: {raw!r} ({_type_name(raw)}) is not a mapping; expected "
                          f"keys {', '.join(sorted(fields))}")
    for key in raw:
        if key not in fields:
            raise _unknown(f"{section}.", str(key), list(fields))
    return {k: _check(f"{section}.{k}", f, raw.get(k, copy.deepcopy(f.default)))
            for k, f in fields.items()}


def validate(raw: Any) -> dict[str, Any]:
    """Checks a raw config mapping and fills in the defaults.

    Args:
        raw: the parsed YAML (a mapping), after overrides.

    Returns:
        A new dict with every section and key present.

    Raises:
        ConfigError: naming the first bad key, its value and what is valid.
    """
    from jaxdist.train import strategy_registry

    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config: expected a mapping of sections, got {_type_name(raw)}")
    valid_top = [*TOP_LEVEL, *SECTIONS]
    for key in raw:
        if key not in valid_top:
            raise _unknown("", str(key), valid_top)
    cfg: dict[str, Any] = {k: _check(k, f, raw.get(k, f.default)) for k, f in TOP_LEVEL.items()}
    cfg["strategy"] = strategy_registry.validate_section(raw.get("strategy"), _fill)
    for section, fields in SCHEMA.items():
        cfg[section] = _fill(section, fields, raw.get(section))
    _cross_checks(cfg)
    return cfg


def _cross_checks(cfg: dict[str, Any]) -> None:
    data = cfg["data"]
    if data["name"] == "npz" and not data["path"]:
        raise ConfigError("data.path: null is not allowed when data.name is 'npz'; expected "
                          "the path of a .npz file with arrays 'x' and 'y'")
    if data["name"] == "npz" and not os.path.isfile(data["path"]):
        raise ConfigError(f"data.path: {data['path']!r} does not exist; expected a .npz file")
    if not 0.0 <= data["validation_split"] < 1.0:
        raise ConfigError(f"data.validation_split: {data['validation_split']!r} is not valid; "
                          f"expected a fraction in [0, 1)")
    opt = cfg["optimizer"]
    if opt["schedule"] != "constant" and opt["decay_steps"] is None:
        raise ConfigError(f"optimizer.decay_steps: null is not allowed when optimizer.schedule "
                          f"is {opt['schedule']!r}; expected the number of steps of the decay")
    if opt["schedule"] == "warmup_cosine" and opt["warmup_steps"] >= opt["decay_steps"]:
        raise ConfigError(f"optimizer.warmup_steps: {opt['warmup_steps']} is not valid; "
                          f"expected fewer than decay_steps ({opt['decay_steps']}), which "
                          f"include the warm-up")
    _check_keras_lists(cfg)
    if cfg["model"]["name"] == "mlp" and any(h < 1 for h in cfg["model"]["hidden_sizes"]):
        raise ConfigError(f"model.hidden_sizes: {cfg['model']['hidden_sizes']!r} is not valid; "
                          f"expected positive layer widths")


def _check_keras_lists(cfg: Mapping[str, Any]) -> None:
    """Validates ``callbacks`` and ``train.metrics`` by building them once (cheap objects)."""
    from jaxdist.train import callbacks, keras_metrics

    try:
        callbacks.from_config(cfg["callbacks"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for i, spec in enumerate(cfg["train"]["metrics"]):
        if not isinstance(spec, (str, Mapping)):
            raise ConfigError(f"train.metrics[{i}]: {spec!r} is not valid; expected a metric "
                              f"name or {{name: ..., **arguments}}")
        try:
            keras_metrics.get(spec)
        except ValueError as e:
            raise ConfigError(f"train.metrics[{i}]: {e}") from None


def check_replicas(cfg: Mapping[str, Any], num_replicas: int) -> None:
    """Raises ``ConfigError`` when the global batch does not divide across the replicas."""
    b = cfg["train"]["global_batch_size"]
    if b % num_replicas:
        lo = b - b % num_replicas
        hint = f"e.g. {lo or num_replicas} or {lo + num_replicas}"
        raise ConfigError(
            f"train.global_batch_size: {b} does not divide across the {num_replicas} replicas "
            f"of strategy '{cfg['strategy']['name']}'; expected a multiple of {num_replicas} "
            f"({hint})"
        )


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parses ``section.key=value`` (value in YAML syntax) into ``(["section", "key"], value)``.

    Raises:
        ConfigError: the text has no ``=`` or no key.
    """
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. train.epochs=5")
    key, _, value = text.partition("=")
    path = [p for p in key.strip().split(".")]
    if not key.strip() or any(not p for p in path):
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. train.epochs=5")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    return path, parsed


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str],
                    notes: list[str] | None = None) -> dict[str, Any]:
    """Returns a copy of ``raw`` with each ``section.key=value`` override applied.

    ``strategy.name=X`` drops the file's ``strategy`` keys that strategy ``X`` does not take
    (e.g. ``devices`` for ``one_device``) and appends a note naming them to ``notes``; keys set
    by another ``--set`` are kept (and validated).
    """
    from jaxdist.train import strategy_registry

    out = copy.deepcopy(raw)
    parsed = [parse_override(text) for text in overrides]
    set_keys = {tuple(p) for p, _ in parsed}
    for path, value in parsed:
        if path == ["strategy", "name"] and isinstance(out.get("strategy"), dict):
            kept, dropped = strategy_registry.drop_foreign_keys(
                out["strategy"], value, {p[1] for p in set_keys if len(p) == 2
                                         and p[0] == "strategy"})
            out["strategy"] = kept
            if dropped and notes is not None:
                notes.append(f"strategy.name={value} does not take "
                             f"{', '.join(f'strategy.{k}' for k in dropped)}; dropped "
                             f"{'it' if len(dropped) == 1 else 'them'} from the config")
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                where = ".".join(path[: i + 1])
                raise ConfigError(f"--set {text!r}: {where} is a value, not a section")
            node = nxt
        node[path[-1]] = value
    return out


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Reads a YAML config file into a dict (``ConfigError`` if unreadable or not a mapping)."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {os.fspath(path)!r}: no such file") from None
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"--config {os.fspath(path)!r}: not valid YAML{where}: {first}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {os.fspath(path)!r}: expected a mapping of sections, got "
                          f"{_type_name(raw)}")
    return raw


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = (),
                raw: Mapping[str, Any] | None = None,
                notes: list[str] | None = None) -> dict[str, Any]:
    """Reads, overrides and validates a config.

    Args:
        path: a YAML file (or ``None`` for the defaults / ``raw``).
        overrides: ``section.key=value`` strings, applied in order.
        raw: a mapping to use instead of (or, with ``path``, on top of) the file.
        notes: receives one line for each thing the overrides changed besides their keys
            (the CLI prints them).

    Returns:
        The validated config with every default filled in.

    Example:
        >>> cfg = load_config(raw={"strategy": {"name": "one_device"}, "train": {"epochs": 1}})
    """
    base: dict[str, Any] = read_yaml(path) if path is not None else {}
    if raw is not None:
        base = _merge(base, copy.deepcopy(dict(raw)))
    return validate(apply_overrides(base, overrides, notes))


def _merge(a: dict[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def schema_help() -> str:
    """A plain-text table of every section and key (used by ``--help``)."""
    from jaxdist.train import strategy_registry

    lines = []
    for k, f in TOP_LEVEL.items():
        lines.append(f"  {k} ({f.describe()}, default {f.default!r}): {f.help}")
    lines.append(strategy_registry.help_text())
    for section, fields in SCHEMA.items():
        lines.append(f"  {section}:")
        for k, f in fields.items():
            lines.append(f"    {k} ({f.describe()}, default {f.default!r}): {f.help}")
    return "\n".join(lines)


def dump(cfg: Mapping[str, Any]) -> str:
    """The config as YAML text."""
    return yaml.safe_dump(dict(cfg), sort_keys=False)
