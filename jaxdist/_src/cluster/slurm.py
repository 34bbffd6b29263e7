"""``SlurmClusterResolver``: the cluster of a Slurm job step from its ``SLURM_*`` variables."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from typing import Any

from jaxdist._src.cluster.cluster_env import ClusterEnvironment
from jaxdist._src.cluster.cluster_spec import ClusterSpec
from jaxdist._src.cluster.errors import ClusterConfigError
from jaxdist._src.cluster.resolver import ClusterResolver, format_master_url
from jaxdist._src.cluster.validation import quote


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


def _int_env(name: str, *fallbacks: str) -> int:
    value = _env(name, *fallbacks)
    if not value.strip().isdigit():
        raise ClusterConfigError(f"${name} is {quote(value)}: expected a non-negative integer")
    return int(value)


def _env(name: str, *fallbacks: str) -> str:
    for n in (name, *fallbacks):
        if n in os.environ:
            return os.environ[n]
    raise ClusterConfigError(
        f"SlurmClusterResolver: ${name} is not set; run inside a Slurm job step (srun)"
    )


def get_num_gpus() -> int:
    """GPUs visible on this node, counted as TF counts them.

    The entries of ``CUDA_VISIBLE_DEVICES`` when it is set (an empty value counts 0, where
    TF counts 1), else the ``GPU`` lines of ``nvidia-smi --list-gpus``, else 0.

    Example:
        >>> import os
        >>> from jaxdist._src.cluster.slurm import get_num_gpus
        >>> os.environ["CUDA_VISIBLE_DEVICES"] = "0,1,2,3"
        >>> get_num_gpus()
        4
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.strip().splitlines())


