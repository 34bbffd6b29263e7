"""``SlurmClusterResolver``: the cluster of a Slurm job step from its ``SLURM_*`` variables."""

from __future__ import annotations

import os
import re
from typing import Any

from jaxdist.cluster.cluster_spec import ClusterSpec
from jaxdist.cluster.errors import ClusterConfigError
from jaxdist.cluster.resolver import ClusterResolver
from jaxdist.cluster.validation import quote, validate_cluster_spec


def expand_hostlist(hostlist: str) -> list[str]:
    """Expands Slurm's compressed host list: ``"n[01-03,07],gpu1"`` -> n01, n02, n03, n07, gpu1.

    Raises:
        ClusterConfigError: the list is malformed.
    """
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(\[([^\]]*)\])?([^,]*)", hostlist):
        prefix, ranges, suffix = m.group(1), m.group(3), m.group(4)
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ClusterConfigError(
                    f"SLURM node list {hostlist!r} has range {part!r}: expected N or N-M"
                )
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{width}d}{suffix}")
    if not hosts:
        raise ClusterConfigError(f"SLURM node list {hostlist!r} names no hosts")
    return hosts


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expands ``SLURM_STEP_TASKS_PER_NODE``: ``"2(x3),1"`` -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(\(x(\d+)\))?", part.strip())
        if not m:
            raise ClusterConfigError(
                f"SLURM tasks per node {spec!r} has {part!r}: expected N or N(xM)"
            )
        out.extend([int(m.group(1))] * int(m.group(3) or 1))
    return out


def _env(name: str, *fallbacks: str) -> str:
    for n in (name, *fallbacks):
        if n in os.environ:
            return os.environ[n]
    raise ClusterConfigError(
        f"SlurmClusterResolver: ${name} is not set; run inside a Slurm job step (srun)"
    )


class SlurmClusterResolver(ClusterResolver):
    """The cluster of a Slurm job step (``tf.distribute.cluster_resolver.SlurmClusterResolver``).

    Tasks are numbered by ``SLURM_PROCID``; the first ``jobs[j0]`` tasks form job ``j0``, the
    next ``jobs[j1]`` job ``j1`` and so on. Task ``k`` on a node listens on
    ``port_base + k``.

    Args:
        jobs: job name -> number of tasks (default: every task is a ``worker``).
        port_base: first port on each node.
        gpus_per_node: GPUs on each node (recorded; JAX sees the GPUs Slurm exposes).
        gpus_per_task: GPUs each task uses (default: ``gpus_per_node // tasks_per_node``).
        tasks_per_node: override ``SLURM_STEP_TASKS_PER_NODE``.
        auto_set_gpu: set ``CUDA_VISIBLE_DEVICES`` for this task (as TF does).
        rpc_layer: the RPC layer (``"grpc"``).

    Example:
        >>> # srun -N 2 --ntasks-per-node 2 python train.py
        >>> resolver = SlurmClusterResolver(jobs={"worker": 4})
        >>> strategy = jaxdist.MultiWorkerMirroredStrategy(resolver)
    """

    def __init__(self, jobs: dict[str, int] | None = None, port_base: int = 8888,
                 gpus_per_node: int | None = None, gpus_per_task: int | None = None,
                 tasks_per_node: dict[str, int] | int | None = None, auto_set_gpu: bool = True,
                 rpc_layer: str = "grpc"):
        self.rpc_layer = rpc_layer
        self.environment = ""
        self._port_base = port_base
        num_tasks = int(_env("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"))
        self._rank = int(_env("SLURM_PROCID"))
        hosts = expand_hostlist(_env("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"))
        if isinstance(tasks_per_node, int):
            per_node = [tasks_per_node] * len(hosts)
        elif isinstance(tasks_per_node, dict):
            per_node = [int(tasks_per_node[h]) for h in hosts]
        else:
            per_node = expand_tasks_per_node(
                _env("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
            )
        if len(per_node) != len(hosts):
            raise ClusterConfigError(
                f"SLURM tasks per node {per_node} does not match the {len(hosts)} nodes {hosts}"
            )
        jobs = dict(jobs) if jobs else {"worker": num_tasks}
        if sum(jobs.values()) != num_tasks:
            raise ClusterConfigError(
                f"SlurmClusterResolver jobs={quote(jobs)} ask for {sum(jobs.values())} tasks, "
                f"but the Slurm step has SLURM_NTASKS={num_tasks}"
            )
        addresses = [f"{h}:{port_base + k}" for h, n in zip(hosts, per_node) for k in range(n)]
        if len(addresses) < num_tasks:
            raise ClusterConfigError(
                f"SLURM nodes {hosts} with tasks per node {per_node} hold {len(addresses)} "
                f"tasks, fewer than SLURM_NTASKS={num_tasks}"
            )
        cluster: dict[str, list[str]] = {}
        start = 0
        for job, n in jobs.items():
            cluster[job] = addresses[start:start + n]
            if start <= self._rank < start + n:
                self.task_type, self.task_id = job, self._rank - start
            start += n
        self._spec = ClusterSpec(cluster)
        validate_cluster_spec(self._spec, self.task_type, self.task_id, source="Slurm jobs")
        self._gpus_per_node = gpus_per_node
        local_tasks = per_node[hosts.index(addresses[self._rank].rsplit(":", 1)[0])]
        self._gpus_per_task = gpus_per_task or (
            gpus_per_node // local_tasks if gpus_per_node else None
        )
        if auto_set_gpu and self._gpus_per_task:
            local_id = int(os.environ.get("SLURM_LOCALID", "0"))
            first = local_id * self._gpus_per_task
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(
                str(first + i) for i in range(self._gpus_per_task)
            )

    def cluster_spec(self) -> ClusterSpec:
        return self._spec

    def get_task_info(self) -> tuple[str | None, int | None]:
        """``(task_type, task_id)`` of this process."""
        return self.task_type, self.task_id

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: Any = None) -> dict[str, int]:
        if self._gpus_per_task:
            return {"GPU": self._gpus_per_task}
        return super().num_accelerators(task_type, task_id, config_proto)


__all__ = ["SlurmClusterResolver", "expand_hostlist", "expand_tasks_per_node"]
