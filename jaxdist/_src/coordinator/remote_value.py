"""``RemoteValue`` (the future of a scheduled function) and ``PerWorkerValues``.

Example:
    >>> rv = coordinator.schedule(step_fn, args=(it,))  # doctest: +SKIP
    >>> rv.fetch()          # numpy result, waits for the function  # doctest: +SKIP
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxdist._src.coordinator.errors import JoinTimeoutError


class RemoteValueStatus(enum.Enum):
    """Where a ``RemoteValue`` stands (TF's ``RemoteValueStatus``).

    Example:
        >>> rv = coordinator.schedule(step_fn)  # doctest: +SKIP
        >>> coordinator.join()  # doctest: +SKIP
        >>> rv._status is RemoteValueStatus.READY  # doctest: +SKIP
        True
    """

    NOT_READY = "NOT_READY"  # the function has not ended
    # READY: it ended with a value or an error (``fetch()`` returns or raises); ABORTED: TF's
    # state for a function lost with its worker, which jaxdist runs again instead.
    READY = "READY"
    ABORTED = "ABORTED"


class RemoteValue:
    """The result of a function scheduled by ``ClusterCoordinator.schedule``.

    It becomes ready once the function ran (on any worker). A value fetched once stays
    readable even if the worker that computed it dies: the result is held by the coordinator.

    Example:
        >>> rv = coordinator.schedule(fn)  # doctest: +SKIP
        >>> coordinator.join()  # doctest: +SKIP
        >>> rv.fetch()  # doctest: +SKIP
    """

    def __init__(self, name: str = "function", default_timeout: float | None = None):
        self._name = name
        self._cond = threading.Condition()
        self._status = RemoteValueStatus.NOT_READY
        self._value: Any = None
        self._error: BaseException | None = None
        self._default_timeout = default_timeout
        self.worker: str | None = None  # the task that produced the value

    # -------------------------------------------------------------- set by the coordinator
    def _set_value(self, value: Any, worker: str | None = None) -> None:
        with self._cond:
            if self._status is not RemoteValueStatus.NOT_READY:
                return
            self._value, self.worker = value, worker
            self._status = RemoteValueStatus.READY
            self._cond.notify_all()

    def _set_error(self, error: BaseException, worker: str | None = None) -> None:
        with self._cond:
            if self._status is not RemoteValueStatus.NOT_READY:
                return
            self._error, self.worker = error, worker
            # TF: a value or a non-retryable error (a cancellation too) is READY; ABORTED
            # is TF's "worker lost, will be retried", which jaxdist handles by re-running.
            self._status = RemoteValueStatus.READY
            self._cond.notify_all()

    # -------------------------------------------------------------- public
    @property
    def status(self) -> RemoteValueStatus:
        return self._status

    def done(self) -> bool:
        """Whether the function finished (with a value or an error)."""
        return self._status is not RemoteValueStatus.NOT_READY

    def _wait(self, timeout: float | None) -> None:
        timeout = self._default_timeout if timeout is None else timeout
        with self._cond:
            if not self._cond.wait_for(self.done, timeout):
                raise JoinTimeoutError(
                    f"the result of {self._name} was not ready within {timeout:.1f} s"
                )
        if self._error is not None:
            raise self._error

    def fetch(self, timeout: float | None = None) -> Any:
        """Waits for the function and returns its result as numpy arrays (a pytree).

        Raises:
            Exception: the function's error, ``CancelledError`` if it was cancelled, or
                ``JoinTimeoutError`` after ``timeout`` seconds.
        """
        self._wait(timeout)
        return self._value

    def get(self, timeout: float | None = None) -> Any:
        """Like ``fetch`` but returns ``jax.Array`` leaves (the value copied to this process)."""
        import jax

        value = self.fetch(timeout)
        return jax.tree.map(lambda x: jax.numpy.asarray(x) if _is_array(x) else x, value)

    def __repr__(self) -> str:
        return f"RemoteValue({self._name}, {self._status.value})"


def set_value(remote_value: RemoteValue, value: Any, worker: str | None = None) -> None:
    """Makes ``remote_value`` ready with ``value`` (computed on ``worker``); the coordinator's
    side of the future (a no-op once it is ready). TF keeps the method private
    (``RemoteValue._set_value``), so the closure queue sets it through this function."""
    remote_value._set_value(value, worker)


def set_error(remote_value: RemoteValue, error: BaseException, worker: str | None = None) -> None:
    """Makes ``remote_value`` ready with ``error`` (``fetch()`` raises it); a no-op once it is
    ready (TF's private ``RemoteValue._set_error``)."""
    remote_value._set_error(error, worker)


def _is_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, np.generic))


class PerWorkerValues:
    """One value per worker; a function receiving it gets the executing worker's part.

    ``create_per_worker_dataset`` and ``iter`` of a per-worker dataset return these.

    Example:
        >>> from jaxdist.coordinator import PerWorkerValues
        >>> seeds = PerWorkerValues([0, 1])           # worker:0 gets 0, worker:1 gets 1
        >>> coordinator.schedule(fn, args=(seeds,))  # doctest: +SKIP
    """

    def __init__(self, values: Sequence[Any]):
        self._values = tuple(values)

    @property
    def values(self) -> tuple[Any, ...]:
        return self._values

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"PerWorkerValues({list(self._values)!r})"


__all__ = ["PerWorkerValues", "RemoteValue", "RemoteValueStatus", "set_error", "set_value"]
