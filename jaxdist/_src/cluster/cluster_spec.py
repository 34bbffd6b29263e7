"""``ClusterSpec``: the jobs of a cluster and the addresses of their tasks (TF's class)."""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from typing import Any

from jaxdist._src.cluster.errors import ClusterConfigError

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 80, 80, 40


def _show(value: Any) -> str:
    """A bounded repr for messages (safe on deep or huge values)."""
    try:
        return _REPR.repr(value)
    except Exception:  # noqa: BLE001 - a message must not fail
        return f"<{type(value).__name__}>"


def _parse_index(job: str, key: Any) -> int:
    try:
        idx = int(key)
    except (TypeError, ValueError):
        raise ClusterConfigError(
            f"cluster job {_show(job)} has task index {_show(key)}: expected a non-negative "
            f"integer (the sparse form is {{{_show(job)}: {{\"1\": \"host:port\"}}}})"
        ) from None
    if idx < 0 or (isinstance(key, float) and key != idx):
        raise ClusterConfigError(
            f"cluster job {_show(job)} has task index {_show(key)}: expected a non-negative "
            f"integer"
        )
    return idx


def _parse_job(job: Any, tasks: Any) -> dict[int, str]:
    if not isinstance(job, str) or not job:
        raise ClusterConfigError(f"cluster job name {_show(job)}: expected a non-empty string")
    if isinstance(tasks, str):
        raise ClusterConfigError(
            f"cluster job {_show(job)} is {_show(tasks)}: expected a list of \"host:port\" "
            f"addresses (e.g. [{_show(tasks)}]) or a dict of task index -> address"
        )
    if isinstance(tasks, Mapping):
        items = [(_parse_index(job, k), v) for k, v in tasks.items()]
    elif isinstance(tasks, (list, tuple)):
        items = list(enumerate(tasks))
    else:
        raise ClusterConfigError(
            f"cluster job {_show(job)} is {_show(tasks)}: expected a list of \"host:port\" "
            f"addresses or a "
            f"dict of task index -> address"
        )
    out: dict[int, str] = {}
    for idx, addr in items:
        if not isinstance(addr, str):
            raise ClusterConfigError(
                f"cluster job {_show(job)} task {idx} has address {_show(addr)}: expected a "
                f"\"host:port\" "
                f"string"
            )
        if idx in out:
            raise ClusterConfigError(f"cluster job {_show(job)} lists task {idx} twice")
        out[idx] = addr
    return dict(sorted(out.items()))


class ClusterSpec:
    """The jobs of a cluster and their tasks' addresses (``tf.train.ClusterSpec``).

    Args:
        cluster: a dict of job name -> list of ``"host:port"`` addresses (dense: task ``i`` is
            entry ``i``) or job name -> dict of task index -> address (sparse), or another
            ``ClusterSpec``.

    Raises:
        ClusterConfigError: the description is malformed; the message quotes the bad part.

    Example:
        >>> from jaxdist.cluster_resolver import ClusterSpec
        >>> spec = ClusterSpec({"chief": ["h0:2222"], "worker": {1: "h1:2222"}})
        >>> spec.jobs
        ['chief', 'worker']
        >>> spec.task_address("worker", 1)
        'h1:2222'
        >>> spec.as_dict()
        {'chief': ['h0:2222'], 'worker': {1: 'h1:2222'}}
    """

    def __init__(self, cluster: Any = None):
        if cluster is None:
            cluster = {}
        if isinstance(cluster, ClusterSpec):
            self._jobs: dict[str, dict[int, str]] = {
                j: dict(t) for j, t in cluster._jobs.items()
            }
            return
        if not isinstance(cluster, Mapping):
            raise ClusterConfigError(
                f"cluster {_show(cluster)}: expected a dict of job name -> addresses or a "
                f"ClusterSpec"
            )
        self._jobs = {job: _parse_job(job, tasks) for job, tasks in cluster.items()}

    # ------------------------------------------------------------------ TF's methods
    @property
    def jobs(self) -> list[str]:
        """The job names, in the order they were given."""
        return list(self._jobs)

    def _job(self, job_name: str) -> dict[int, str]:
        try:
            return self._jobs[job_name]
        except KeyError:
            raise ValueError(
                f"No such job in cluster: {job_name!r} (jobs: {self.jobs})"
            ) from None

    def num_tasks(self, job_name: str) -> int:
        """How many tasks the job has (sparse jobs count only the tasks they list)."""
        return len(self._job(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        """The sorted task indices of the job."""
        return list(self._job(job_name))

    def task_address(self, job_name: str, task_index: int) -> str:
        """The ``"host:port"`` address of one task."""
        job = self._job(job_name)
        try:
            return job[int(task_index)]
        except KeyError:
            raise ValueError(
                f"No task with index {task_index} in job {job_name!r} (indices: {list(job)})"
            ) from None

    def job_tasks(self, job_name: str) -> list[str | None]:
        """The job's addresses as a dense list (``None`` where a sparse job has a gap)."""
        job = self._job(job_name)
        if not job:
            return []
        return [job.get(i) for i in range(max(job) + 1)]

    def is_dense(self, job_name: str) -> bool:
        job = self._job(job_name)
        return list(job) == list(range(len(job)))

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """Jobs as lists of addresses when dense, dicts of index -> address when sparse."""
        return {
            j: (list(t.values()) if self.is_dense(j) else dict(t)) for j, t in self._jobs.items()
        }

    def as_cluster_def(self) -> dict[str, dict[int, str]]:
        """A plain-dict stand-in for TF's ``ClusterDef`` proto: job -> {index: address}.

        Jobs are sorted by name and tasks by index, as in TF's proto.
        """
        return {j: dict(self._jobs[j]) for j in sorted(self._jobs)}

    def __contains__(self, job_name: object) -> bool:
        return job_name in self._jobs

    def __bool__(self) -> bool:
        return bool(self._jobs)

    __nonzero__ = __bool__

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            try:
                other = ClusterSpec(other)
            except ClusterConfigError:
                return False
        return isinstance(other, ClusterSpec) and self._jobs == other._jobs

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"


def as_cluster_spec(value: Any) -> ClusterSpec:
    """``value`` as a ``ClusterSpec`` (accepts a ClusterSpec, a dict or ``None``)."""
    return value if isinstance(value, ClusterSpec) else ClusterSpec(value)


__all__ = ["ClusterSpec", "as_cluster_spec"]
