"""The parameter-server strategies of job configs: their keys, builders, optimizer and serving.

``strategy.name: parameter_server`` builds a ``ParameterServerStrategy`` from ``TF_CONFIG``
(local training without it). The config's optimizer becomes a ``jaxdist.ps.optimizers`` spec the
ps tasks run; a ps task of the job (``TF_CONFIG`` task type ``ps``) serves instead of training.

``strategy.name: parameter_server_coordinator`` runs ``Trainer.fit`` on the chief of a
``TF_CONFIG`` cluster with ``chief``, ``worker`` and ``ps`` jobs: the chief builds a
``ParameterServerStrategy`` and a ``ClusterCoordinator`` on it, and the ``Trainer`` schedules
its steps onto the worker tasks (``jaxdist._src.train.parameter_server.coordinated``). ps and worker
tasks run ``python -m jaxdist.server`` (``python -m jaxdist.launch --coordinator`` starts them);
when they run ``python -m jaxdist.train`` with this config instead, they serve the same way.

Both are registered in ``jaxdist._src.job.strategy_registry``.

Example:
    >>> from jaxdist._src.job.parameter_server import is_ps_task, ps_optimizer_from_config, serve
    >>> from jaxdist._src.job.config import load_config
    >>> cfg = load_config(raw={"strategy": {"name": "parameter_server"},
    ...                        "optimizer": {"name": "adam"}})
    >>> ps_optimizer_from_config(cfg["optimizer"]).name
    'adam'
    >>> if is_ps_task(cfg):
    ...     raise SystemExit(serve(cfg))    # until the launcher stops it (SIGTERM)
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Mapping
from typing import Any

from jaxdist._src.cluster.task_info import task_info
from jaxdist._src.job.schema import ConfigError, Field
from jaxdist._src.job.strategy_registry import register_strategy
from jaxdist._src.ps.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
)
from jaxdist._src.ps.placement import GreedyLoadBalancingStrategy, byte_size_load_fn
from jaxdist._src.strategies.parameter_server import ParameterServerStrategy
from jaxdist._src.train.learning_rate import schedule_args

NAME = "parameter_server"
COORDINATOR_NAME = "parameter_server_coordinator"
HELP = ("ParameterServerStrategy: asynchronous training, variables on the ps tasks of "
        "TF_CONFIG (local without it)")
COORDINATOR_HELP = ("ParameterServerStrategy with a ClusterCoordinator (TF2): the chief "
                    "schedules steps onto the worker tasks of TF_CONFIG, variables on the ps "
                    "tasks")

FIELDS: dict[str, Field] = {
    "max_staleness": Field(int, None, "bounded staleness (SSP): a worker waits while it is more "
                           "than this many steps ahead of the slowest (null: fully "
                           "asynchronous)", optional=True, minimum=0),
    "variable_partitioner": Field(str, None, "split variables on axis 0 across ps tasks (null: "
                                  "whole variables)", optional=True,
                                  choices=("fixed_shards", "min_size", "max_size")),
    "num_shards": Field(int, None, "fixed_shards: shards per variable; min_size/max_size: at "
                        "most this many", optional=True, minimum=1),
    "shard_bytes": Field(int, None, "min_size: min bytes per shard (default 256 KiB); "
                         "max_size: max bytes per shard (required)", optional=True, minimum=1),
    "placement": Field(str, "round_robin", "how shards are assigned to ps tasks",
                       choices=("round_robin", "greedy")),
    "timeout": Field(float, 60.0, "seconds before an RPC or a wait on another task fails with "
                     "an error naming the task", minimum=0.0),
}


def strategy_from_config(section: Mapping[str, Any]) -> Any:
    """Builds ``ParameterServerStrategy`` from a validated ``strategy`` section.

    Raises:
        ValueError: a partitioner without the size it needs, or a non-positive timeout.
    """
    if section["timeout"] <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {section['timeout']}")
    ps_strategy = None
    if section["placement"] == "greedy":
        num_ps = max(1, len(task_info(None).ps_addresses))
        ps_strategy = GreedyLoadBalancingStrategy(num_ps, byte_size_load_fn)
    return ParameterServerStrategy(
        None, _partitioner(section), ps_strategy=ps_strategy,
        max_staleness=section["max_staleness"], timeout=section["timeout"])


def _partitioner(section: Mapping[str, Any]) -> Any:
    kind, n, nbytes = (section["variable_partitioner"], section["num_shards"],
                       section["shard_bytes"])
    if kind is None:
        return None
    if kind == "fixed_shards":
        if n is None:
            raise ValueError("variable_partitioner 'fixed_shards' needs num_shards (e.g. 2)")
        return FixedShardsPartitioner(n)
    if kind == "min_size":
        return MinSizePartitioner(nbytes or 256 << 10, n or 1)
    if nbytes is None:
        raise ValueError("variable_partitioner 'max_size' needs shard_bytes (e.g. 65536)")
    return MaxSizePartitioner(nbytes, n)


def ps_learning_rate_from_config(section: Mapping[str, Any]) -> Any:
    """The learning rate of a validated ``optimizer`` section as the ps tasks take it: a
    float, or a ``jaxdist.ps.optimizers`` schedule spec (the schedule
    ``jaxdist._src.train.learning_rate.schedule_args`` names, which the ps rebuilds and
    evaluates on the global step).

    Example:
        >>> from jaxdist._src.job.parameter_server import ps_learning_rate_from_config
        >>> lr = ps_learning_rate_from_config({"learning_rate": 0.1, "schedule": "cosine",
        ...                                    "decay_steps": 100, "end_learning_rate": 0.0})
        >>> lr.name, round(float(lr(50)), 6)
        ('cosine_decay_schedule', 0.05)
    """
    from jaxdist._src.ps import optimizers as O

    try:
        args = schedule_args(section)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args is None:
        return section["learning_rate"]
    name, kwargs = args
    return getattr(O, name)(**kwargs)


def ps_optimizer_from_config(section: Mapping[str, Any]) -> Any:
    """The ``jaxdist.ps.optimizers`` spec for a validated ``optimizer`` section.

    ``clipnorm`` becomes ``clip_by_global_norm`` on the worker before the push; the optimizer
    itself runs on the ps tasks, per shard.

    Raises:
        ConfigError: the optimizer cannot run on a parameter server.
    """
    from jaxdist._src.ps import optimizers as O

    name, lr = section["name"], ps_learning_rate_from_config(section)
    makers = {
        "sgd": lambda: O.sgd(lr, momentum=section.get("momentum") or None),
        "adam": lambda: O.adam(lr),
        "adamw": lambda: O.adamw(lr, weight_decay=section.get("weight_decay", 1e-4)),
        "rmsprop": lambda: O.rmsprop(lr, momentum=section.get("momentum") or None),
    }
    if name not in makers:
        raise ConfigError(
            f"optimizer.name: {name!r} cannot run on a parameter server (strategy "
            f"'parameter_server' applies the update per shard on the ps tasks); expected one of: "
            f"{', '.join(makers)}")
    try:
        spec = makers[name]()
        if section.get("clipnorm") is not None:
            spec = O.chain(O.clip_by_global_norm(section["clipnorm"]), spec)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"optimizer: {dict(section)!r} cannot run on a parameter server: "
                          f"{e}") from None
    return spec


def check_config(cfg: Mapping[str, Any]) -> None:
    """Checks what the ``parameter_server`` strategy needs beyond the schema.

    Raises:
        ConfigError: the optimizer cannot run on the ps tasks.
    """
    ps_optimizer_from_config(cfg["optimizer"])


def is_ps_task(cfg: Mapping[str, Any]) -> bool:
    """Whether this process serves instead of training (from ``TF_CONFIG``): a ps task of a
    parameter-server job, or a ps or worker task of a ``parameter_server_coordinator`` job."""
    name = cfg["strategy"]["name"]
    if name == COORDINATOR_NAME:
        return task_info(None).task_type in ("ps", "worker")
    return name == NAME and task_info(None).task_type == "ps"


def serve(cfg: Mapping[str, Any]) -> int:
    """Runs this ps (or coordinator worker) task (``python -m jaxdist.server``) until it is
    stopped; returns its status.

    With ``checkpoint.dir`` and ``checkpoint.resume``, the ps restores the latest checkpoint the
    chief completed there.

    Raises:
        ConfigError: the job's optimizer cannot run on a ps (checked before serving).
    """
    from jaxdist._src.coordinator.server import main

    check_config(cfg)

    args: list[str] = []
    ckpt = cfg["checkpoint"]
    if ckpt["dir"] is not None:  # the ps saves only under its checkpoint root
        args += ["--checkpoint_root", os.path.abspath(ckpt["dir"])]
    if ckpt["dir"] is not None and ckpt["resume"]:
        args += ["--checkpoint_dir", os.path.abspath(ckpt["dir"])]
    return main(args)


COORDINATOR_FIELDS: dict[str, Field] = {
    **{k: v for k, v in FIELDS.items() if k != "max_staleness"},
    "heartbeat_interval": Field(float, 1.0, "seconds between the chief's heartbeats to every "
                                "worker and ps task", minimum=0.0),
    "heartbeat_timeout": Field(float, 10.0, "seconds without a heartbeat answer before a "
                               "worker is down (its step runs again on another worker)",
                               minimum=0.0),
    "join_timeout": Field(float, 600.0, "seconds the chief waits for scheduled steps without "
                          "any of them finishing before it fails naming the busy/down workers",
                          minimum=0.0),
}

def _positive(section: Mapping[str, Any], key: str) -> float:
    value = float(section[key])
    if value <= 0:
        raise ValueError(f"{key} must be > 0 seconds, got {section[key]}")
    return value


def coordinator_strategy_from_config(section: Mapping[str, Any]) -> Any:
    """Builds the chief's ``ParameterServerStrategy`` and its ``ClusterCoordinator``.

    The coordinator is attached to the strategy (``ClusterCoordinator`` does that), which is
    how the ``Trainer`` picks its coordinator hook; it is shut down when the process exits.

    Raises:
        ValueError: no ``TF_CONFIG`` cluster, this task is not the chief, a job is missing,
            a non-positive timeout, or a partitioner without the size it needs.
    """
    from jaxdist._src.coordinator.cluster_coordinator import ClusterCoordinator

    name = COORDINATOR_NAME
    timeout = _positive(section, "timeout")
    interval = _positive(section, "heartbeat_interval")
    hb_timeout = _positive(section, "heartbeat_timeout")
    join_timeout = _positive(section, "join_timeout")
    if hb_timeout <= interval:
        raise ValueError(f"heartbeat_timeout ({hb_timeout}) must be longer than "
                         f"heartbeat_interval ({interval})")
    info = task_info(None)
    launch = ("start the job with python -m jaxdist.launch --coordinator --workers 2 --ps 1 "
              "-- python -m jaxdist.train --config ...")
    if not info.cluster:
        raise ValueError(f"strategy {name!r} runs on the chief of a TF_CONFIG cluster with "
                         f"chief, worker and ps jobs, but TF_CONFIG is not set; {launch}")
    missing = [job for job in ("chief", "worker", "ps") if not info.cluster.get(job)]
    if missing:
        raise ValueError(f"strategy {name!r} needs chief, worker and ps jobs in TF_CONFIG; its "
                         f"cluster has {sorted(info.cluster)} (missing {', '.join(missing)}); "
                         f"{launch}")
    if info.task_type != "chief":
        raise ValueError(f"strategy {name!r} trains on the chief; this task is {info.name}, "
                         f"expected chief:0 (worker and ps tasks run python -m jaxdist.server)")
    ps_strategy = None
    if section["placement"] == "greedy":
        ps_strategy = GreedyLoadBalancingStrategy(len(info.ps_addresses),
                                                  byte_size_load_fn)
    strategy = ParameterServerStrategy(
        None, _partitioner(section), ps_strategy=ps_strategy, timeout=timeout)
    coordinator = ClusterCoordinator(strategy, heartbeat_interval=interval,
                                     heartbeat_timeout=hb_timeout, join_timeout=join_timeout,
                                     rpc_timeout=timeout)
    atexit.register(_shutdown, coordinator)
    return strategy


def _shutdown(coordinator: Any) -> None:
    try:
        coordinator.shutdown()
    except Exception as e:  # noqa: BLE001 - at exit: report, do not raise
        print(f"[coordinator] shutdown: {e}", flush=True)


# The two config names, registered when the registry first needs them (see
# strategy_registry._DEFERRED).
_PS_OPTIONS = dict(uses_tf_config=True, optimizer=ps_optimizer_from_config, check=check_config,
                   serves=is_ps_task, serve=serve)
register_strategy(ParameterServerStrategy, NAME, strategy_from_config, FIELDS, help=HELP,
                  **_PS_OPTIONS)
register_strategy(ParameterServerStrategy, COORDINATOR_NAME, coordinator_strategy_from_config,
                  COORDINATOR_FIELDS, help=COORDINATOR_HELP, **_PS_OPTIONS)

__all__ = ["COORDINATOR_FIELDS", "COORDINATOR_NAME", "FIELDS", "NAME", "check_config",
           "coordinator_strategy_from_config", "is_ps_task", "ps_learning_rate_from_config",
           "ps_optimizer_from_config", "serve",
           "strategy_from_config"]