class SlurmClusterResolver(ClusterResolver):
    """The cluster of a Slurm job step (``tf.distribute.cluster_resolver.SlurmClusterResolver``).

    As in TF: the step's nodes (sorted by name) each run ``tasks_per_node`` tasks, task ``k``
    of a node listening on ``port_base + k``; tasks are numbered in that order and given to
    the jobs sorted by name (``{"ps": 1, "worker": 2}``: task 0 is ``ps:0``). This process is
    the task numbered ``SLURM_PROCID``. GPUs: ``gpus_per_node`` (default: counted from
    ``CUDA_VISIBLE_DEVICES``), ``gpus_per_task`` (default: ``gpus_per_node`` divided by the
    most tasks on one node); task ``k`` of a node gets GPUs ``k*gpus_per_task`` onwards, and
    ``auto_set_gpu`` sets ``CUDA_VISIBLE_DEVICES`` to them (before JAX starts). When Slurm gives
    each task its GPUs itself (``srun --gpus-per-task=G``: ``SLURM_GPUS_PER_TASK``) and neither
    GPU argument is given, ``gpus_per_task`` is ``G`` and ``CUDA_VISIBLE_DEVICES`` stays as
    Slurm set it.

    Args:
        jobs: job name -> number of tasks (default: every task is a ``worker``). Any job name
            is accepted; the strategies check TF's multi-worker rules.
        port_base: first port on each node.
        gpus_per_node: GPUs on each node.
        gpus_per_task: GPUs each task uses.
        tasks_per_node: an int, a dict host -> tasks, or ``None``
            (``SLURM_STEP_TASKS_PER_NODE``).
        auto_set_gpu: set ``CUDA_VISIBLE_DEVICES`` for this task (as TF does).
        rpc_layer: the RPC layer (``"grpc"``).

    Raises:
        ClusterConfigError: a Slurm variable is missing or malformed, the jobs ask for another
            number of tasks than the step has, or more GPUs than a node has.

    Example:
        >>> # srun -N 2 --ntasks-per-node 2 python train.py
        >>> resolver = SlurmClusterResolver(jobs={"worker": 4})        # doctest: +SKIP
        >>> strategy = jaxdist.MultiWorkerMirroredStrategy(resolver)   # doctest: +SKIP
    """

    def __init__(self, jobs: dict[str, int] | None = None, port_base: int = 8888,
                 gpus_per_node: int | None = None, gpus_per_task: int | None = None,
                 tasks_per_node: dict[str, int] | int | None = None, auto_set_gpu: bool = True,
                 rpc_layer: str = "grpc"):
        self.rpc_layer = rpc_layer
        self.environment = ""
        self._port_base = port_base
        self._rank = _int_env("SLURM_PROCID")
        if jobs is None:
            jobs = {"worker": _int_env("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")}
        self._jobs = dict(jobs)
        if isinstance(tasks_per_node, dict):
            config = {str(h): int(n) for h, n in tasks_per_node.items()}
        else:
            hosts = expand_hostlist(_env("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"))
            if tasks_per_node is not None:
                per_node = [int(tasks_per_node)] * len(hosts)
            else:
                per_node = expand_tasks_per_node(
                    _env("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
                if len(per_node) != len(hosts):
                    raise ClusterConfigError(
                        f"SLURM tasks per node {per_node} does not match the {len(hosts)} "
                        f"nodes {hosts}"
                    )
            config = dict(zip(hosts, per_node))
        if not config:
            raise ClusterConfigError("SlurmClusterResolver: the Slurm step has no nodes")
        self._task_configuration = config
        max_per_node = max(config.values())
        num_tasks = sum(config.values())
        # srun --gpus-per-task=G: Slurm gives each task G GPUs itself (its own
        # CUDA_VISIBLE_DEVICES), so they are not split again here.
        slurm_gpus = os.environ.get("SLURM_GPUS_PER_TASK", "").strip()
        self._slurm_bound_gpus = (gpus_per_node is None and gpus_per_task is None
                                  and slurm_gpus.isdigit())
        if self._slurm_bound_gpus:
            gpus_per_task = int(slurm_gpus)
            gpus_per_node = gpus_per_task * max_per_node
        if gpus_per_node is None:
            gpus_per_node = get_num_gpus()
        if gpus_per_task is None:
            gpus_per_task = gpus_per_node // max_per_node if max_per_node else 0
        self._gpus_per_node, self._gpus_per_task = int(gpus_per_node), int(gpus_per_task)
        if max_per_node * self._gpus_per_task > self._gpus_per_node:
            raise ClusterConfigError(
                f"SlurmClusterResolver: {max_per_node} tasks per node x gpus_per_task="
                f"{self._gpus_per_task} need more than the gpus_per_node={self._gpus_per_node} "
                f"GPUs of a node"
            )
        if sum(self._jobs.values()) != num_tasks:
            raise ClusterConfigError(
                f"SlurmClusterResolver jobs={quote(self._jobs)} ask for "
                f"{sum(self._jobs.values())} tasks, but the Slurm step has {num_tasks} "
                f"(tasks per node {quote(config)})"
            )
        if not 0 <= self._rank < num_tasks:
            raise ClusterConfigError(
                f"SLURM_PROCID={self._rank} is not one of the step's {num_tasks} tasks"
            )
        self._spec, self._gpu_allocation = self._allocate()
        if auto_set_gpu and self._gpus_per_task and not self._slurm_bound_gpus:
            os.environ["CUDA_VISIBLE_DEVICES"] = self._gpu_allocation[self._rank]

    def _allocate(self) -> tuple[ClusterSpec, list[str]]:
        addresses: list[str] = []
        gpus: list[str] = []
        step = self._gpus_per_task
        for host, n in sorted(self._task_configuration.items()):  # TF sorts the hosts
            for k in range(n):
                addresses.append(f"{host}:{self._port_base + k}")
                gpus.append(",".join(str(k * step + g) for g in range(step)))
        cluster: dict[str, list[str]] = {}
        start = 0
        self.task_type, self.task_id = None, None
        for job, n in sorted(self._jobs.items()):  # TF sorts the jobs
            cluster[job] = addresses[start:start + n]
            if start <= self._rank < start + n:
                self.task_type, self.task_id = job, self._rank - start
            start += n
        return ClusterSpec(cluster), gpus

    def cluster_spec(self) -> ClusterSpec:
        return self._spec

    def get_task_info(self) -> tuple[str | None, int | None]:
        """``(task_type, task_id)`` of this process."""
        return self.task_type, self.task_id

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """The address of a task (default: this one) as ``rpc_layer://host:port``."""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        if task_type is None or task_id is None:
            return ""
        return format_master_url(self._spec.task_address(task_type, task_id),
                                 rpc_layer or self.rpc_layer)

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: Any = None) -> dict[str, int]:
        """``{"GPU": gpus_per_task}`` (``{}`` on nodes without GPUs), as TF reports it."""
        del task_type, task_id, config_proto
        return {"GPU": self._gpus_per_task} if self._gpus_per_task else {}


class SlurmEnvironment(ClusterEnvironment):
    """A Slurm job step started by ``srun``: ``SLURM_PROCID`` and ``SLURM_STEP_NODELIST`` are
    both set (a batch script's own shell, which has no step node list, is not a cluster of its
    own); every task is a ``worker`` (``SlurmClusterResolver()``'s defaults)."""

    name = "slurm"
    priority = 20
    variables = ("SLURM_PROCID", "SLURM_STEP_NODELIST")

    @classmethod
    def is_env_present(cls, environ: Mapping[str, str] | None = None) -> bool:
        env = os.environ if environ is None else environ
        return all(env.get(v) for v in cls.variables)

    @classmethod
    def resolver(cls) -> SlurmClusterResolver:
        return SlurmClusterResolver()


__all__ = ["SlurmClusterResolver", "SlurmEnvironment", "expand_hostlist",
           "expand_tasks_per_node", "get_num_gpus"]
