"""The ``parameter_server`` strategy of job configs: its keys, builder, optimizer and ps tasks.

``strategy.name: parameter_server`` builds a ``ParameterServerStrategy`` from ``TF_CONFIG``
(local training without it). The config's optimizer becomes a ``jaxdist.ps.optimizers`` spec the
ps tasks run; a ps task of the job (``TF_CONFIG`` task type ``ps``) serves instead of training.

Example:
    >>> cfg = load_config("configs/parameter_server.yaml")
    >>> ps_optimizer_from_config(cfg["optimizer"]).name
    'adam'
    >>> if is_ps_task(cfg):
    ...     raise SystemExit(serve(cfg))    # until the launcher stops it (SIGTERM)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from jaxdist.train.config import ConfigError, Field

#: Strategy names whose ``ps`` tasks serve variables (``serve``) instead of training.
PS_STRATEGY_NAMES: set[str] = {"parameter_server"}

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
    import jaxdist
    from jaxdist.ps.cluster import task_info

    if section["timeout"] <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {section['timeout']}")
    ps_strategy = None
    if section["placement"] == "greedy":
        num_ps = max(1, len(task_info(None).ps_addresses))
        ps_strategy = jaxdist.GreedyLoadBalancingStrategy(num_ps, jaxdist.byte_size_load_fn)
    return jaxdist.ParameterServerStrategy(
        None, _partitioner(section), ps_strategy=ps_strategy,
        max_staleness=section["max_staleness"], timeout=section["timeout"])


def _partitioner(section: Mapping[str, Any]) -> Any:
    import jaxdist

    kind, n, nbytes = (section["variable_partitioner"], section["num_shards"],
                       section["shard_bytes"])
    if kind is None:
        return None
    if kind == "fixed_shards":
        if n is None:
            raise ValueError("variable_partitioner 'fixed_shards' needs num_shards (e.g. 2)")
        return jaxdist.FixedShardsPartitioner(n)
    if kind == "min_size":
        return jaxdist.MinSizePartitioner(nbytes or 256 << 10, n or 1)
    if nbytes is None:
        raise ValueError("variable_partitioner 'max_size' needs shard_bytes (e.g. 65536)")
    return jaxdist.MaxSizePartitioner(nbytes, n)


def ps_optimizer_from_config(section: Mapping[str, Any]) -> Any:
    """The ``jaxdist.ps.optimizers`` spec for a validated ``optimizer`` section.

    ``clipnorm`` becomes ``clip_by_global_norm`` on the worker before the push; the optimizer
    itself runs on the ps tasks, per shard.

    Raises:
        ConfigError: the optimizer cannot run on a parameter server.
    """
    from jaxdist.ps import optimizers as O
    from jaxdist.train.job import learning_rate_from_config

    name, lr = section["name"], learning_rate_from_config(section)
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
    from jaxdist.train.coordinator_config import serves

    if serves(cfg):
        return True
    if cfg["strategy"]["name"] not in PS_STRATEGY_NAMES:
        return False
    from jaxdist.ps.cluster import task_info

    return task_info(None).task_type == "ps"


def serve(cfg: Mapping[str, Any]) -> int:
    """Runs this ps (or coordinator worker) task (``python -m jaxdist.server``) until it is
    stopped; returns its status.

    With ``checkpoint.dir`` and ``checkpoint.resume``, the ps restores the latest checkpoint the
    chief completed there.

    Raises:
        ConfigError: the job's optimizer cannot run on a ps (checked before serving).
    """
    check_config(cfg)
    from jaxdist.ps.task import main

    args: list[str] = []
    ckpt = cfg["checkpoint"]
    if ckpt["dir"] is not None:  # the ps saves only under its checkpoint root
        args += ["--checkpoint_root", os.path.abspath(ckpt["dir"])]
    if ckpt["dir"] is not None and ckpt["resume"]:
        args += ["--checkpoint_dir", os.path.abspath(ckpt["dir"])]
    return main(args)


__all__ = ["FIELDS", "PS_STRATEGY_NAMES", "check_config", "is_ps_task",
           "ps_optimizer_from_config", "serve", "strategy_from_config"]
