"""Steps in flight across processes, waited on by a background thread with a bounded wait.

A multi-process strategy must notice a lost peer (a collective that fails or never returns)
without waiting on every step in the training loop, which would stop two steps from ever
overlapping. ``WatchedSteps`` keeps at most ``max_in_flight`` steps dispatched: a daemon thread
waits for each step's outputs in order; before dispatching step ``k`` the training thread waits
(at most ``timeout_seconds``) for step ``k - max_in_flight`` and re-raises its error. While the
daemon thread waits on a step, a ``Watchdog`` calls ``on_overrun(elapsed)`` every
``timeout_seconds`` it is still running: the strategy asks the coordination service there which
peers are gone (the training thread may be blocked where no exception can reach it, e.g. reading
an output of that step).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import jax

from jaxdist._src.distributed.waiting import Watchdog
from jaxdist._src.strategies.inflight import StepThrottle


def _wait_outputs(leaves: list[Any]) -> None:
    """Waits for a step's outputs. An output donated to a later step meanwhile is skipped: that
    step consumes it, and waiting for the later step covers it."""
    for x in leaves:
        if x.is_deleted():
            continue
        try:
            x.block_until_ready()
        except Exception as e:
            # Donated meanwhile (JAX 0.11 may say so before is_deleted() does).
            if x.is_deleted() or "donated" in str(e):
                continue
            raise


class StepNotFinished(Exception):
    """A dispatched step did not finish within the bounded wait (internal)."""


class _Step:
    __slots__ = ("leaves", "done", "error")

    def __init__(self, leaves: list[Any]):
        self.leaves = leaves
        self.done = threading.Event()
        self.error: BaseException | None = None


class WatchedSteps(StepThrottle):
    """``StepThrottle`` whose waits are bounded and done by a background thread.

    Args:
        max_in_flight: how many dispatched steps may be unfinished.
        timeout_seconds: bound on the training thread's wait for the oldest step, and the
            watchdog period of the background wait.
        on_overrun: called from a watchdog thread as ``on_overrun(elapsed)`` while the
            background thread has waited ``timeout_seconds`` (and again every period) on one
            step; returns True once it handled it (see
            ``jaxdist._src.distributed.waiting.Watchdog``).

    Raises (from ``before_dispatch`` / ``wait_all``):
        StepNotFinished: the oldest step did not finish within ``timeout_seconds``.
        Exception: what waiting on a step raised (a failed collective).

    Example:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from jaxdist._src.strategies.watched_steps import WatchedSteps
        >>> steps = WatchedSteps(2, 60.0, on_overrun=lambda elapsed: False)
        >>> steps.before_dispatch()
        >>> out = jax.jit(lambda x: x * 2)(jnp.ones(3))
        >>> steps.after_dispatch(out)
    """

    def __init__(self, max_in_flight: int, timeout_seconds: float,
                 on_overrun: Callable[[float], bool]):
        super().__init__(max_in_flight)
        self.timeout_seconds = float(timeout_seconds)
        self._on_overrun = on_overrun
        self._queue: queue.SimpleQueue[_Step] = queue.SimpleQueue()
        self._watchdog = Watchdog("jaxdist-step-monitor")
        self._thread: threading.Thread | None = None
        self.training_thread_waiting = False  # the training thread is in a bounded wait

    def after_dispatch(self, outputs: Any, marker: Any = None) -> None:
        """Records the outputs of a step just dispatched and hands them to the waiter (which
        waits on all of them: ``marker`` is accepted as ``StepThrottle`` takes it)."""
        step = _Step([x for x in jax.tree.leaves(outputs) if isinstance(x, jax.Array)])
        with self._lock:
            self._pending.append(step)  # type: ignore[arg-type]
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="jaxdist-step-waiter",
                                                daemon=True)
                self._thread.start()
        self._queue.put(step)

    def _work(self) -> None:
        while True:
            step = self._queue.get()
            with self._watchdog.watch(self.timeout_seconds, self._on_overrun):
                try:
                    _wait_outputs(step.leaves)
                except BaseException as e:  # noqa: BLE001 - handed to the training thread
                    step.error = e
            step.leaves = []
            step.done.set()

    def _finish(self, step: _Step) -> None:
        self.training_thread_waiting = True
        try:
            finished = step.done.wait(self.timeout_seconds)
        finally:
            self.training_thread_waiting = False
        if not finished:
            raise StepNotFinished(
                f"a step did not finish within {self.timeout_seconds:g} s")
        if step.error is not None:
            raise step.error

    def before_dispatch(self) -> None:
        """Waits (bounded) until fewer than ``max_in_flight`` steps are pending."""
        while True:
            with self._lock:
                if len(self._pending) < self.max_in_flight:
                    return
                oldest = self._pending.popleft()
            self._finish(oldest)  # type: ignore[arg-type]

    def wait_all(self) -> None:
        """Waits (bounded, per step) for every pending step."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                oldest = self._pending.popleft()
            self._finish(oldest)  # type: ignore[arg-type]


__all__ = ["StepNotFinished", "WatchedSteps"]
