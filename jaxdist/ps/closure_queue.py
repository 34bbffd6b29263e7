"""The coordinator's queue of scheduled functions (TF's ``_CoordinatedClosureQueue``).

Worker threads ``get`` closures and report each as finished, failed, or to be re-run
(``put_back`` after the worker was lost). The first failure cancels every queued closure;
``wait`` (``join``) raises it once and clears it, after which the queue accepts new work.

Example:
    >>> q = ClosureQueue()
    >>> q.put(closure)
    >>> c = q.get(timeout=0.1)      # a worker thread
    >>> q.mark_finished()
    >>> q.wait(timeout=10.0)
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jaxdist.ps.coordinator_errors import CancelledError, CoordinatorShutdownError
from jaxdist.ps.remote_value import RemoteValue


@dataclass
class Closure:
    """One scheduled function call.

    Attributes:
        closure_id: a number unique in this coordinator.
        fn: the function.
        args: positional arguments (may hold ``PerWorkerValues`` and ``RemoteValue``s).
        kwargs: keyword arguments.
        remote_value: where the result goes.
        attempts: how many times a worker started it.
    """

    closure_id: int
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    remote_value: RemoteValue
    attempts: int = 0
    tags: dict[str, Any] = field(default_factory=dict)

    def mark_cancelled(self) -> None:
        self.remote_value._set_error(CancelledError(
            f"function #{self.closure_id} ({_fn_name(self.fn)}) was cancelled because an "
            f"earlier function failed; schedule it again"
        ))


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


class ClosureQueue:
    """Thread-safe queue of closures with in-flight accounting and a first-error slot."""

    def __init__(self):
        self._cond = threading.Condition()
        self._queue: collections.deque[Closure] = collections.deque()
        self._inflight = 0
        self._error: BaseException | None = None
        self._sticky: BaseException | None = None  # a cluster error (ps down), until cleared
        self._stopped = False
        self._progress = 0  # closures that ended (finished, failed, put back)

    # -------------------------------------------------------------- scheduling side
    def raise_if_error(self) -> None:
        """Raises (and clears) the pending function error, or the sticky cluster error."""
        with self._cond:
            self._raise_pending()

    def _raise_pending(self) -> None:
        # Holding self._cond.
        if self._sticky is not None:
            raise self._sticky
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def put(self, closure: Closure) -> None:
        """Queues ``closure``; raises a pending error first (and then does not queue)."""
        with self._cond:
            if self._stopped:
                raise CoordinatorShutdownError("the coordinator was shut down; create a new one")
            if self._sticky is not None:
                raise self._sticky
            if self._error is not None:
                e, self._error = self._error, None
                raise e
            self._queue.append(closure)
            self._cond.notify_all()

    def wait(self, timeout: float | None, on_timeout: Callable[[], BaseException]) -> None:
        """Blocks until nothing is queued or in flight; raises the first error once.

        With an error, waits for the in-flight closures to end first (TF: when ``join``
        returns or raises, no function is still running). ``timeout`` bounds the time without
        progress: it restarts whenever a closure ends, so long jobs that keep moving never
        time out, and a stalled one raises ``on_timeout()``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        seen = self._progress
        with self._cond:
            while True:
                if self._progress != seen and timeout is not None:
                    seen, deadline = self._progress, time.monotonic() + timeout
                if self._sticky is not None:
                    raise self._sticky
                if self._stopped:
                    raise CoordinatorShutdownError("the coordinator was shut down")
                idle = self._inflight == 0
                if idle and (self._error is not None or not self._queue):
                    if self._error is not None:
                        e, self._error = self._error, None
                        raise e
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise on_timeout()
                self._cond.wait(0.1 if left is None else min(left, 0.1))

    def done(self) -> bool:
        """True when nothing is queued or in flight (raises a pending error, like TF)."""
        with self._cond:
            self._raise_pending()
            return self._inflight == 0 and not self._queue

    # -------------------------------------------------------------- worker side
    def get(self, timeout: float) -> Closure | None:
        """The next closure (now in flight), or ``None`` after ``timeout`` or when stopped."""
        with self._cond:
            if not self._queue and not self._stopped:
                self._cond.wait(timeout)
            if self._stopped or not self._queue:
                return None
            self._inflight += 1
            return self._queue.popleft()

    def mark_finished(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._progress += 1
            self._cond.notify_all()

    def put_back(self, closure: Closure) -> None:
        """Re-queues an in-flight closure at the front (its worker was lost)."""
        with self._cond:
            self._inflight -= 1
            if self._error is not None or self._sticky is not None or self._stopped:
                closure.mark_cancelled()
            else:
                self._queue.appendleft(closure)
            self._cond.notify_all()

    def mark_failed(self, error: BaseException) -> None:
        """An in-flight closure failed: keep the first error, cancel everything queued."""
        with self._cond:
            self._inflight -= 1
            self._progress += 1
            if self._error is None:
                self._error = error
            self._cancel_queued()
            self._cond.notify_all()

    def report_error(self, error: BaseException) -> None:
        """A failure outside any closure (e.g. building a per-worker dataset): like a
        failed closure, it cancels the queue and is raised once by ``join``/``schedule``."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cancel_queued()
            self._cond.notify_all()

    def _cancel_queued(self) -> None:
        while self._queue:
            self._queue.popleft().mark_cancelled()

    def set_cluster_error(self, error: BaseException | None) -> None:
        """Sets (or clears with ``None``) a sticky cluster error, e.g. a ps that is down."""
        with self._cond:
            self._sticky = error
            if error is not None:
                self._cancel_queued()
            self._cond.notify_all()

    @property
    def cluster_error(self) -> BaseException | None:
        return self._sticky

    @property
    def inflight(self) -> int:
        return self._inflight

    def __len__(self) -> int:
        return len(self._queue)

    def stop(self) -> None:
        """Cancels everything queued and wakes every waiter."""
        with self._cond:
            self._stopped = True
            while self._queue:
                c = self._queue.popleft()
                c.remote_value._set_error(CoordinatorShutdownError(
                    f"the coordinator was shut down before function #{c.closure_id} ran"))
            self._cond.notify_all()


__all__ = ["Closure", "ClosureQueue"]
