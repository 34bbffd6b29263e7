"""Typed errors of the cluster layer: bad configuration, timeouts, lost peers."""

from __future__ import annotations


class ClusterError(RuntimeError):
    """Base class of the errors raised while bringing up or running a multi-process cluster."""


class ClusterConfigError(ValueError):
    """A cluster description (``TF_CONFIG``, ``ClusterSpec``, Slurm variables) is invalid.

    The message quotes the offending part of the configuration and says what was expected.
    """


class TFConfigError(ClusterConfigError):
    """``TF_CONFIG`` is malformed: not JSON, a wrong type, a bad address, a duplicate.

    Every problem with ``TF_CONFIG`` raises this one type (a ``ValueError``), whatever the
    input; the message names the key (``"cluster"."worker"[1]``) and quotes the bad part,
    and never contains the cluster token.

    Attributes:
        key: where in ``TF_CONFIG`` the problem is, e.g. ``'"cluster"."worker"[1]'`` (``""``
            for the whole document).

    Example:
        >>> from jaxdist import TFConfigError
        >>> from jaxdist.cluster_resolver import TFConfigClusterResolver
        >>> bad = '{"cluster": {"worker": ["h:+80"]}}'
        >>> try:
        ...     TFConfigClusterResolver(tf_config=bad).cluster_spec()
        ... except TFConfigError as e:
        ...     print(e.key)
        "cluster"."worker"[0]
    """

    def __init__(self, message: str, key: str = ""):
        super().__init__(message)
        self.key = key


class ClusterMergeError(KeyError, ClusterConfigError):
    """Two resolvers of a ``UnionResolver`` define the same task of a job (TF: ``KeyError``).

    Example:
        >>> from jaxdist.cluster_resolver import SimpleClusterResolver, UnionResolver
        >>> UnionResolver(SimpleClusterResolver({"worker": {7: "a:1"}}),
        ...               SimpleClusterResolver({"worker": {7: "b:1"}})).cluster_spec()
        Traceback (most recent call last):
        jaxdist.ClusterMergeError: Duplicate keys detected when merging two ClusterSpecs: ...
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ClusterTimeoutError(ClusterError, TimeoutError):
    """Waiting on other tasks took longer than the configured timeout.

    Attributes:
        tasks: the task names (``"worker:1"``) that did not answer in time, when known.
        timeout_seconds: the timeout that expired.
    """

    def __init__(self, message: str, tasks: tuple[str, ...] = (),
                 timeout_seconds: float | None = None):
        super().__init__(message)
        self.tasks = tuple(tasks)
        self.timeout_seconds = timeout_seconds


class PeerLostError(ClusterError):
    """A peer task of the training cluster died (or became unreachable) while this one waited.

    Attributes:
        tasks: the lost tasks' names, e.g. ``("worker:1",)``.
    """

    def __init__(self, message: str, tasks: tuple[str, ...] = ()):
        super().__init__(message)
        self.tasks = tuple(tasks)


class ProcessFrozenError(PeerLostError):
    """This process was stopped (SIGSTOP, a debugger, a paused host) past the heartbeat
    timeout, so the coordination service declared it lost.

    It is reported, not raised: when the process continues, a guard thread writes
    ``jaxdist.ProcessFrozenError: <task>: ...`` to stderr and ends the process
    with status 1 (XLA would otherwise abort it with a C++ stack trace on its next heartbeat).
    ``tasks`` names this task.
    """


__all__ = [
    "ClusterConfigError",
    "ClusterError",
    "ClusterMergeError",
    "ClusterTimeoutError",
    "PeerLostError",
    "ProcessFrozenError",
    "TFConfigError",
]
