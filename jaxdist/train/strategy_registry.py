"""The ``strategy`` section of a job config: strategy names, their keys, and their builders.

Each name maps to a builder that turns the validated ``strategy`` section into a
``jaxdist.Strategy``, plus the keys that section may have. Other packages add their strategies
(``multi_worker``, ``parameter_server``) with ``register_strategy``; a builder may be given as a
``"module:function"`` string so that registering imports nothing.

Example:
    >>> from jaxdist.train.config import Field
    >>> register_strategy(
    ...     "multi_worker",
    ...     "jaxdist.strategies.multi_worker:strategy_from_config",
    ...     {"communication": Field(str, "auto", "collective implementation",
    ...                             choices=("auto", "ring", "nccl"))},
    ...     help="MultiWorkerMirroredStrategy over the processes of TF_CONFIG")
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from jaxdist.train import coordinator_config as _coordinator_config
from jaxdist.train import ps_config as _ps_config
from jaxdist.train.config import ConfigError, Field

Builder = Callable[[Mapping[str, Any]], Any]


@dataclasses.dataclass(frozen=True)
class StrategySpec:
    """A registered strategy: its builder, its config keys and one line of help."""

    name: str
    builder: Builder | str
    fields: Mapping[str, Field]
    help: str = ""
    uses_tf_config: bool = False

    def build(self, section: Mapping[str, Any]) -> Any:
        builder = self.builder
        if isinstance(builder, str):
            module, _, attr = builder.partition(":")
            builder = getattr(importlib.import_module(module), attr)
        return builder(section)


_REGISTRY: dict[str, StrategySpec] = {}


def register_strategy(name: str, builder: Builder | str, fields: Mapping[str, Field] | None = None,
                      help: str = "", uses_tf_config: bool = False) -> None:
    """Makes ``strategy.name: <name>`` available in job configs.

    Args:
        name: the config name (``"mirrored"``, ``"multi_worker"``, ...).
        builder: ``fn(section) -> Strategy`` or a ``"module:function"`` string naming it;
            ``section`` is the validated ``strategy`` section (all of ``fields`` filled in).
        fields: the keys the section may have besides ``name``.
        help: one line for ``--help``.
        uses_tf_config: the strategy reads ``TF_CONFIG`` (only then does a job look at it,
            e.g. for an evaluator task).
    """
    fields = dict(fields or {})
    if "name" in fields:
        raise ValueError("a strategy's fields must not include 'name'")
    _REGISTRY[name] = StrategySpec(name, builder, fields, help, uses_tf_config)


def registered_strategies() -> tuple[str, ...]:
    """The strategy names a config may use."""
    return tuple(sorted(_REGISTRY))


def validate_section(raw: Any, fill: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """Validates the ``strategy`` section (used by ``config.validate``)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"strategy: {raw!r} is not a mapping; expected e.g. "
                          f"{{name: mirrored}}")
    name = raw.get("name", "mirrored")
    if name not in _REGISTRY:
        raise ConfigError(f"strategy.name: {name!r} is not a known strategy; expected one of: "
                          f"{', '.join(registered_strategies())}")
    spec = _REGISTRY[name]
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
        >>> drop_foreign_keys({"name": "mirrored", "devices": None}, "one_device")
        ({'name': 'mirrored'}, ['devices'])
    """
    spec = _REGISTRY.get(name) if isinstance(name, str) else None
    if spec is None:
        return dict(section), []
    dropped = [k for k in section if k != "name" and k not in spec.fields and k not in keep]
    return {k: v for k, v in section.items() if k not in dropped}, dropped


def uses_tf_config(name: str) -> bool:
    """Whether strategy ``name`` reads ``TF_CONFIG`` (the others ignore a stale one).

    Example:
        >>> uses_tf_config("one_device"), uses_tf_config("multi_worker")
        (False, True)
    """
    spec = _REGISTRY.get(name)
    return bool(spec is not None and spec.uses_tf_config)


def build_strategy(section: Mapping[str, Any]) -> Any:
    """Builds the strategy a validated ``strategy`` section describes."""
    return _REGISTRY[section["name"]].build(section)


def help_text() -> str:
    lines = [f"  strategy:  name: one of {', '.join(registered_strategies())} "
             f"(default 'mirrored')"]
    for spec in _REGISTRY.values():
        lines.append(f"    name: {spec.name} -- {spec.help}")
        for k, f in spec.fields.items():
            lines.append(f"      {k} ({f.describe()}, default {f.default!r}): {f.help}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- built-in strategies
_CROSS_DEVICE_OPS = ("nccl", "hierarchical_copy", "reduction_to_one_device")


def _cross_device_ops(section: Mapping[str, Any]) -> Any:
    import jaxdist

    name = section["cross_device_ops"]
    if name == "nccl":
        return jaxdist.NcclAllReduce(num_packs=section["num_packs"])
    if name == "hierarchical_copy":
        return jaxdist.HierarchicalCopyAllReduce(num_packs=section["num_packs"])
    return jaxdist.ReductionToOneDevice()


def _devices(section: Mapping[str, Any]) -> Any:
    devs = section.get("devices")
    return list(devs) if devs else None


def _one_device(section: Mapping[str, Any]) -> Any:
    import jax

    import jaxdist

    return jaxdist.OneDeviceStrategy(section["device"] or jax.local_devices()[0])


def _mirrored(section: Mapping[str, Any]) -> Any:
    import jaxdist

    return jaxdist.MirroredStrategy(_devices(section), _cross_device_ops(section))


def _central_storage(section: Mapping[str, Any]) -> Any:
    import jaxdist

    return jaxdist.CentralStorageStrategy(_devices(section), section["parameter_device"])


def _tpu(section: Mapping[str, Any]) -> Any:
    import jaxdist

    resolver = jaxdist.cluster_resolver.TPUClusterResolver(tpu=section["tpu"])
    return jaxdist.TPUStrategy(resolver, devices=_devices(section))


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

register_strategy("one_device", _one_device, {
    "device": Field(str, None, "the device, e.g. '/gpu:0' or '/cpu:0' (null: the first local "
                    "device)", optional=True),
}, help="OneDeviceStrategy: everything on one device")
register_strategy("mirrored", _mirrored, {"devices": _DEVICES, **_CDO},
                  help="MirroredStrategy: synchronous data parallelism over local devices")
register_strategy("central_storage", _central_storage, {
    "devices": Field(list, None, "compute devices (null: every local device)", optional=True,
                     item=str),
    "parameter_device": Field(str, None, "where the single copy of the state lives (null: "
                              "the host CPU)", optional=True),
}, help="CentralStorageStrategy: one copy of the state, replicated compute")
register_strategy("tpu", _tpu, {
    "tpu": Field(str, "local", "TPUClusterResolver's tpu argument ('local' or a name)"),
    "devices": Field(list, None, "run on these devices instead of TPU cores (testing)",
                     optional=True, item=str),
}, help="TPUStrategy over the cores of the local TPU")
register_strategy("multi_worker", "jaxdist.strategies.multi_worker:strategy_from_config", {
    "communication": Field(str, "auto", "collective implementation: auto, ring (gloo on CPU, "
                           "NCCL on GPU), nccl (GPUs only)", choices=("auto", "ring", "nccl")),
    "timeout_seconds": Field(float, 60.0, "bound on joining the cluster and on every step; a "
                             "dead peer becomes PeerLostError naming it (null: 60)",
                             optional=True),
    "bytes_per_pack": Field(int, 0, "pack gradients into all-reduce buckets of this many bytes "
                            "(0: one bucket per dtype)", minimum=0),
}, help="MultiWorkerMirroredStrategy over the chief/worker tasks of TF_CONFIG",
    uses_tf_config=True)
register_strategy("parameter_server", "jaxdist.train.ps_config:strategy_from_config",
                  _ps_config.FIELDS,
                  help="ParameterServerStrategy: asynchronous training, variables on the ps "
                       "tasks of TF_CONFIG (local without it)", uses_tf_config=True)
register_strategy(_coordinator_config.NAME,
                  "jaxdist.train.coordinator_config:strategy_from_config",
                  _coordinator_config.FIELDS, help=_coordinator_config.HELP,
                  uses_tf_config=True)
