"""Which ps task holds which variable: ``replica_device_setter`` and its placement strategies.

TF's ``tf.compat.v1.train.replica_device_setter`` returns a device function that sends each
variable to a ps task. Here an op is described by a ``VariableSpec`` (name, shape, dtype, the
device it already has from enclosing ``tf.device`` scopes, its TF op type) and the device
function returns exactly TF's device string (``DeviceSpec.to_string()`` form, e.g.
``"/job:ps/task:0/device:CPU:0"``). Placement depends only on the order and sizes of the
variables, so every worker computes the same assignment.

Example:
    >>> from jaxdist import replica_device_setter
    >>> from jaxdist.ps import VariableSpec
    >>> setter = replica_device_setter(ps_tasks=2)
    >>> [setter(VariableSpec(n, (4,), "float32")) for n in ("v1", "v2", "v3")]
    ['/job:ps/task:0', '/job:ps/task:1', '/job:ps/task:0']
"""

from __future__ import annotations

import math
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
        device: the device the op already has (TF: from the enclosing ``tf.device`` scopes,
            innermost fields winning), e.g. ``"/cpu:0"`` or ``"/job:moon"``; ``""`` for none.
        op_type: TF's op type: ops whose type is in ``ps_ops`` (default: variables,
            ``STANDARD_PS_OPS``) go to a ps; any other (e.g. ``"AddV2"``) to ``worker_device``.

    Example:
        >>> from jaxdist.ps import VariableSpec
        >>> VariableSpec("w", (10, 10), "float32", device="/cpu:0").nbytes
        400
    """

    name: str
    shape: tuple[int, ...] = ()
    dtype: Any = "float32"
    device: str = ""
    op_type: str = "VarHandleOp"

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape)) * _itemsize(self.dtype)


def _itemsize(dtype: Any) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        from jaxdist._src.transport.wire import dtype_from_name

        return dtype_from_name(str(dtype)).itemsize


def byte_size_load_fn(op: VariableSpec) -> int:
    """Load of a variable = its size in bytes (TF's ``byte_size_load_fn``).

    Example:
        >>> from jaxdist import byte_size_load_fn
        >>> from jaxdist.ps import VariableSpec
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
        >>> from jaxdist import (
        ...     GreedyLoadBalancingStrategy, byte_size_load_fn, replica_device_setter)
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


# TF's STANDARD_PS_OPS (tensorflow/python/training/device_setter.py): the op types placed on ps.
STANDARD_PS_OPS = (
    "Variable", "VariableV2", "AutoReloadVariable", "MutableHashTable",
    "MutableHashTableV2", "MutableHashTableOfTensors", "MutableHashTableOfTensorsV2",
    "MutableDenseHashTable", "MutableDenseHashTableV2", "VarHandleOp",
)

@dataclass
class _DeviceSpec:
    """TF's ``DeviceSpec`` fields, parsing, ``merge_from`` and ``to_string``."""

    job: str | None = None
    replica: int | None = None
    task: int | None = None
    device_type: str | None = None
    device_index: int | None = None

    @classmethod
    def from_string(cls, spec: str) -> _DeviceSpec:
        out = cls()
        for part in (spec or "").split("/"):
            if not part:
                continue
            fields = part.split(":")
            key = fields[0].lower()
            if len(fields) == 2 and key in ("job", "replica", "task"):
                if key == "job":
                    out.job = fields[1]
                else:
                    setattr(out, key, _int_field(spec, fields[1]))
            elif len(fields) == 2 and key in ("cpu", "gpu", "tpu"):
                out.device_type = key.upper()
                out.device_index = None if fields[1] == "*" else _int_field(spec, fields[1])
            elif len(fields) == 3 and key == "device":
                out.device_type = fields[1].upper() if fields[1].lower() in (
                    "cpu", "gpu", "tpu") else fields[1]
                out.device_index = None if fields[2] == "*" else _int_field(spec, fields[2])
            elif len(fields) == 2 and fields[0] and fields[1].isdigit():
                out.device_type, out.device_index = fields[0], int(fields[1])
            else:
                raise ValueError(
                    f"cannot parse device {spec!r} at {part!r}: expected TF device fields "
                    f"like '/job:ps/replica:0/task:1/device:CPU:0' or '/cpu:0'")
        return out

    def merge_from(self, other: _DeviceSpec) -> None:
        """Fields set in ``other`` win (TF's ``DeviceSpec.merge_from``)."""
        for f in ("job", "replica", "task", "device_type", "device_index"):
            value = getattr(other, f)
            if value is not None:
                setattr(self, f, value)

    def to_string(self) -> str:
        dev = ""
        if self.job is not None:
            dev += "/job:" + self.job
        if self.replica is not None:
            dev += f"/replica:{self.replica}"
        if self.task is not None:
            dev += f"/task:{self.task}"
        if self.device_type is not None:
            index = "*" if self.device_index is None else str(self.device_index)
            dev += f"/device:{self.device_type}:{index}"
        return dev


def _int_field(spec: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"cannot parse device {spec!r}: {value!r} is not an integer") from None


def canonical_device(device: str) -> str:
    """TF's canonical form of a device string (``DeviceSpec.from_string(d).to_string()``).

    Example:
        >>> from jaxdist._src.ps.placement import canonical_device
        >>> canonical_device("/job:ps/task:0/cpu:0")
        '/job:ps/task:0/device:CPU:0'
    """
    return _DeviceSpec.from_string(device).to_string()


class ReplicaDeviceSetter:
    """The device function ``replica_device_setter`` returns (TF's ``_ReplicaDeviceChooser``).

    Call it with a ``VariableSpec`` (or a name and shape) to get the device string TF's device
    function gives; ``task_of`` gives the ps task index of a variable placed without any
    device constraint (what ``ParameterServerStrategy`` uses).

    Example:
        >>> from jaxdist import replica_device_setter
        >>> from jaxdist.ps import VariableSpec
        >>> setter = replica_device_setter(ps_tasks=2)
        >>> setter(VariableSpec("v", (2,), device="/cpu:0"))
        '/job:ps/task:0/device:CPU:0'
    """

    def __init__(self, ps_tasks: int, ps_device: str, worker_device: str,
                 ps_strategy: Callable[[VariableSpec], int], merge_devices: bool = True,
                 ps_ops: Sequence[str] = STANDARD_PS_OPS):
        self.ps_tasks = ps_tasks
        self.ps_device = ps_device
        self.worker_device = worker_device
        self.ps_strategy = ps_strategy
        self.merge_devices = merge_devices
        self.ps_ops = tuple(ps_ops)
        # Parse once: a malformed ps_device/worker_device fails here, not at the first op.
        _DeviceSpec.from_string(ps_device or "")
        _DeviceSpec.from_string(worker_device or "")

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
        if not self.merge_devices and op.device:
            return op.device
        current = _DeviceSpec.from_string(op.device)
        if self.ps_tasks and self.ps_device and op.op_type in self.ps_ops:
            ps = _DeviceSpec.from_string(self.ps_device)
            # TF: the task is set only when ps_device names a job that the op's own device
            # does not change.
            if ps.job and (not current.job or current.job == ps.job):
                ps.task = self.task_of(op)
            ps.merge_from(current)
            return ps.to_string()
        worker = _DeviceSpec.from_string(self.worker_device or "")
        worker.merge_from(current)
        return worker.to_string()


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

    Device strings are TF's: a variable gets ``ps_device`` plus ``/task:<i>`` when
    ``ps_device`` names a job (``"/job:moon"`` -> ``"/job:moon/task:0"``; ``"/cpu:0"`` -> no
    task), merged with the op's own ``device``; other ops get ``worker_device`` merged with
    theirs.

    Args:
        ps_tasks: number of ps tasks (ignored when ``cluster`` is given).
        ps_device: the ps job's device, e.g. ``"/job:ps"``, ``"/job:moon/cpu:0"``.
        worker_device: the device of non-variable ops (e.g. ``"/job:worker"``).
        merge_devices: ``False``: an op that already has a device keeps it unchanged.
        cluster: a ClusterSpec, its ``as_cluster_def()``, a resolver or ``{job: [addresses]}``:
            ``ps_tasks`` is the size of the job named in ``ps_device``.
        ps_ops: op types placed on ps (default: TF's ``STANDARD_PS_OPS``).
        ps_strategy: ``f(VariableSpec) -> task``; default round-robin.

    Returns:
        A device function: ``setter(VariableSpec)`` -> a TF device string.

    Raises:
        ValueError: no ps task to place on (TF returns ``None``, a no-op device function;
            jaxdist has no op that could run without a ps, so it says so instead), or a
            malformed device string.
        TypeError: ``ps_strategy`` is not callable.

    Example:
        >>> from jaxdist import replica_device_setter
        >>> setter = replica_device_setter(cluster={"ps": ["h0:2222", "h1:2222"],
        ...                                         "worker": ["h2:2222"]})
        >>> setter("v1"), setter("v2"), setter("v3")
        ('/job:ps/task:0', '/job:ps/task:1', '/job:ps/task:0')
    """
    if cluster is not None:
        from jaxdist._src.cluster.task_info import cluster_dict

        jobs = cluster_dict(cluster)
        ps_job = _DeviceSpec.from_string(ps_device or "").job
        if ps_job not in jobs or not jobs[ps_job]:
            raise ValueError(
                f"replica_device_setter: ps_device {ps_device!r} names job {ps_job!r}, which "
                f"the cluster does not have (jobs: {sorted(jobs)}); pass ps_device='/job:<the "
                f"ps job>'")
        ps_tasks = len(jobs[ps_job])
    if ps_tasks < 1:
        raise ValueError(
            f"replica_device_setter needs ps_tasks >= 1 (or a cluster with a 'ps' job), got "
            f"ps_tasks={ps_tasks}"
        )
    if ps_ops is None:
        ps_ops = STANDARD_PS_OPS
    if ps_strategy is None:
        ps_strategy = _RoundRobinStrategy(ps_tasks)
    elif not callable(ps_strategy):
        raise TypeError(f"ps_strategy must be callable (VariableSpec -> task), got {ps_strategy!r}")
    return ReplicaDeviceSetter(ps_tasks, ps_device, worker_device, ps_strategy,
                               merge_devices=merge_devices, ps_ops=ps_ops)


__all__ = [
    "STANDARD_PS_OPS",
    "GreedyLoadBalancingStrategy",
    "ReplicaDeviceSetter",
    "VariableSpec",
    "byte_size_load_fn",
    "canonical_device",
    "replica_device_setter",
]
