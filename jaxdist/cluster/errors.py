"""Typed errors of the cluster layer: bad configuration, timeouts, lost peers."""

from __future__ import annotations


class ClusterError(RuntimeError):
    """Base class of the errors raised while bringing up or running a multi-process cluster."""


class ClusterConfigError(ValueError):
    """A cluster description (``TF_CONFIG``, ``ClusterSpec``, Slurm variables) is invalid.

    The message quotes the offending part of the configuration and says what was expected.
    """


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


__all__ = ["ClusterConfigError", "ClusterError", "ClusterTimeoutError", "PeerLostError"]
