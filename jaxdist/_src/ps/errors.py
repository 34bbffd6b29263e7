"""Typed errors of the parameter-server runtime; each names the ps task (or worker) at fault."""

from __future__ import annotations


class PSError(RuntimeError):
    """Base class of parameter-server errors.

    Attributes:
        task: the task at fault, e.g. ``"ps:1"`` (``None`` when no single task is).
        address: its address, when known.
    """

    def __init__(self, message: str, task: str | None = None, address: str | None = None):
        super().__init__(message)
        self.task = task
        self.address = address


class PSUnavailableError(PSError):
    """A ps task did not answer within the timeout (down, unreachable, or overloaded).

    Example:
        >>> from jaxdist.ps import PSUnavailableError
        >>> raise PSUnavailableError("ps:1 at 127.0.0.1:1234 did not answer within 5.0 s")
        Traceback (most recent call last):
        ...
        jaxdist.ps.PSUnavailableError: ps:1 at 127.0.0.1:1234 did not answer within 5.0 s
    """


class PSAuthenticationError(PSError):
    """A ps task refused a request because the cluster token was missing or wrong."""


class PSNotFoundError(PSError):
    """A request named a variable (or checkpoint) the ps task does not hold."""


class PSInvalidArgumentError(PSError, ValueError):
    """A request a ps task rejected as malformed (shape, dtype, version mismatch, ...)."""


class PSCheckpointWriteError(PSError):
    """A ps task could not write a checkpoint: its disk is full, read-only, or failed.

    The partial checkpoint was removed and the earlier ones are intact; the ps goes on
    serving. The message says how many bytes the checkpoint needed and how many were free.

    Attributes:
        needed: bytes the checkpoint file takes (``None`` across the wire: see the message).
        free: bytes free on its filesystem after the partial write was removed (``None``:
            unknown).
        errno: the operating system's error number (``errno.ENOSPC``, ``EROFS``, ``EIO``...).
    """

    def __init__(self, message: str, task: str | None = None, address: str | None = None,
                 needed: int | None = None, free: int | None = None,
                 errno: int | None = None):
        super().__init__(message, task=task, address=address)
        self.needed, self.free, self.errno = needed, free, errno


class StalenessTimeoutError(PSError):
    """Bounded-staleness (SSP) training waited too long for the slowest worker."""


class VariablesNotReadyError(PSError):
    """A non-chief worker waited too long for the chief to create the variables."""


__all__ = [
    "PSAuthenticationError",
    "PSCheckpointWriteError",
    "PSError",
    "PSInvalidArgumentError",
    "PSNotFoundError",
    "PSUnavailableError",
    "StalenessTimeoutError",
    "VariablesNotReadyError",
]
