"""What the ps runtime needs from a cluster resolver: ps/worker addresses, this task, the token.

Works with ``jaxdist._src.cluster`` resolvers and with anything duck-typed like them: an object with
``cluster_spec()`` (returning a ``ClusterSpec`` with ``as_dict()`` or a plain dict of job name ->
list of addresses), ``task_type``, ``task_id`` and ``cluster_token``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jaxdist._src.cluster.resolver import TOKEN_ENV
from jaxdist._src.cluster.validation import is_training_chief


def cluster_dict(resolver_or_spec: Any) -> dict[str, list[str]]:
    """The cluster as ``{job: [address, ...]}`` from a resolver, a ClusterSpec or a dict.

    Example:
        >>> from jaxdist._src.cluster.task_info import cluster_dict
        >>> cluster_dict({"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223"]})
        {'ps': ['127.0.0.1:2222'], 'worker': ['127.0.0.1:2223']}
    """
    spec = resolver_or_spec
    if hasattr(spec, "cluster_spec") and callable(spec.cluster_spec):
        spec = spec.cluster_spec()
    if hasattr(spec, "as_dict"):
        spec = spec.as_dict()
    if spec is None:
        return {}
    if not isinstance(spec, dict):
        raise TypeError(
            f"expected a cluster resolver, a ClusterSpec or a dict of job -> addresses, "
            f"got {type(resolver_or_spec).__name__}"
        )
    out: dict[str, list[str]] = {}
    for job, tasks in spec.items():
        if isinstance(tasks, dict):  # sparse job {index: address}
            tasks = [tasks[k] for k in sorted(tasks, key=int)]
        out[str(job)] = [str(a) for a in tasks]
    return out


def cluster_token(resolver: Any) -> str | None:
    """The cluster token: the resolver's ``cluster_token``, else ``$JAXDIST_CLUSTER_TOKEN``."""
    token = getattr(resolver, "cluster_token", None)
    if callable(token):
        token = token()
    return token or os.environ.get(TOKEN_ENV) or None


@dataclass(frozen=True)
class TaskInfo:
    """This process's place in a ps cluster.

    Attributes:
        cluster: ``{job: [address, ...]}``.
        task_type: ``"ps"``, ``"worker"``, ``"chief"``, ``"evaluator"`` or ``None`` (local).
        task_id: index in its job.
        token: the cluster token (``None``: none configured).
    """

    cluster: dict[str, list[str]]
    task_type: str | None
    task_id: int
    token: str | None

    @property
    def ps_addresses(self) -> list[str]:
        return list(self.cluster.get("ps", []))

    @property
    def num_workers(self) -> int:
        """Workers that train: the chief (if a ``chief`` job exists) plus the ``worker`` job."""
        return len(self.cluster.get("chief", [])) + len(self.cluster.get("worker", []))

    @property
    def worker_index(self) -> int:
        """This worker's index among all training workers (the chief is 0)."""
        has_chief = bool(self.cluster.get("chief"))
        if self.task_type == "chief":
            return 0
        return self.task_id + (1 if has_chief else 0)

    @property
    def is_chief(self) -> bool:
        """TF's rule: the ``chief`` task, or worker 0 when the cluster has no chief job."""
        return is_training_chief(self.cluster, self.task_type, self.task_id)

    @property
    def name(self) -> str:
        return f"{self.task_type}:{self.task_id}" if self.task_type else "local"


def task_info(resolver: Any) -> TaskInfo:
    """Reads a resolver (or ``None``: ``TF_CONFIG`` from the environment) into a ``TaskInfo``."""
    if resolver is None:
        resolver = _env_resolver()
    cluster = cluster_dict(resolver) if resolver is not None else {}
    task_type = getattr(resolver, "task_type", None) if resolver is not None else None
    task_id = getattr(resolver, "task_id", 0) if resolver is not None else 0
    return TaskInfo(cluster, task_type or None, int(task_id or 0), cluster_token(resolver))


def _env_resolver() -> Any:
    """The TF_CONFIG resolver, or ``None`` without TF_CONFIG: of the registered environments
    (``auto_detect``) only ``TF_CONFIG`` names a parameter-server cluster's ``ps`` tasks."""
    from jaxdist._src.cluster.tf_config import TFConfigEnvironment

    return TFConfigEnvironment.resolver() if TFConfigEnvironment.is_env_present() else None


def evaluator_task(environ: Mapping[str, str] | None = None) -> str | None:
    """``"evaluator:0"`` when ``TF_CONFIG`` makes this process the evaluator, else ``None``.

    Example:
        >>> from jaxdist._src.cluster.task_info import evaluator_task
        >>> evaluator_task({"TF_CONFIG": '{"cluster": {"worker": ["a:1"]}, '
        ...                 '"task": {"type": "evaluator", "index": 0}}'})
        'evaluator:0'
    """
    from jaxdist._src.cluster.tf_config import TFConfigClusterResolver

    env = os.environ if environ is None else environ
    raw = env.get("TF_CONFIG")
    if not raw:
        return None
    resolver = TFConfigClusterResolver(tf_config=raw)
    if resolver.task_type != "evaluator":
        return None
    return f"evaluator:{resolver.task_id or 0}"


def launched_tasks(environ: Mapping[str, str] | None = None) -> tuple[int, str] | None:
    """How many processes the environment says run this program, and where it says so:
    ``TF_CONFIG``'s tasks (every job: what a launcher or Kubeflow starts), else an ``srun``
    step's tasks (``SLURM_STEP_NUM_TASKS``); ``None`` when neither names a cluster.

    Example:
        >>> from jaxdist._src.cluster.task_info import launched_tasks
        >>> launched_tasks({"TF_CONFIG": '{"cluster": {"worker": ["a:1", "b:1"]}, '
        ...                 '"task": {"type": "worker", "index": 1}}'})
        (2, 'TF_CONFIG (worker:1 of worker x2)')
        >>> launched_tasks({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3"})
        (4, 'srun (SLURM_STEP_NUM_TASKS=4, SLURM_PROCID=3)')
        >>> launched_tasks({}) is None, launched_tasks({"TF_CONFIG": "not json"}) is None
        (True, True)
    """
    env = os.environ if environ is None else environ
    raw = env.get("TF_CONFIG")
    if raw:
        from jaxdist._src.cluster.errors import TFConfigError
        from jaxdist._src.cluster.tf_config import TFConfigClusterResolver

        try:
            resolver = TFConfigClusterResolver(tf_config=raw)
            cluster = cluster_dict(resolver)
        except TFConfigError:  # a stale, unreadable TF_CONFIG names no cluster; the
            cluster = {}       # strategies that read it report it themselves
        if cluster:
            jobs = ", ".join(f"{job} x{len(tasks)}" for job, tasks in cluster.items())
            me = f"{resolver.task_type}:{resolver.task_id or 0} of " if resolver.task_type \
                else ""
            return sum(len(t) for t in cluster.values()), f"TF_CONFIG ({me}{jobs})"
    tasks = env.get("SLURM_STEP_NUM_TASKS", "")
    if tasks.isdigit() and env.get("SLURM_PROCID") is not None:
        return int(tasks), (f"srun (SLURM_STEP_NUM_TASKS={tasks}, "
                            f"SLURM_PROCID={env['SLURM_PROCID']})")
    return None


__all__ = ["TOKEN_ENV", "TaskInfo", "cluster_dict", "cluster_token", "evaluator_task",
           "launched_tasks", "task_info"]
