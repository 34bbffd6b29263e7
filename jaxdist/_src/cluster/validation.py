"""TF's multi-worker rules (``tf.distribute``'s ``multi_worker_util``), applied by the strategies.

``ClusterSpec`` and the resolvers accept any job name TF accepts (``"worker1"``, ``"sun"``);
the strategies apply TF's multi-worker rules here: jobs are ``chief``/``worker``/``ps``/
``evaluator``, at most one chief and one evaluator, this task exists (the evaluator may be
missing). Every violation raises ``ClusterConfigError`` (a ``ValueError``) whose message holds
TF's sentence and quotes the offending part of the configuration.

The helpers keep TF's names and behaviour: ``normalize_cluster_spec``, ``task_count``,
``is_chief``, ``worker_count``, ``id_in_cluster``, ``collective_leader``
(``should_save_checkpoint`` / ``should_load_checkpoint`` live in ``bringup``, next to the
joined group they read).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from jaxdist._src.cluster.cluster_spec import ClusterSpec
from jaxdist._src.cluster.errors import ClusterConfigError

TASK_TYPES = ("chief", "worker", "ps", "evaluator")
TRAINING_TASK_TYPES = ("chief", "worker")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


def quote(value: Any, limit: int = 300) -> str:
    """Compact JSON of ``value`` for error messages, shortened to ``limit`` characters.

    Never raises: values too deep or too large to print become ``<list ...>``.

    Example:
        >>> from jaxdist._src.cluster.validation import quote
        >>> quote({"worker": ["a:1"]})
        '{"worker": ["a:1"]}'
    """
    try:
        text = json.dumps(value, sort_keys=False)
    except (TypeError, ValueError, RecursionError, OverflowError):
        try:
            text = repr(value)
        except (ValueError, RecursionError, OverflowError):
            text = f"<{type(value).__name__} too large or too deep to print>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def task_name(task_type: str | None, task_id: int | None) -> str:
    """``"worker:1"``: how errors and logs name a task.

    Example:
        >>> from jaxdist._src.cluster.validation import task_name
        >>> task_name("worker", 1)
        'worker:1'
    """
    return f"{task_type}:{task_id}"


def split_address(address: str, where: str = "address") -> tuple[str, int]:
    """Splits ``"host:port"`` (or ``"[v6]:port"``) and checks the port.

    Raises:
        ClusterConfigError: ``address`` is not ``host:port`` with a port in 1..65535.

    Example:
        >>> from jaxdist._src.cluster.validation import split_address
        >>> split_address("[::1]:2222")
        ('[::1]', 2222)
    """
    if not isinstance(address, str) or ":" not in address:
        raise ClusterConfigError(
            f"{where} is {quote(address)}: expected \"host:port\" (e.g. \"10.0.0.1:2222\")"
        )
    host, _, port_s = address.rpartition(":")
    if address.startswith("[") and "]" not in host:
        raise ClusterConfigError(f"{where} is {quote(address)}: expected \"[ipv6]:port\"")
    port = int(port_s) if port_s.isdigit() and len(port_s) <= 5 else -1
    if not host or not 0 < port < 65536:
        raise ClusterConfigError(
            f"{where} is {quote(address)}: expected \"host:port\" with a port in 1..65535"
        )
    return host, port


# ---------------------------------------------------------------------- TF's multi_worker_util
def normalize_cluster_spec(cluster_spec: Any) -> ClusterSpec:
    """``cluster_spec`` (a dict, a ``ClusterSpec`` or a ClusterDef-like dict) as a ``ClusterSpec``.

    Raises:
        ValueError: anything else (TF's message).

    Example:
        >>> from jaxdist._src.cluster.validation import normalize_cluster_spec
        >>> normalize_cluster_spec({"worker": ["a:1"]}).jobs
        ['worker']
    """
    if isinstance(cluster_spec, ClusterSpec):
        return cluster_spec
    if isinstance(cluster_spec, Mapping):
        return ClusterSpec(cluster_spec)
    raise ClusterConfigError(
        f"`cluster_spec' should be dict or a `tf.train.ClusterSpec` or a "
        f"`tf.train.ClusterDef` object; got {quote(cluster_spec)}"
    )


def task_count(cluster_spec: Any, task_type: str) -> int:
    """How many tasks the job has (0 when the cluster has no such job).

    Example:
        >>> from jaxdist._src.cluster.validation import task_count
        >>> task_count({"worker": ["a:1", "b:1"]}, "chief")
        0
    """
    spec = normalize_cluster_spec(cluster_spec)
    return spec.num_tasks(task_type) if task_type in spec else 0


def validate_cluster_spec(cluster_spec: Any, task_type: str | None, task_id: int | None,
                          source: str = "cluster") -> None:
    """Checks the cluster and this task with TF's multi-worker rules.

    The rules of TF's ``multi_worker_util._validate_cluster_spec``: every job is one of
    ``chief``, ``worker``, ``ps``, ``evaluator``; ``task_type`` is one of them (or ``None``);
    it is a job of the cluster (the evaluator may be missing); at most one chief and one
    evaluator; ``task_id`` names a task of the job.

    Args:
        cluster_spec: the cluster (``ClusterSpec`` or dict).
        task_type: this task's type (``None``: only the cluster is checked).
        task_id: this task's index.
        source: how the configuration is named in messages (``"TF_CONFIG"``).

    Raises:
        ClusterConfigError: a rule is broken; the message has TF's sentence and quotes the
            bad part of the configuration.

    Example:
        >>> from jaxdist._src.cluster.validation import validate_cluster_spec
        >>> validate_cluster_spec({"worker": ["a:1"]}, "worker", 0)
        >>> validate_cluster_spec({"worker": ["a:1"]}, "worker", 1)
        Traceback (most recent call last):
        jaxdist.ClusterConfigError: cluster "task" is {"type": "worker", "index": 1}:
        The `task_id` 1 ...
    """
    spec = normalize_cluster_spec(cluster_spec)
    d = spec.as_dict()
    for job in spec.jobs:
        if job not in TASK_TYPES:
            raise ClusterConfigError(
                f"{source} \"cluster\" has job {quote({job: d[job]})}: Disallowed task type "
                f"found in cluster spec: {job!r}; multi-worker strategies accept the jobs "
                f"{', '.join(TASK_TYPES)}"
            )
    task = {"type": task_type, "index": task_id}
    if task_type is not None and task_type not in TASK_TYPES:
        raise ClusterConfigError(
            f"{source} \"task\" is {quote(task)}: Unrecognized task_type: {task_type!r}, valid "
            f"task types are: {', '.join(TASK_TYPES)}"
        )
    if task_type and task_type not in spec and task_type != "evaluator":
        raise ClusterConfigError(
            f"{source} \"task\" is {quote(task)}: `task_type` {task_type!r} not found in "
            f"cluster_spec (jobs: {spec.jobs})"
        )
    for single in ("chief", "evaluator"):
        if task_count(spec, single) > 1:
            raise ClusterConfigError(
                f"{source} \"cluster\" has {quote({single: d[single]})}: There must be at most "
                f"one {single!r} job."
            )
    if task_type is None:
        return
    if isinstance(task_id, bool) or not isinstance(task_id, int) or task_id < 0:
        raise ClusterConfigError(
            f"{source} \"task\" is {quote(task)}: the index must be a non-negative integer"
        )
    if task_type in spec:
        # TF compares with the task count; a sparse job must also hold the index itself.
        indices = spec.task_indices(task_type)
        if (task_id >= len(indices)) if spec.is_dense(task_type) else task_id not in indices:
            raise ClusterConfigError(
                f"{source} \"task\" is {quote(task)}: The `task_id` {task_id} exceeds the "
                f"maximum id of {task_type}: {quote({task_type: d[task_type]})} has no task "
                f"{task_id} (indices: {indices})"
            )


_validate_cluster_spec = validate_cluster_spec


def is_chief(cluster_spec: Any, task_type: str | None, task_id: int | None) -> bool:
    """TF's rule: the chief; worker 0 when there is no chief job; the evaluator (its own chief).

    Raises:
        ClusterConfigError: the task is not in the cluster (see ``validate_cluster_spec``).

    Example:
        >>> from jaxdist._src.cluster.validation import is_chief
        >>> is_chief({"worker": ["a:1", "b:1"]}, "worker", 0)
        True
    """
    validate_cluster_spec(cluster_spec, task_type, task_id)
    if task_type == "evaluator":
        return True
    return is_training_chief(normalize_cluster_spec(cluster_spec).as_dict(), task_type, task_id)


def is_training_chief(cluster: Mapping[str, Any], task_type: str | None, task_id: int) -> bool:
    """The one chief rule of a training cluster: the ``chief`` task, else worker 0.

    ``task_type`` ``None`` is a task outside any cluster (a local run): it is its own chief.
    No validation here (``is_chief`` validates first); the evaluator is not a training task.

    Example:
        >>> from jaxdist._src.cluster.validation import is_training_chief
        >>> is_training_chief({"chief": ["a:1"], "worker": ["b:1"]}, "worker", 0)
        False
    """
    if task_type == "chief":
        return True
    return task_type in ("worker", None) and task_id == 0 and not cluster.get("chief")


def worker_count(cluster_spec: Any, task_type: str) -> int:
    """Workers of the training cluster: chief + workers (an evaluator counts its own job).

    Raises:
        ClusterConfigError: ``task_type`` is ``"ps"`` or not in the cluster.

    Example:
        >>> from jaxdist._src.cluster.validation import worker_count
        >>> worker_count({"chief": ["a:1"], "worker": ["b:1", "c:1"]}, task_type="worker")
        3
    """
    validate_cluster_spec(cluster_spec, task_type, task_id=0)
    spec = normalize_cluster_spec(cluster_spec)
    if task_type not in ("chief", "worker", "evaluator"):
        raise ClusterConfigError(
            f"Unexpected `task_type` {task_type!r}: worker_count is for chief, worker and "
            f"evaluator tasks"
        )
    if task_type == "evaluator":
        return task_count(spec, "evaluator")
    return task_count(spec, "chief") + task_count(spec, "worker")


def id_in_cluster(cluster_spec: Any, task_type: str, task_id: int) -> int:
    """A unique id in ``[0, worker_count)``: the chief is 0, workers follow it.

    Raises:
        ClusterConfigError: ``task_type`` is ``"ps"`` (TF: no id) or the task is invalid.

    Example:
        >>> from jaxdist._src.cluster.validation import id_in_cluster
        >>> id_in_cluster({"chief": ["a:1"], "worker": ["b:1", "c:1"]}, "worker", 1)
        2
    """
    validate_cluster_spec(cluster_spec, task_type, task_id)
    spec = normalize_cluster_spec(cluster_spec)
    if task_type == "chief":
        return 0
    if task_type == "worker":
        return task_id + task_count(spec, "chief")
    if task_type == "evaluator":
        return task_id
    raise ClusterConfigError(f"There is no id for task_type {task_type!r}")


def collective_leader(cluster_spec: Any, task_type: str | None, task_id: int | None) -> str:
    """The device prefix of the collective leader: the chief, else worker 0; ``""`` locally.

    Example:
        >>> from jaxdist._src.cluster.validation import collective_leader
        >>> collective_leader({"worker": ["a:1", "b:1"]}, "worker", 1)
        '/job:worker/replica:0/task:0'
    """
    spec = normalize_cluster_spec(cluster_spec)
    if not spec:
        return ""
    validate_cluster_spec(spec, task_type, task_id)
    if task_type == "evaluator":
        return ""
    if "chief" in spec:
        return "/job:chief/replica:0/task:0"
    if "worker" not in spec:
        raise ClusterConfigError(
            f"cluster {quote(spec.as_dict())} has neither a 'chief' nor a 'worker' job to lead "
            f"the collectives"
        )
    return "/job:worker/replica:0/task:0"


def training_tasks(spec: ClusterSpec) -> list[tuple[str, int]]:
    """The tasks of the synchronous training group, in process order: chief, then workers.

    ``ps`` and ``evaluator`` tasks are not part of it.

    Example:
        >>> from jaxdist._src.cluster.validation import training_tasks
        >>> from jaxdist.cluster_resolver import ClusterSpec
        >>> training_tasks(ClusterSpec({"worker": ["b:1"], "chief": ["a:1"]}))
        [('chief', 0), ('worker', 0)]
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
    "collective_leader",
    "id_in_cluster",
    "is_chief",
    "normalize_cluster_spec",
    "quote",
    "split_address",
    "task_count",
    "task_name",
    "training_tasks",
    "validate_cluster_spec",
    "worker_count",
]
