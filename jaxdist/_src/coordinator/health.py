"""Heartbeats: the coordinator pings every worker and ps task and tracks who is alive.

A worker that does not answer for ``heartbeat_timeout`` seconds (or whose connection is
refused) is marked down and its in-flight function is cancelled, so the function runs again
elsewhere. A worker that answers again is marked up and rejoins on its own; a new
``incarnation`` (the process restarted) makes the coordinator rebuild its per-worker
resources. A ps task that does not answer for ``ps_timeout`` seconds becomes a cluster error
(``PSUnavailableError`` naming it) until it answers again.

Example:
    >>> watcher = HealthWatcher(worker_client, ps_client,  # doctest: +SKIP
    ...                         interval=1.0, timeout=10.0)
    >>> watcher.start()  # doctest: +SKIP
    >>> watcher.workers[0].up.wait(5.0)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

from jaxdist._src.coordinator.errors import CoordinatorError, WorkerUnavailableError
from jaxdist._src.ps.errors import PSError

log = logging.getLogger(__name__)


class WorkerState:
    """What the coordinator knows of one worker task.

    Attributes:
        index: the worker's index in the ``worker`` job.
        name: ``worker:<index>``.
        up: set while the worker answers heartbeats.
        incarnation: the worker process's id (changes on restart), ``None`` before contact.
        last_ok: monotonic time of the last answered heartbeat.
        last_error: the last heartbeat failure.
        restarts: how many times a new incarnation was seen.
    """

    def __init__(self, index: int, name: str):
        self.index, self.name = index, name
        self.up = threading.Event()
        self.incarnation: str | None = None
        self.last_ok = time.monotonic()
        self.last_error: BaseException | None = None
        self.restarts = 0
        self.downs = 0
        self._lock = threading.Lock()
        self._calls: dict[int, Any] = {}  # sender slot -> its call in flight

    @property
    def current_call(self) -> Any:
        """A call in flight to this worker (``None``: none)."""
        with self._lock:
            return next(iter(self._calls.values()), None)

    def set_call(self, call: Any, slot: int = 0) -> None:
        """Records (``None``: forgets) the call in flight from sender ``slot``."""
        with self._lock:
            if call is None:
                self._calls.pop(slot, None)
            else:
                self._calls[slot] = call

    def cancel_call(self) -> None:
        """Cancels every call in flight to this worker (it was lost)."""
        with self._lock:
            calls, self._calls = list(self._calls.values()), {}
        for call in calls:
            call.cancel()

    def mark_down(self, error: BaseException | None = None) -> None:
        with self._lock:  # two senders may lose their calls at once: one down, counted once
            was_up = self.up.is_set()
            self.up.clear()
            if was_up:
                self.downs += 1
        if was_up:
            log.warning("%s is down: %s", self.name, error)
        if error is not None:
            self.last_error = error


class HealthWatcher:
    """A thread that pings every worker (and ps task) each ``interval`` seconds.

    Args:
        worker_client: a ``WorkerClient``.
        ps_client: a ``PSClient`` (or ``None``: no ps pings).
        interval: seconds between heartbeat rounds.
        timeout: seconds without an answer after which a worker is down.
        ps_timeout: seconds without an answer after which a ps task is an error.
        on_ps_error: called with a ``PSError`` when a ps is lost, with ``None`` when every
            ps answers again.
        on_restart: called with the ``WorkerState`` when a worker has a new incarnation.
    """

    def __init__(self, worker_client: Any, ps_client: Any, interval: float, timeout: float,
                 ps_timeout: float, on_ps_error: Callable[[PSError | None], None],
                 on_restart: Callable[[WorkerState], None]):
        if interval <= 0 or timeout <= 0 or ps_timeout <= 0:
            raise ValueError(f"heartbeat interval, timeout and ps_timeout must be positive "
                             f"seconds, got {interval}, {timeout}, {ps_timeout}")
        self._workers_client = worker_client
        self._ps_client = ps_client
        self.interval, self.timeout, self.ps_timeout = interval, timeout, ps_timeout
        self.workers = [WorkerState(i, worker_client.task_name(i))
                        for i in range(worker_client.num_tasks)]
        n_ps = ps_client.num_tasks if ps_client is not None else 0
        self._ps_last_ok = [time.monotonic()] * n_ps
        self._ps_error: PSError | None = None
        self._on_ps_error, self._on_restart = on_ps_error, on_restart
        self._stop = threading.Event()
        self._pool = futures.ThreadPoolExecutor(
            max_workers=min(32, len(self.workers) + n_ps),
            thread_name_prefix="jaxdist-coordinator-ping")
        self._thread = threading.Thread(target=self._loop, name="jaxdist-coordinator-health",
                                        daemon=True)

    def start(self) -> HealthWatcher:
        self._thread.start()
        return self

    # -------------------------------------------------------------- pings
    def _ping_worker(self, w: WorkerState) -> None:
        try:
            meta, _ = self._workers_client.call(w.index, "Ping",
                                                timeout=min(self.timeout, 5.0))
        except CoordinatorError as e:
            if time.monotonic() - w.last_ok > self.timeout or "refused" in str(e).lower() \
                    or "failed to connect" in str(e).lower():
                if w.up.is_set():
                    w.mark_down(e)
                    w.cancel_call()
                else:
                    w.last_error = e
            return
        w.last_ok = time.monotonic()
        inc = meta.get("incarnation")
        if w.incarnation is not None and inc != w.incarnation:
            w.restarts += 1
            log.warning("%s restarted (incarnation %s -> %s)", w.name, w.incarnation, inc)
            w.incarnation = inc
            self._on_restart(w)
        w.incarnation = inc
        if not w.up.is_set():
            log.info("%s is up", w.name)
        w.up.set()

    def _ping_ps(self, task: int) -> PSError | None:
        try:
            self._ps_client.call(task, "Ping", {}, timeout=min(self.ps_timeout, 5.0))
            self._ps_last_ok[task] = time.monotonic()
            return None
        except PSError as e:
            if time.monotonic() - self._ps_last_ok[task] > self.ps_timeout:
                return e
            return None

    def ping_all(self) -> None:
        """One heartbeat round (all tasks in parallel)."""
        futs = [self._pool.submit(self._ping_worker, w) for w in self.workers]
        ps_futs = [self._pool.submit(self._ping_ps, t) for t in range(len(self._ps_last_ok))]
        for f in futs:
            f.result()
        errors = [e for e in (f.result() for f in ps_futs) if e is not None]
        if errors and self._ps_error is None:
            self._ps_error = errors[0]
            self._on_ps_error(errors[0])
        elif not errors and self._ps_error is not None:
            self._ps_error = None
            self._on_ps_error(None)

    def _loop(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                self.ping_all()
            except RuntimeError:  # the ping pool was shut down (interpreter exit)
                return
            except Exception:  # noqa: BLE001 - the watcher must keep watching
                log.exception("heartbeat round failed")
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - start)))

    # -------------------------------------------------------------- queries
    def down_workers(self) -> list[str]:
        return [w.name for w in self.workers if not w.up.is_set()]

    def unavailable_error(self) -> WorkerUnavailableError:
        down = self.down_workers()
        detail = "; ".join(f"{w.name}: {w.last_error}" for w in self.workers
                           if not w.up.is_set() and w.last_error is not None)
        return WorkerUnavailableError(
            f"workers {down} did not answer heartbeats within {self.timeout:.1f} s"
            + (f" ({detail})" if detail else ""), task=down[0] if down else None)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["HealthWatcher", "WorkerState"]
