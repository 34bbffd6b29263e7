"""The coordinator's queue of scheduled functions (TF's ``_CoordinatedClosureQueue``).

Worker threads ``get`` closures and report each as finished, failed, or to be re-run
(``put_back`` after the worker was lost). As in TF, ``mark_failed`` only records the first
error; the next ``put`` (``schedule``), ``wait`` (``join``) or ``done`` cancels the functions in
flight (through the ``on_cancel`` hook; they end as cancelled), waits until none is in flight,
cancels every queued function (``fetch()`` raises ``CancelledError``), then raises the first
error once and clears it: the queue accepts new work again. Errors of the functions that ended
while being cancelled never surface.

Example:
    >>> from jaxdist._src.coordinator.closure_queue import Closure, ClosureQueue
    >>> from jaxdist._src.coordinator.remote_value import RemoteValue
    >>> closure = Closure(0, print, (), {}, RemoteValue())
    >>> q = ClosureQueue()
    >>> q.put(closure)
    >>> c = q.get(timeout=0.1)      # a worker thread
    >>> q.mark_finished()
    >>> q.wait(timeout=10.0)
    True
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxdist._src.coordinator import remote_value as remote_value_lib
from jaxdist._src.coordinator.errors import CancelledError, CoordinatorShutdownError
from jaxdist._src.coordinator.remote_value import RemoteValue


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

    cancel_requested: bool = False
    tag: Any = None  # put(tag=...): only get(tag=tag) returns it, put_back keeps it there

    def set_value(self, value: Any, worker: str | None = None) -> None:
        """Its ``fetch()`` returns ``value`` (computed on ``worker``)."""
        remote_value_lib.set_value(self.remote_value, value, worker)

    def set_error(self, error: BaseException, worker: str | None = None) -> None:
        """Its ``fetch()`` raises ``error`` (raised on ``worker``, or on the coordinator)."""
        remote_value_lib.set_error(self.remote_value, error, worker)

    def mark_cancelled(self) -> None:
        """Its ``fetch()`` raises ``CancelledError`` (TF's message, then which function)."""
        remote_value_lib.set_error(self.remote_value, CancelledError(
            f"The corresponding function is cancelled. Please reschedule the function. "
            f"(function #{self.closure_id}, {_fn_name(self.fn)}, was cancelled because an "
            f"earlier function failed)"
        ))


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


class ClosureQueue:
    """Thread-safe queue of closures with in-flight accounting and a first-error slot.

    Args:
        on_cancel: called (holding no lock of the queue's callers) when an error is raised
            and the functions in flight must be cancelled; it must make them end soon
            (``put_back`` or ``mark_failed``). ``None``: in-flight functions are waited for.

    Example:
        >>> from jaxdist._src.coordinator.closure_queue import Closure, ClosureQueue
        >>> from jaxdist._src.coordinator.remote_value import RemoteValue
        >>> closure = Closure(0, print, (), {}, RemoteValue())
        >>> q = ClosureQueue()
        >>> q.put(closure); c = q.get(); q.mark_failed(ValueError("x"))
        >>> q.wait()            # raises ValueError once, then the queue is clean
        Traceback (most recent call last):
        ...
        ValueError: x
        >>> q.wait()
        True
    """

    def __init__(self, on_cancel: Callable[[], None] | None = None):
        self._cond = threading.Condition()
        self._put_wait_lock = threading.Lock()  # TF: no put while a wait decides
        self._queue: collections.deque[Closure] = collections.deque()
        # TF's tagged queues: closures for one worker (tag = worker index); not counted by
        # done()/wait() unless whoever tags them counts them in flight.
        self._tagged: collections.defaultdict[Any, collections.deque[Closure]] = (
            collections.defaultdict(collections.deque))
        self._inflight = 0
        self._error: BaseException | None = None
        self._sticky: BaseException | None = None  # a cluster error (ps down), until cleared
        self._stopped = False
        self._cancelling = False
        self._progress = 0  # closures that ended (finished, failed, put back)
        self.on_cancel = on_cancel
        self.cancellations = 0  # how many times an error cancelled the functions (TF's CM)

    # -------------------------------------------------------------- scheduling side
    def raise_if_error(self) -> None:
        """Raises (and clears) the pending function error, or the sticky cluster error."""
        with self._cond:
            if self._sticky is not None:
                raise self._sticky
            self._raise_if_error()

    def _raise_if_error(self) -> None:
        """TF's ``_raise_if_error``: cancel in flight and queued, raise the error once.

        Holding ``self._cond``.
        """
        if self._error is None:
            return
        self._cancel_all()
        e, self._error = self._error, None
        raise e

    def _cancel_all(self) -> None:
        # Holding self._cond. Cancel what is in flight, wait until it ended, cancel the queue.
        self._cancelling = True
        self.cancellations += 1
        try:
            if self._inflight and self.on_cancel is not None:
                self.on_cancel()
            while self._inflight > 0:
                self._cond.wait(0.1)
            while self._queue:
                self._queue.popleft().mark_cancelled()
        finally:
            self._cancelling = False
            self._cond.notify_all()

    def put(self, closure: Closure, tag: Any = None) -> None:
        """Queues ``closure``; with a pending error, cancels everything (this closure too)
        and raises the error (TF's ``put``). With ``tag``, only ``get(tag=tag)`` returns it."""
        with self._put_wait_lock, self._cond:
            if self._stopped:
                raise CoordinatorShutdownError("the coordinator was shut down; create a new one")
            if self._sticky is not None:
                raise self._sticky
            if tag is not None:
                closure.tag = tag
                self._tagged[tag].append(closure)
                self._cond.notify_all()
                return
            self._queue.append(closure)
            self._raise_if_error()
            self._cond.notify_all()

    def wait(self, timeout: float | None = None,
             on_timeout: Callable[[], BaseException] | None = None) -> bool:
        """Blocks until nothing is queued or in flight, or an error; raises the error once.

        ``timeout`` bounds the time without progress: it restarts whenever a closure ends, so
        long jobs that keep moving never time out. A stalled wait raises ``on_timeout()`` or,
        without ``on_timeout``, returns ``False`` (TF).

        Returns:
            ``True`` when everything finished.
        """
        with self._put_wait_lock, self._cond:
            deadline = None if timeout is None else time.monotonic() + timeout
            seen = self._progress
            while True:
                if self._progress != seen and timeout is not None:
                    seen, deadline = self._progress, time.monotonic() + timeout
                if self._sticky is not None:
                    raise self._sticky
                if self._stopped:
                    raise CoordinatorShutdownError("the coordinator was shut down")
                if self._error is not None:
                    self._raise_if_error()
                if self._inflight == 0 and not self._queue:
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    if on_timeout is None:
                        return False
                    raise on_timeout()
                self._cond.wait(0.1 if left is None else min(left, 0.1))

    def done(self) -> bool:
        """True when nothing is queued or in flight (raises a pending error, like TF)."""
        with self._cond:
            if self._sticky is not None:
                raise self._sticky
            self._raise_if_error()
            return self._inflight == 0 and not self._queue

    # -------------------------------------------------------------- worker side
    def get(self, timeout: float | None = None, tag: Any = None) -> Closure | None:
        """The next closure (now in flight), or ``None`` after ``timeout``, when stopped or
        while an error cancels the functions. With ``tag``, a closure put with that tag
        comes first (TF: it is not counted in flight here)."""
        with self._cond:
            deadline = None if timeout is None else time.monotonic() + timeout

            def tagged() -> bool:
                return tag is not None and bool(self._tagged.get(tag))

            while ((not self._queue and not tagged()) or self._cancelling) and not self._stopped:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)
            if self._stopped:
                return None
            if tagged():
                return self._tagged[tag].popleft()
            self._inflight += 1
            return self._queue.popleft()

    def get_batch(self, max_n: int, timeout: float | None = None, tag: Any = None,
                  min_queued: int = 1, share: int = 1,
                  on_take: Callable[[list[Closure]], None] | None = None) -> list[Closure]:
        """Several closures at once (all in flight now), oldest first; ``[]`` as ``get``
        returns ``None``.

        Waits until at least ``min_queued`` are queued, then takes ``len(queue) // share``
        of them (at least 1, at most ``max_n``): a short queue is handed out one closure at
        a time, a long one in batches. A closure put with ``tag`` comes alone, first.
        ``on_take(batch)`` is called holding the queue's lock (batches are taken in the order
        of its calls).
        """
        with self._cond:
            deadline = None if timeout is None else time.monotonic() + timeout

            def tagged() -> bool:
                return tag is not None and bool(self._tagged.get(tag))

            while ((len(self._queue) < max(1, min_queued) and not tagged())
                   or self._cancelling) and not self._stopped:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return []
                self._cond.wait(left)
            if self._stopped:
                return []
            if tagged():
                batch = [self._tagged[tag].popleft()]
            else:
                n = max(1, min(max_n, len(self._queue) // max(1, share)))
                self._inflight += n
                batch = [self._queue.popleft() for _ in range(n)]
            if on_take is not None:
                on_take(batch)
            return batch

    def _end_inflight(self, what: str) -> None:
        if self._inflight < 1:
            raise AssertionError(f"There is no inflight closures to {what}.")
        self._inflight -= 1
        self._progress += 1

    def mark_finished(self) -> None:
        """An in-flight closure finished."""
        with self._cond:
            self._end_inflight("mark_finished")
            if self._inflight == 0:
                # Only "nothing in flight" wakes anyone (``wait``, a cancellation); ``wait``
                # sees the progress that restarts its timeout at its next 0.1 s look.
                self._cond.notify_all()

    def put_back(self, closure: Closure) -> None:
        """Re-queues an in-flight closure at the front (its worker was lost), in schedule
        order among the closures put back before it; with a pending error it is cancelled
        instead (TF)."""
        with self._cond:
            if self._error is not None or self._sticky is not None or self._stopped:
                self._end_inflight("put_back")
                closure.mark_cancelled()
            elif closure.tag is not None:
                # Still counted in flight by whoever tagged it; get(tag) does not count it.
                self._tagged[closure.tag].appendleft(closure)
            else:
                self._end_inflight("put_back")
                # Closures put back (several from one batch, or from both calls in flight)
                # go back in the order they were scheduled, so a worker still runs a
                # per-worker iterator's steps in that order (step numbers match the data).
                i = 0
                while i < len(self._queue) and self._queue[i].closure_id < closure.closure_id:
                    i += 1
                self._queue.insert(i, closure)
            self._cond.notify_all()

    def mark_failed(self, error: BaseException) -> None:
        """An in-flight closure failed: keep the first error (TF: the queue is cancelled when
        the error is raised by ``put``/``wait``/``done``)."""
        with self._cond:
            self._end_inflight("mark_failed")
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    def report_error(self, error: BaseException) -> None:
        """A failure outside any closure: kept like a closure's error (raised once by the
        next ``put``/``wait``/``done``, which cancels the functions)."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    def set_cluster_error(self, error: BaseException | None) -> None:
        """Sets (or clears with ``None``) a sticky cluster error, e.g. a ps that is down."""
        with self._cond:
            self._sticky = error
            if error is not None:
                while self._queue:
                    self._queue.popleft().mark_cancelled()
            self._cond.notify_all()

    @property
    def cluster_error(self) -> BaseException | None:
        return self._sticky

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def cancelling(self) -> bool:
        """Whether an error is cancelling the functions in flight right now."""
        return self._cancelling

    def __len__(self) -> int:
        return len(self._queue)

    def stop(self) -> None:
        """Cancels everything queued and wakes every waiter."""
        with self._cond:
            self._stopped = True
            pending = list(self._queue) + [c for q in self._tagged.values() for c in q]
            self._queue.clear()
            self._tagged.clear()
            for c in pending:
                remote_value_lib.set_error(c.remote_value, CoordinatorShutdownError(
                    f"the coordinator was shut down before function #{c.closure_id} ran"))
            self._cond.notify_all()


__all__ = ["Closure", "ClosureQueue"]
