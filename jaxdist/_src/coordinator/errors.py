"""Typed errors of the ``ClusterCoordinator``; each names the task at fault when one is.

The ps-side errors (``PSUnavailableError`` naming ``ps:<i>``, ...) come from
``jaxdist._src.ps.errors`` and pass through the coordinator unchanged.
"""

from __future__ import annotations

from jaxdist._src.ps.errors import PSError


class CoordinatorError(PSError):
    """Base class of the coordinator's own errors."""


class WorkerUnavailableError(CoordinatorError):
    """A worker task did not answer (down, restarting, unreachable) within the timeout.

    Example:
        >>> from jaxdist.coordinator import WorkerUnavailableError
        >>> raise WorkerUnavailableError("worker:1 at 127.0.0.1:1234 did not answer Ping "
        ...                              "within 2.0 s", task="worker:1")
        Traceback (most recent call last):
        ...
        jaxdist.coordinator.WorkerUnavailableError: worker:1 at 127.0.0.1:1234 did not answer
        Ping within 2.0 s
    """


class WorkerAuthenticationError(CoordinatorError):
    """A worker task refused a request because the cluster token was missing or wrong."""


class CancelledError(CoordinatorError):
    """The function was cancelled, queued or in flight, because an earlier one failed.

    ``RemoteValue.fetch()`` of a cancelled function raises it (TF's
    ``tf.errors.CancelledError``, same message: "The corresponding function is cancelled.
    Please reschedule the function."). A function cancelled in flight may have pushed some of
    its updates already.

    Example:
        >>> try:
        ...     rv.fetch()      # a function cancelled after an earlier one failed
        ... except CancelledError as e:  # doctest: +SKIP
        ...     print(e)
        The corresponding function is cancelled. Please reschedule the function.
    """


class ClosureInputError(CoordinatorError):
    """An input of the function failed, so it could not run (TF's ``ClosureInputError``).

    The input is a per-worker value (e.g. from ``_create_per_worker_resources`` or a
    per-worker dataset) whose creation raised on the worker, or a failed ``RemoteValue``.
    """


class MissingResourceError(CoordinatorError):
    """A worker lacks a per-worker resource (it restarted); the coordinator rebuilds it."""


class JoinTimeoutError(CoordinatorError):
    """``join`` / ``fetch`` waited longer than their timeout; names the busy workers."""


class CoordinatorShutdownError(CoordinatorError):
    """The coordinator was shut down; scheduled functions that had not run are abandoned."""


class RemoteError(CoordinatorError):
    """A user function raised an exception that could not be sent back as itself.

    Attributes:
        remote_type: the exception's type name on the worker.
        remote_traceback: the worker's formatted traceback.
    """

    def __init__(self, message: str, task: str | None = None, remote_type: str = "",
                 remote_traceback: str = ""):
        super().__init__(message, task=task)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


__all__ = [
    "CancelledError",
    "ClosureInputError",
    "CoordinatorError",
    "CoordinatorShutdownError",
    "JoinTimeoutError",
    "MissingResourceError",
    "RemoteError",
    "WorkerAuthenticationError",
    "WorkerUnavailableError",
]
