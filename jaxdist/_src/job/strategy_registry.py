"""The registry of the strategies of job configs, keyed by strategy class.

For each strategy class it holds its job-config names (``strategy.name``), each a
``StrategyConfig``: the section's keys, the builder (validated section -> strategy), the
optimizer a config's ``optimizer`` section becomes, a config check, and whether this process
serves instead of training. (The ``TrainerHook`` the ``Trainer`` delegates to is the Trainer
library's: ``jaxdist.train.register_trainer_hook``.)

Config names are looked up here (``config_for``), so a job goes config -> ``StrategyConfig``
-> strategy -> ``Trainer`` without any other table. The parameter-server names are registered
by ``job/parameter_server.py``, imported when first looked up (a synchronous job never imports
the parameter-server packages).

Example:
    >>> import jax, jaxdist
    >>> from jaxdist._src.job.strategy_registry import _REGISTRY, config_for
    >>> from jaxdist.train import register_strategy
    >>> from jaxdist._src.job.schema import Field
    >>> class MyStrategy(jaxdist.MirroredStrategy):
    ...     def __init__(self, workers):
    ...         super().__init__(jax.devices()[:1])
    >>> spec = register_strategy(
    ...     MyStrategy, "my_strategy", lambda section: MyStrategy(section["workers"]),
    ...     {"workers": Field(int, 2, "how many", minimum=1)}, help="my own strategy")
    >>> config_for("my_strategy").strategy_class is MyStrategy
    True
    >>> del _REGISTRY[MyStrategy]   # (this example unregisters it; a program keeps it)
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax

from jaxdist._src.cluster.tpu_cluster_resolver import TPUClusterResolver
from jaxdist._src.job.optimizers import optimizer_from_config
from jaxdist._src.job.schema import ConfigError, Field
from jaxdist._src.strategies.central_storage import CentralStorageStrategy
from jaxdist._src.strategies.cross_device_ops import (
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)
from jaxdist._src.strategies.mirrored import MirroredStrategy
from jaxdist._src.strategies.multi_worker import (
    CommunicationOptions,
    MultiWorkerMirroredStrategy,
)
from jaxdist._src.strategies.one_device import OneDeviceStrategy
from jaxdist._src.strategies.tpu import TPUStrategy

Builder = Callable[[Mapping[str, Any]], Any]


@dataclasses.dataclass(frozen=True)
class StrategyConfig:
    """One ``strategy.name`` of job configs.

    Args:
        strategy_class: the class ``build`` returns (the registry's key).
        name: the config name (``"mirrored"``, ``"multi_worker"``, ...).
        build: ``fn(section) -> strategy``; ``section`` is the validated ``strategy`` section.
        fields: the keys the section may have besides ``name``.
        help: one line for ``--help``.
        uses_tf_config: the strategy reads ``TF_CONFIG`` (only then does a job look at it,
            e.g. for an evaluator task).
        optimizer: ``fn(optimizer section) -> optimizer`` (default: the optax optimizer).
        check: ``fn(cfg)`` raising ``ConfigError`` for what this strategy cannot run.
        serves: ``fn(cfg) -> bool``: this process serves (``serve(cfg)``) instead of training.
        serve: ``fn(cfg) -> exit status``.
    """

    strategy_class: type
    name: str
    build: Builder
    fields: Mapping[str, Field]
    help: str = ""
    uses_tf_config: bool = False
    optimizer: Callable[[Mapping[str, Any]], Any] = optimizer_from_config
    check: Callable[[Mapping[str, Any]], None] | None = None
    serves: Callable[[Mapping[str, Any]], bool] | None = None
    serve: Callable[[Mapping[str, Any]], int] | None = None


@dataclasses.dataclass
class _Entry:
    configs: dict[str, StrategyConfig] = dataclasses.field(default_factory=dict)


_REGISTRY: dict[type, _Entry] = {}

# Config names registered by a module of their own, imported when a config, a strategy or
# `--help` first needs them: a synchronous job never imports the parameter-server packages.
_DEFERRED = {
    "parameter_server": "jaxdist._src.job.parameter_server",
    "parameter_server_coordinator": "jaxdist._src.job.parameter_server",
}


def _load_deferred(name: Any = None) -> None:
    """Imports the module that registers config name ``name`` (``None``: every such module)."""
    for deferred, module in _DEFERRED.items():
        if name is None or name == deferred:
            importlib.import_module(module)


def _spec(name: Any) -> StrategyConfig | None:
    """The registered config name ``name`` (its module imported first), or ``None``."""
    if not isinstance(name, str):
        return None
    _load_deferred(name)
    return _by_name().get(name)


def register_strategy(strategy_class: type, name: str, build: Builder,
                      fields: Mapping[str, Field] | None = None, *, help: str = "",
                      **options: Any) -> StrategyConfig:
    """Makes ``strategy.name: <name>`` available in job configs, with its keys, builder and checks
    ([trainer.md](trainer.md)).

    Raises:
        ValueError: ``name`` is taken by another class, or ``fields`` has ``name``.
    """
    if name in _DEFERRED and _DEFERRED[name] not in sys.modules:
        _load_deferred(name)  # the built-in registration first: a clash is named below
    fields = dict(fields or {})
    if "name" in fields:
        raise ValueError("a strategy's fields must not include 'name'")
    other = _by_name().get(name)
    if other is not None and other.strategy_class is not strategy_class:
        raise ValueError(f"strategy name {name!r} is already registered for "
                         f"{other.strategy_class.__name__}")
    spec = StrategyConfig(strategy_class, name, build, fields, help, **options)
    _REGISTRY.setdefault(strategy_class, _Entry()).configs[name] = spec
    return spec


def unregister_strategy(name: str) -> None:
    """Removes config name ``name`` (a no-op when unknown)."""
    for entry in _REGISTRY.values():
        entry.configs.pop(name, None)


def _by_name() -> dict[str, StrategyConfig]:
    return {name: spec for entry in _REGISTRY.values() for name, spec in entry.configs.items()}


def registered_strategies() -> tuple[str, ...]:
    """The strategy names a config may use."""
    _load_deferred()
    return tuple(sorted(_by_name()))


def config_for(name: str) -> StrategyConfig:
    """The registered config name ``name``.

    Raises:
        ConfigError: no strategy has that name.
    """
    spec = _spec(name)
    if spec is None:
        raise ConfigError(f"strategy.name: {name!r} is not a known strategy; expected one of: "
                          f"{', '.join(registered_strategies())}")
    return spec


def strategy_config(cfg: Mapping[str, Any], strategy: Any = None) -> StrategyConfig:
    """The ``StrategyConfig`` of a validated config; with ``strategy`` (a job given its own
    strategy), the config name of that strategy's class when ``strategy.name`` is another's.

    Example:
        >>> from jaxdist._src.job.strategy_registry import strategy_config
        >>> from jaxdist._src.job.config import load_config
        >>> strategy_config(load_config(raw={})).name
        'mirrored'
    """
    spec = config_for(cfg["strategy"]["name"])
    if strategy is None or isinstance(strategy, spec.strategy_class):
        return spec
    _load_deferred()
    for cls in type(strategy).__mro__:
        entry = _REGISTRY.get(cls)
        if entry is not None and entry.configs:
            return next(iter(entry.configs.values()))
    return spec


def validate_section(raw: Any, fill: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """Validates the ``strategy`` section (used by ``config.validate``)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"strategy: {raw!r} is not a mapping; expected e.g. "
                          f"{{name: mirrored}}")
    name = raw.get("name", "mirrored")
    spec = config_for(name)
    rest = {k: v for k, v in raw.items() if k != "name"}
    for key in rest:
        if key not in spec.fields:
            valid = ", ".join(sorted(["name", *spec.fields]))
            raise ConfigError(f"strategy.{key}: unknown key for strategy {name!r}; valid keys: "
                              f"{valid}")
    out = fill("strategy", spec.fields, rest)
    return {"name": name, **out}


