"""TF's cluster rules: known task types, one chief, one evaluator, tasks that exist, addresses.

The checks follow ``tf.distribute``'s ``multi_worker_util`` and add address checks: every
violation raises ``ClusterConfigError`` quoting the offending part of the configuration.
"""

from __future__ import annotations

import json
from typing import Any

from jaxdist.cluster.cluster_spec import ClusterSpec
from jaxdist.cluster.errors import ClusterConfigError

TASK_TYPES = ("chief", "worker", "ps", "evaluator")
TRAINING_TASK_TYPES = ("chief", "worker")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


def quote(value: Any) -> str:
    """Compact JSON of ``value`` for error messages (falls back to ``repr``)."""
    try:
        text = json.dumps(value, sort_keys=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 300 else text[:297] + "..."


def task_name(task_type: str | None, task_id: int | None) -> str:
    """``"worker:1"``: how errors and logs name a task."""
    return f"{task_type}:{task_id}"


def split_address(address: str, where: str = "address") -> tuple[str, int]:
    """Splits ``"host:port"`` (or ``"[v6]:port"``) and checks the port.

    Raises:
        ClusterConfigError: ``address`` is not ``host:port`` with a port in 1..65535.
    """
    if not isinstance(address, str) or ":" not in address:
        raise ClusterConfigError(
            f"{where} is {quote(address)}: expected \"host:port\" (e.g. \"10.0.0.1:2222\")"
        )
    host, _, port_s = address.rpartition(":")
    if address.startswith("[") and "]" not in host:
        raise ClusterConfigError(f"{where} is {quote(address)}: expected \"[ipv6]:port\"")
    try:
        port = int(port_s)
    except ValueError:
        port = -1
    if not host or not 0 < port < 65536:
        raise ClusterConfigError(
            f"{where} is {quote(address)}: expected \"host:port\" with a port in 1..65535"
        )
    return host, port


def validate_cluster_spec(spec: ClusterSpec, task_type: str | None, task_id: int | None,
                          source: str = "cluster") -> None:
    """Checks ``spec`` and this task against TF's rules.

    Args:
        spec: the cluster.
        task_type: this task's type (``None``: only the cluster is checked).
        task_id: this task's index.
        source: how the configuration is named in messages (``"TF_CONFIG"``).

    Raises:
        ClusterConfigError: a rule is broken; the message quotes the bad part of the config.
    """
    d = spec.as_dict()
    for job in spec.jobs:
        if job not in TASK_TYPES:
            raise ClusterConfigError(
                f"{source} \"cluster\" has job {quote({job: d[job]})}: unknown task type "
                f"{job!r}; expected one of {', '.join(TASK_TYPES)}"
            )
        for idx in spec.task_indices(job):
            split_address(spec.task_address(job, idx),
                          f"{source} \"cluster\" {quote(job)}[{idx}]")
    for single in ("chief", "evaluator"):
        if single in spec and spec.num_tasks(single) > 1:
            raise ClusterConfigError(
                f"{source} \"cluster\" has {quote({single: d[single]})}: there must be at most "
                f"one {single!r} task"
            )
    if task_type is None and task_id is None:
        return
    task = {"type": task_type, "index": task_id}
    if task_type not in TASK_TYPES:
        raise ClusterConfigError(
            f"{source} \"task\" is {quote(task)}: unknown task type {task_type!r}; expected one "
            f"of {', '.join(TASK_TYPES)}"
        )
    if isinstance(task_id, bool) or not isinstance(task_id, int) or task_id < 0:
        raise ClusterConfigError(
            f"{source} \"task\" is {quote(task)}: the index must be a non-negative integer"
        )
    if task_type == "evaluator" and task_type not in spec:
        return  # TF: the evaluator may be missing from the cluster.
    if task_type not in spec:
        raise ClusterConfigError(
            f"{source} \"task\" is {quote(task)}, but the cluster has no {task_type!r} job "
            f"(jobs: {spec.jobs})"
        )
    if task_id not in spec.task_indices(task_type):
        raise ClusterConfigError(
            f"{source} \"task\" is {quote(task)}, but {quote({task_type: d[task_type]})} has no "
            f"task {task_id} (indices: {spec.task_indices(task_type)})"
        )


def is_chief(spec: ClusterSpec, task_type: str | None, task_id: int | None) -> bool:
    """TF's rule: the ``chief`` task, or worker 0 when there is no chief; no cluster: True."""
    if not spec or task_type is None:
        return True
    if task_type == "chief":
        return True
    return task_type == "worker" and task_id == 0 and "chief" not in spec


def training_tasks(spec: ClusterSpec) -> list[tuple[str, int]]:
    """The tasks of the synchronous training group, in process order: chief, then workers.

    ``ps`` and ``evaluator`` tasks are not part of it.
    """
    out: list[tuple[str, int]] = []
    for job in TRAINING_TASK_TYPES:
        if job in spec:
            out.extend((job, i) for i in spec.task_indices(job))
    return out


__all__ = [
    "LOOPBACK_HOSTS",
    "TASK_TYPES",
    "TRAINING_TASK_TYPES",
    "is_chief",
    "quote",
    "split_address",
    "task_name",
    "training_tasks",
    "validate_cluster_spec",
]
