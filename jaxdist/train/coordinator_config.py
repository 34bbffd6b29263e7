"""The ``parameter_server_coordinator`` strategy of job configs (TF2 ``ClusterCoordinator``).

``strategy.name: parameter_server_coordinator`` runs ``Trainer.fit`` on the chief of a
``TF_CONFIG`` cluster with ``chief``, ``worker`` and ``ps`` jobs: the chief builds a
``ParameterServerStrategy`` and a ``ClusterCoordinator`` on it, and the ``Trainer`` schedules
its steps onto the worker tasks (``jaxdist.train.coordinator_step``). ps and worker tasks run
``python -m jaxdist.server`` (``python -m jaxdist.launch --coordinator`` starts them); when they
run ``python -m jaxdist.train`` with this config instead, they serve the same way.

Example:
    >>> cfg = load_config("configs/parameter_server_coordinator.yaml")
    >>> strategy = strategy_from_config(cfg["strategy"])     # on chief:0 of TF_CONFIG
    >>> strategy._jaxdist_coordinator
    ClusterCoordinator(workers=2, down=[])
"""

from __future__ import annotations

import atexit
from collections.abc import Mapping
from typing import Any

from jaxdist.train import ps_config
from jaxdist.train.config import Field

NAME = "parameter_server_coordinator"

FIELDS: dict[str, Field] = {
    **{k: v for k, v in ps_config.FIELDS.items() if k != "max_staleness"},
    "heartbeat_interval": Field(float, 1.0, "seconds between the chief's heartbeats to every "
                                "worker and ps task", minimum=0.0),
    "heartbeat_timeout": Field(float, 10.0, "seconds without a heartbeat answer before a "
                               "worker is down (its step runs again on another worker)",
                               minimum=0.0),
    "join_timeout": Field(float, 600.0, "seconds the chief waits for scheduled steps without "
                          "any of them finishing before it fails naming the busy/down workers",
                          minimum=0.0),
}

HELP = ("ParameterServerStrategy with a ClusterCoordinator (TF2): the chief schedules steps "
        "onto the worker tasks of TF_CONFIG, variables on the ps tasks")


def _positive(section: Mapping[str, Any], key: str) -> float:
    value = float(section[key])
    if value <= 0:
        raise ValueError(f"{key} must be > 0 seconds, got {section[key]}")
    return value


def strategy_from_config(section: Mapping[str, Any]) -> Any:
    """Builds the chief's ``ParameterServerStrategy`` and its ``ClusterCoordinator``.

    The coordinator is attached to the strategy (``ClusterCoordinator`` does that), which is
    how the ``Trainer`` picks its coordinator hook; it is shut down when the process exits.

    Raises:
        ValueError: no ``TF_CONFIG`` cluster, this task is not the chief, a job is missing,
            a non-positive timeout, or a partitioner without the size it needs.
    """
    import jaxdist
    from jaxdist.coordinator import ClusterCoordinator
    from jaxdist.ps.cluster import task_info

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
        raise ValueError(f"strategy {NAME!r} runs on the chief of a TF_CONFIG cluster with "
                         f"chief, worker and ps jobs, but TF_CONFIG is not set; {launch}")
    missing = [job for job in ("chief", "worker", "ps") if not info.cluster.get(job)]
    if missing:
        raise ValueError(f"strategy {NAME!r} needs chief, worker and ps jobs in TF_CONFIG; its "
                         f"cluster has {sorted(info.cluster)} (missing {', '.join(missing)}); "
                         f"{launch}")
    if info.task_type != "chief":
        raise ValueError(f"strategy {NAME!r} trains on the chief; this task is {info.name}, "
                         f"expected chief:0 (worker and ps tasks run python -m jaxdist.server)")
    ps_strategy = None
    if section["placement"] == "greedy":
        ps_strategy = jaxdist.GreedyLoadBalancingStrategy(len(info.ps_addresses),
                                                          jaxdist.byte_size_load_fn)
    strategy = jaxdist.ParameterServerStrategy(
        None, ps_config._partitioner(section), ps_strategy=ps_strategy, timeout=timeout)
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


def serves(cfg: Mapping[str, Any]) -> bool:
    """Whether this process serves (a ``ps`` or ``worker`` task of this strategy's job)."""
    if cfg["strategy"]["name"] != NAME:
        return False
    from jaxdist.ps.cluster import task_info

    return task_info(None).task_type in ("ps", "worker")


__all__ = ["FIELDS", "HELP", "NAME", "serves", "strategy_from_config"]