def drop_foreign_keys(section: Mapping[str, Any], name: Any,
                      keep: set[str] = frozenset()) -> tuple[dict[str, Any], list[str]]:
    """``section`` without the keys strategy ``name`` does not take (``keep``: never drop).

    Returns ``(section, dropped keys)``; an unknown ``name`` drops nothing (validation names
    it).

    Example:
        >>> from jaxdist._src.job.strategy_registry import drop_foreign_keys
        >>> drop_foreign_keys({"name": "mirrored", "devices": None}, "one_device")
        ({'name': 'mirrored'}, ['devices'])
    """
    spec = _spec(name)
    if spec is None:
        return dict(section), []
    dropped = [k for k in section if k != "name" and k not in spec.fields and k not in keep]
    return {k: v for k, v in section.items() if k not in dropped}, dropped


def uses_tf_config(name: str) -> bool:
    """Whether strategy ``name`` reads ``TF_CONFIG`` (the others ignore a stale one).

    Example:
        >>> from jaxdist._src.job.strategy_registry import uses_tf_config
        >>> uses_tf_config("one_device"), uses_tf_config("multi_worker")
        (False, True)
    """
    spec = _spec(name)
    return bool(spec is not None and spec.uses_tf_config)


def help_text() -> str:
    lines = [f"  strategy:  name: one of {', '.join(registered_strategies())} "
             f"(default 'mirrored')"]
    for spec in _by_name().values():
        lines.append(f"    name: {spec.name} -- {spec.help}")
        for k, f in spec.fields.items():
            lines.append(f"      {k} ({f.describe()}, default {f.default!r}): {f.help}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- built-in strategies
_CROSS_DEVICE_OPS = ("nccl", "hierarchical_copy", "reduction_to_one_device")


def _cross_device_ops(section: Mapping[str, Any]) -> Any:
    name = section["cross_device_ops"]
    if name == "nccl":
        return NcclAllReduce(num_packs=section["num_packs"])
    if name == "hierarchical_copy":
        return HierarchicalCopyAllReduce(num_packs=section["num_packs"])
    return ReductionToOneDevice()


def check_replicas(cfg: Mapping[str, Any], num_replicas: int) -> None:
    """Raises ``ConfigError`` when the global batch does not divide across the replicas.

    Example:
        >>> from jaxdist._src.job.strategy_registry import check_replicas
        >>> check_replicas({"train": {"global_batch_size": 64}, "strategy": {"name": "x"}}, 4)
    """
    b = cfg["train"]["global_batch_size"]
    if b % num_replicas:
        lo = b - b % num_replicas
        hint = f"e.g. {lo or num_replicas} or {lo + num_replicas}"
        raise ConfigError(
            f"train.global_batch_size: {b} does not divide across the {num_replicas} replicas "
            f"of strategy '{cfg['strategy']['name']}'; expected a multiple of {num_replicas} "
            f"({hint})"
        )


def build_strategy(cfg: Mapping[str, Any]) -> Any:
    """Builds the configured strategy and checks the config against it (the batch divides
    across its replicas, its own checks).

    Raises:
        ConfigError: an unknown device, a batch size that does not divide, or a setting the
            strategy cannot run.
    """
    spec = config_for(cfg["strategy"]["name"])
    try:
        strategy = spec.build(cfg["strategy"])
    except (ValueError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"strategy: {cfg['strategy']['name']!r} cannot be built from "
                          f"{dict(cfg['strategy'])!r}: {first}") from None
    check_replicas(cfg, strategy.num_replicas_in_sync)
    if spec.check is not None:
        spec.check(cfg)
    return strategy


def strategy_and_optimizer(cfg: Mapping[str, Any], strategy: Any = None) -> tuple[Any, Any]:
    """The job's strategy (the configured one, built by ``build_strategy``, or ``strategy``
    checked against the config) and the optimizer it runs (e.g. parameter servers run their
    own optimizer spec).

    Raises:
        ConfigError: as ``build_strategy``, or an optimizer the strategy cannot run.
    """
    if strategy is None:
        strategy = build_strategy(cfg)
    else:
        check_replicas(cfg, strategy.num_replicas_in_sync)
    return strategy, strategy_config(cfg, strategy).optimizer(cfg["optimizer"])


def _devices(section: Mapping[str, Any]) -> Any:
    devs = section.get("devices")
    return list(devs) if devs else None


def _one_device(section: Mapping[str, Any]) -> Any:
    return OneDeviceStrategy(section["device"] or jax.local_devices()[0])


def _mirrored(section: Mapping[str, Any]) -> Any:
    return MirroredStrategy(_devices(section), _cross_device_ops(section))


def _central_storage(section: Mapping[str, Any]) -> Any:
    return CentralStorageStrategy(_devices(section), section["parameter_device"])


def _tpu(section: Mapping[str, Any]) -> Any:
    resolver = TPUClusterResolver(tpu=section["tpu"])
    return TPUStrategy(resolver, devices=_devices(section), topology=section.get("topology"))


def _multi_worker(section: Mapping[str, Any]) -> Any:
    options = CommunicationOptions(
        bytes_per_pack=int(section.get("bytes_per_pack") or 0),
        timeout_seconds=section.get("timeout_seconds"),
        implementation=str(section.get("communication") or "auto"),
    )
    return MultiWorkerMirroredStrategy(communication_options=options)


_DEVICES = Field(list, None, "TF device strings such as '/gpu:0', '/cpu:1' (null: every "
                 "local device)", optional=True, item=str)
_CDO = {
    "cross_device_ops": Field(str, "nccl", "how gradients are all-reduced: NcclAllReduce "
                              "(one-level psum), HierarchicalCopyAllReduce (two-level), "
                              "ReductionToOneDevice (gather, reduce, broadcast)",
                              choices=_CROSS_DEVICE_OPS),
    "num_packs": Field(int, 1, "nccl/hierarchical_copy: gradient packs per all-reduce",
                       minimum=1),
}

register_strategy(OneDeviceStrategy, "one_device", _one_device, {
    "device": Field(str, None, "the device, e.g. '/gpu:0' or '/cpu:0' (null: the first local "
                    "device)", optional=True),
}, help="OneDeviceStrategy: everything on one device")
register_strategy(MirroredStrategy, "mirrored", _mirrored, {"devices": _DEVICES, **_CDO},
                  help="MirroredStrategy: synchronous data parallelism over local devices")
register_strategy(CentralStorageStrategy, "central_storage", _central_storage, {
    "devices": Field(list, None, "compute devices (null: every local device)", optional=True,
                     item=str),
    "parameter_device": Field(str, None, "where the single copy of the state lives (null: "
                              "the host CPU)", optional=True),
}, help="CentralStorageStrategy: one copy of the state, replicated compute")
register_strategy(TPUStrategy, "tpu", _tpu, {
    "tpu": Field(str, "local", "TPUClusterResolver's tpu argument ('local' or a name)"),
    "devices": Field(list, None, "run on these devices instead of TPU cores (testing)",
                     optional=True, item=str),
    "topology": Field(str, None, "compile for this TPU topology (e.g. 'v5e:2x2') without a "
                      "TPU: needs libtpu (pip install 'jaxdist[tpu]') and --compile-only",
                      optional=True),
}, help="TPUStrategy over the cores of the local TPU")
register_strategy(MultiWorkerMirroredStrategy, "multi_worker", _multi_worker, {
    "communication": Field(str, "auto", "collective implementation: auto, ring (gloo on CPU, "
                           "NCCL on GPU), nccl (GPUs only)", choices=("auto", "ring", "nccl")),
    "timeout_seconds": Field(float, 60.0, "bound on joining the cluster and on every step; a "
                             "dead peer becomes PeerLostError naming it (null: 60)",
                             optional=True),
    "bytes_per_pack": Field(int, 0, "pack gradients into all-reduce buckets of this many bytes "
                            "(0: one bucket per dtype)", minimum=0),
}, help="MultiWorkerMirroredStrategy over the chief/worker tasks of TF_CONFIG",
    uses_tf_config=True)
__all__ = ["StrategyConfig", "build_strategy", "check_replicas", "config_for",
           "drop_foreign_keys",
           "register_strategy", "registered_strategies", "strategy_and_optimizer",
           "strategy_config",
           "unregister_strategy", "uses_tf_config", "validate_section"]
