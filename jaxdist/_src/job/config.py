"""Job configs: YAML files, ``--set section.key=value`` overrides, and schema validation.

A config is a YAML mapping with the sections ``strategy``, ``data``, ``model``, ``optimizer``,
``train``, ``checkpoint`` and ``logging`` (plus a top-level ``seed``). Every key has a type and a
default (``schema_help()`` lists them, as does ``python -m jaxdist.train --help``). Validation
happens before any device work: a bad config raises ``ConfigError`` with one line naming the key,
the value and what is valid, and the CLI exits with status 2.

The keys and defaults are declared once, in ``schema.py`` (re-exported here); the keys
of the ``strategy`` section depend on ``strategy.name``: each strategy registered with
``jaxdist._src.job.strategy_registry.register_strategy`` declares its own keys.

Example:
    >>> from jaxdist.train import load_config
    >>> _ = open("job.yaml", "w").write("train: {epochs: 10}")
    >>> cfg = load_config("job.yaml", overrides=["train.epochs=3"])
    >>> cfg["train"]["epochs"]
    3
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from jaxdist._src.job import strategy_registry
from jaxdist._src.job.schema import (
    SCHEMA,
    SECTIONS,
    TOP_LEVEL,
    ConfigError,
    Field,
    check,
    fill,
    fit_kwargs,
    trainer_defaults,
    trainer_options,
    type_name,
    unknown_key,
)
from jaxdist._src.job.strategy_registry import check_replicas  # noqa: F401 - also here


def validate(raw: Any) -> dict[str, Any]:
    """Checks a raw config mapping and fills in the defaults.

    Args:
        raw: the parsed YAML (a mapping), after overrides.

    Returns:
        A new dict with every section and key present.

    Raises:
        ConfigError: naming the first bad key, its value and what is valid.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config: expected a mapping of sections, got {type_name(raw)}")
    valid_top = [*TOP_LEVEL, *SECTIONS]
    for key in raw:
        if key not in valid_top:
            raise unknown_key("", str(key), valid_top)
    cfg: dict[str, Any] = {k: check(k, f, raw.get(k, f.default)) for k, f in TOP_LEVEL.items()}
    cfg["strategy"] = strategy_registry.validate_section(raw.get("strategy"), fill)
    for section, fields in SCHEMA.items():
        cfg[section] = fill(section, fields, raw.get(section))
    _cross_checks(cfg)
    return cfg


def _cross_checks(cfg: dict[str, Any]) -> None:
    from jaxdist._src.distributed.termination import TerminationConfigError, check_exit_code

    try:
        check_exit_code(cfg["preemption"]["exit_code"], "preemption.exit_code")
    except TerminationConfigError as e:
        raise ConfigError(str(e)) from None
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
    """Validates ``callbacks``, ``train.metrics`` and ``train.weighted_metrics`` by building
    them once (cheap objects)."""
    from jaxdist._src.train import callbacks, keras_metrics

    try:
        callbacks.from_config(cfg["callbacks"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for key in ("metrics", "weighted_metrics"):
        for i, spec in enumerate(cfg["train"].get(key) or ()):
            if not isinstance(spec, (str, Mapping)):
                raise ConfigError(f"train.{key}[{i}]: {spec!r} is not valid; expected a "
                                  f"metric name or {{name: ..., **arguments}}")
            try:
                keras_metrics.get(spec)
            except ValueError as e:
                raise ConfigError(f"train.{key}[{i}]: {e}") from None


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
                          f"{type_name(raw)}")
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
        >>> from jaxdist.train import load_config
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


__all__ = ["SCHEMA", "SECTIONS", "TOP_LEVEL", "ConfigError", "Field", "apply_overrides",
           "check_replicas", "dump", "fit_kwargs", "load_config", "parse_override", "read_yaml",
           "schema_help", "trainer_defaults", "trainer_options", "validate"]
