"""Which ps task holds which variable: ``replica_device_setter`` and its placement strategies.

TF's ``tf.compat.v1.train.replica_device_setter`` returns a device function that sends each
variable to a ps task. Here a variable is described by a ``VariableSpec`` (name, shape, dtype)
and the device function returns the TF device string ``"/job:ps/task:<i>"``. Placement depends
only on the order and sizes of the variables, so every worker computes the same assignment.

Example:
    >>> setter = replica_device_setter(ps_tasks=2)
    >>> [setter(VariableSpec(n, (4,), "float32")) for n in ("v1", "v2", "v3")]
    ['/job:ps/task:0', '/job:ps/task:1', '/job:ps/task:0']
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class VariableSpec:
    """What placement sees of a variable (TF's ``op`` argument of a device function).

    Attributes:
        name: the variable's name (e.g. ``"model/dense/kernel"``).
        shape: its shape.
        dtype: its dtype (anything ``numpy.dtype`` accepts, incl. ``ml_dtypes`` names).
    """

    name: str
    shape: tuple[int, ...]
    dtype: Any = "float32"

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape)) * _itemsize(self.dtype)


def _itemsize(dtype: Any) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        from jaxdist.ps.wire import dtype_from_name

        return dtype_from_name(str(dtype)).itemsize


def byte_size_load_fn(op: VariableSpec) -> int:
    """Load of a variable = its size in bytes (TF's ``byte_size_load_fn``).

    Example:
        >>> byte_size_load_fn(VariableSpec("w", (10, 10), "float32"))
        400
    """
    return op.nbytes


class _RoundRobinStrategy:
    """Assigns variables to ps tasks in turn: 0, 1, ..., n-1, 0, ..."""

    def __init__(self, num_tasks: int):
        self._num_tasks = num_tasks
        self._next_task = 0

    def __call__(self, op: VariableSpec) -> int:
        task = self._next_task
        self._next_task = (self._next_task + 1) % self._num_tasks
        return task


class GreedyLoadBalancingStrategy:
    """Sends each variable to the least-loaded ps task (ties: lowest index).

    ``tf.compat.v1.train.GreedyLoadBalancingStrategy``: deterministic, so every worker builds
    the same placement when it sees the variables in the same order.

    Args:
        num_tasks: number of ps tasks.
        load_fn: a variable's load (default ``byte_size_load_fn``).

    Example:
        >>> greedy = GreedyLoadBalancingStrategy(2, byte_size_load_fn)
        >>> setter = replica_device_setter(ps_tasks=2, ps_strategy=greedy)
    """

    def __init__(self, num_tasks: int, load_fn: Callable[[VariableSpec], float] | None = None):
        if num_tasks < 1:
            raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
        self._num_tasks = num_tasks
        self._load_fn = load_fn or byte_size_load_fn
        self._ps_loads = np.zeros(num_tasks)

    def __call__(self, op: VariableSpec) -> int:
        task = int(np.argmin(self._ps_loads))
        self._ps_loads[task] += self._load_fn(op)
        return task

    @property
    def loads(self) -> tuple[float, ...]:
        return tuple(float(x) for x in self._ps_loads)


class ReplicaDeviceSetter:
    """The device function ``replica_device_setter`` returns.

    Call it with a ``VariableSpec`` (or a name and shape) to get the ps device string;
    ``task_of`` gives the task index.
    """

    def __init__(self, ps_tasks: int, ps_device: str, worker_device: str,
                 ps_strategy: Callable[[VariableSpec], int]):
        self.ps_tasks = ps_tasks
        self.ps_device = ps_device
        self.worker_device = worker_device
        self.ps_strategy = ps_strategy

    def task_of(self, op: VariableSpec) -> int:
        task = int(self.ps_strategy(op))
        if not 0 <= task < self.ps_tasks:
            raise ValueError(
                f"ps_strategy returned task {task} for {op.name!r}: expected 0..{self.ps_tasks - 1}"
            )
        return task

    def __call__(self, op: VariableSpec | str, shape: Sequence[int] = (),
                 dtype: Any = "float32") -> str:
        if isinstance(op, str):
            op = VariableSpec(op, tuple(shape), dtype)
        return f"{self.ps_device}/task:{self.task_of(op)}"


def replica_device_setter(
    ps_tasks: int = 0,
    ps_device: str = "/job:ps",
    worker_device: str = "/job:worker",
    merge_devices: bool = True,
    cluster: Any = None,
    ps_ops: Sequence[str] | None = None,
    ps_strategy: Callable[[VariableSpec], int] | None = None,
) -> ReplicaDeviceSetter:
    """Places variables on ps tasks (``tf.compat.v1.train.replica_device_setter``).

    Args:
        ps_tasks: number of ps tasks (ignored when ``cluster`` is given).
        ps_device: the ps job's device prefix.
        worker_device: the worker's device (kept for TF compatibility; compute is local).
        merge_devices: accepted for TF compatibility.
        cluster: a ClusterSpec, resolver or ``{job: [addresses]}``: ``ps_tasks`` is the size
            of its ``ps`` job.
        ps_ops: accepted for TF compatibility (every variable goes to a ps).
        ps_strategy: ``f(VariableSpec) -> task``; default round-robin.

    Returns:
        A device function: ``setter(VariableSpec)`` -> ``"/job:ps/task:<i>"``.

    Raises:
        ValueError: no ps task to place on.

    Example:
        >>> setter = replica_device_setter(cluster={"ps": ["h0:2222", "h1:2222"],
        ...                                         "worker": ["h2:2222"]})
        >>> setter("v1"), setter("v2"), setter("v3")
        ('/job:ps/task:0', '/job:ps/task:1', '/job:ps/task:0')
    """
    del merge_devices, ps_ops
    if cluster is not None:
        from jaxdist.ps.cluster import cluster_dict

        ps_tasks = len(cluster_dict(cluster).get("ps", []))
    if ps_tasks < 1:
        raise ValueError(
            f"replica_device_setter needs ps_tasks >= 1 (or a cluster with a 'ps' job), got "
            f"ps_tasks={ps_tasks}"
        )
    if ps_strategy is None:
        ps_strategy = _RoundRobinStrategy(ps_tasks)
    elif not callable(ps_strategy):
        raise TypeError(f"ps_strategy must be callable (VariableSpec -> task), got {ps_strategy!r}")
    return ReplicaDeviceSetter(ps_tasks, ps_device, worker_device, ps_strategy)


_TASK_RE = re.compile(r"/job:(?P<job>[^/]+)/(?:replica:\d+/)?task:(?P<task>\d+)")


def parse_task(device: str) -> int:
    """``"/job:ps/task:3"`` -> 3.

    Raises:
        ValueError: not a ps device string.
    """
    m = _TASK_RE.search(device)
    if not m:
        raise ValueError(f"device {device!r} names no task: expected '/job:ps/task:<i>'")
    return int(m.group("task"))


__all__ = [
    "GreedyLoadBalancingStrategy",
    "ReplicaDeviceSetter",
    "VariableSpec",
    "byte_size_load_fn",
    "parse_task",
    "replica_device_setter",
]
