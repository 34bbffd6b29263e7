"""The synchronous process group a resolver describes: who is process 0, 1, ..., where to meet.

Process order is the chief first, then the workers by index; ``ps`` and ``evaluator`` tasks are
not members. The coordinator (JAX's coordination service) runs in process 0 and listens on the
port that the cluster spec gives that task, on the spec's host only (loopback names bind
loopback only).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxdist._src.cluster.cluster_spec import as_cluster_spec
from jaxdist._src.cluster.errors import ClusterConfigError
from jaxdist._src.cluster.validation import (
    LOOPBACK_HOSTS,
    TRAINING_TASK_TYPES,
    is_chief,
    quote,
    split_address,
    task_name,
    training_tasks,
    validate_cluster_spec,
)


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """The members of a synchronous (``jax.distributed``) training group.

    Attributes:
        tasks: ``(task_type, task_id)`` of every member, in process order (chief first).
        task_type: this process's task type.
        task_id: this process's task index.
        process_id: this process's index in ``tasks`` (``None`` for ps / evaluator tasks).
        coordination_address: ``host:port`` of process 0's coordination service (``None`` when
            the group has a single process).
        coordination_bind_address: where process 0's coordination service listens.
        is_chief: this task is the chief (TF's rule: chief, or worker 0 without a chief).

    Example:
        >>> from jaxdist._src.distributed.process_group import process_group
        >>> from jaxdist.cluster_resolver import SimpleClusterResolver
        >>> resolver = SimpleClusterResolver(
        ...     {"chief": ["c:1"], "worker": ["w:1", "w:2"]}, task_type="worker", task_id=1)
        >>> g = process_group(resolver)        # chief + 2 workers, this = worker 1
        >>> g.process_id, g.num_processes, g.task_name(0)
        (2, 3, 'chief:0')
    """

    tasks: tuple[tuple[str, int], ...]
    task_type: str | None
    task_id: int | None
    process_id: int | None
    coordination_address: str | None
    coordination_bind_address: str | None
    is_chief: bool

    @property
    def coordinator_address(self) -> str | None:
        """The earlier name of ``coordination_address`` (kept working)."""
        return self.coordination_address

    @property
    def coordinator_bind_address(self) -> str | None:
        """The earlier name of ``coordination_bind_address`` (kept working)."""
        return self.coordination_bind_address

    @property
    def num_processes(self) -> int:
        return max(1, len(self.tasks))

    @property
    def in_training_group(self) -> bool:
        """This task runs training steps (it is not a ps or evaluator task)."""
        return self.process_id is not None

    @property
    def multi_process(self) -> bool:
        return self.in_training_group and self.num_processes > 1

    def task_name(self, process_id: int) -> str:
        """``"worker:1"`` for a process id."""
        if 0 <= process_id < len(self.tasks):
            return task_name(*self.tasks[process_id])
        return f"process:{process_id}"

    @property
    def name(self) -> str:
        return task_name(self.task_type, self.task_id)


def bind_address_for(address: str) -> str:
    """Where a service announced at ``address`` listens: loopback names stay on loopback."""
    host, port = split_address(address)
    if host in LOOPBACK_HOSTS:
        return f"{'[::1]' if host in ('::1', '[::1]') else '127.0.0.1'}:{port}"
    return f"{host}:{port}"  # only the interface the spec names, never every interface


def process_group(resolver: Any) -> ProcessGroup:
    """Derives the ``jax.distributed`` group from a cluster resolver.

    Args:
        resolver: any ``ClusterResolver`` (``cluster_spec()``, ``task_type``, ``task_id``).

    Raises:
        ClusterConfigError: the cluster breaks TF's rules, or names no chief/worker task.
    """
    spec = as_cluster_spec(resolver.cluster_spec())
    task_type, task_id = resolver.task_type, resolver.task_id
    if not spec:
        return ProcessGroup((), task_type, task_id, 0, None, None, True)
    source = getattr(resolver, "config_source", None) or type(resolver).__name__
    validate_cluster_spec(spec, task_type, task_id, source=source)
    for job in spec.jobs:
        for idx in spec.task_indices(job):
            where = f"{source} \"cluster\" {quote(job)}[{idx}]"
            split_address(spec.task_address(job, idx), where)
    tasks = tuple(training_tasks(spec))
    if not tasks:
        raise ClusterConfigError(
            f"the cluster {quote(spec.as_dict())} has no {' or '.join(TRAINING_TASK_TYPES)} "
            f"task to train on"
        )
    if task_type is None:
        if len(tasks) > 1:
            raise ClusterConfigError(
                f"the cluster {quote(spec.as_dict())} has {len(tasks)} training tasks but no "
                f"\"task\" says which one this process is; set TF_CONFIG's "
                f"\"task\": {{\"type\": ..., \"index\": ...}}"
            )
        task_type, task_id = tasks[0]
    pid = tasks.index((task_type, task_id)) if (task_type, task_id) in tasks else None
    coord = spec.task_address(*tasks[0])
    custom = getattr(resolver, "coordinator_address", None)
    if callable(custom):  # e.g. TPU pod slices: the coordinator has its own port
        coord = custom()
    host, port = split_address(coord, "coordinator address")
    if host == "localhost":  # one address family for client and service
        coord = f"127.0.0.1:{port}"
    multi = len(tasks) > 1
    return ProcessGroup(
        tasks=tasks,
        task_type=task_type,
        task_id=task_id,
        process_id=pid,
        coordination_address=coord if multi else None,
        coordination_bind_address=bind_address_for(coord) if multi else None,
        # TF's is_chief counts the evaluator as its own chief; here it never checkpoints the
        # training state, so it is not the chief of the group (a deliberate difference).
        is_chief=task_type != "evaluator" and is_chief(spec, task_type, task_id),
    )


__all__ = ["ProcessGroup", "bind_address_for", "process_group"]
