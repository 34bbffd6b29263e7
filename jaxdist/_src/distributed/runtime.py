"""JAX's distributed runtime (coordination service and client) started the way jaxdist needs.

``start_runtime`` does what ``jax._src.distributed.State.initialize`` does in JAX 0.10
(``get_distributed_runtime_client(...).connect()``, everything recorded in
``jax._src.distributed.global_state``, where XLA's backends and gloo look for the client), with
two differences: JAX's preemption sync manager is not started (jaxdist owns SIGTERM), and
process 0 runs the coordination service in a helper process
(``jaxdist._src.distributed.service_process``) instead of in itself. JAX terminates every
process whose client loses the service, so a service inside process 0 would take the survivors
down with it when process 0 dies; a service that outlives it lets them raise ``PeerLostError``
naming it.

Why not a non-fatal error callback instead: ``get_distributed_runtime_client`` accepts a
``missed_heartbeat_callback``, but jaxlib 0.10.2 binds it as ``std::function<void(absl::Status)>``
and has no Python conversion for ``absl::Status``: when XLA calls it (on a gRPC thread),
nanobind throws ``std::bad_cast`` and the process terminates ("terminate called after throwing
an instance of 'std::bad_cast'"). Without a callback XLA uses its default, which logs
"Terminating process because the JAX distributed service detected fatal errors" and aborts.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxdist._src.distributed.link_guard import LinkGuard
from jaxdist._src.distributed.service_process import start_service_process
from jaxdist._src.distributed.waiting import call_with_timeout

log = logging.getLogger(__name__)

_REGISTRATION_SLACK_SECONDS = 3600  # JAX's own registration deadline, past jaxdist's timeout
_abandoned = threading.Event()


class JoinTimeout(TimeoutError):
    """Not every process registered with the coordination service in time."""


def start_runtime(coordination_address: str, num_processes: int, process_id: int,
                  bind_address: str, join_timeout: float, heartbeat_timeout: int,
                  shutdown_timeout: int, recoverable: bool = True,
                  linger_seconds: float = 60.0) -> None:
    """Starts the coordination service (from process 0) and connects this process's client.

    On return ``jax.distributed.is_initialized()`` is true and JAX's backends (gloo included)
    use the client, exactly as after ``jax.distributed.initialize``.

    JAX aborts the process when registration runs past the client's ``init_timeout``, so the
    client gets a long one (``join_timeout`` + 1 h) and the connection is waited for, bounded
    by ``join_timeout``, on a daemon thread: a group that does not assemble in time is a
    ``JoinTimeout`` here, and the abandoned registration keeps waiting in the background
    (``join_abandoned()``) until the process exits.

    Args:
        coordination_address: ``host:port`` of the coordination service.
        num_processes: processes in the group.
        process_id: this process's index.
        bind_address: where the service listens.
        join_timeout: seconds to wait for every process to register.
        heartbeat_timeout: seconds after which a silent process is declared dead.
        shutdown_timeout: seconds the shutdown of the client and service may take.
        recoverable: the service keeps running when a task dies (JAX's recoverable mode).
        linger_seconds: how long the service keeps serving the survivors after process 0
            died.

    Raises:
        JoinTimeout: not every process registered within ``join_timeout``.
        RuntimeError: JAX's distributed runtime is already initialized in this process, or the
            service did not start.
        Exception: whatever JAX raises when the client cannot connect.
    """
    from jaxdist._src.compat import jax_internals

    _jax = jax_internals.jax_extension()
    state = jax_internals.distributed_module().global_state
    if state.client is not None or state.service is not None:
        raise RuntimeError("JAX's distributed runtime is already initialized in this process")
    state.coordination_address = coordination_address
    state.process_id = process_id
    state.num_processes = num_processes
    register_timeout = int(math.ceil(join_timeout)) + _REGISTRATION_SLACK_SECONDS
    if process_id == 0:
        log.info("starting the JAX distributed service on %s", bind_address)
        state.service = start_service_process(
            bind_address, num_processes, heartbeat_timeout, shutdown_timeout, recoverable,
            linger_seconds, timeout_seconds=max(30.0, join_timeout),
            register_timeout=register_timeout,
        )
    state.client = _jax.get_distributed_runtime_client(
        coordination_address,
        process_id,
        init_timeout=register_timeout,
        shutdown_timeout=shutdown_timeout,
        heartbeat_timeout=heartbeat_timeout,
        use_compression=True,
    )
    log.info("connecting to the JAX distributed service on %s", coordination_address)
    finished, error = call_with_timeout(state.client.connect, join_timeout, "jaxdist-connect")
    if not finished:
        _abandoned.set()
        raise JoinTimeout(f"not every process registered within {join_timeout:g} s")
    if error is not None:
        raise error
    # JAX's preemption service is not started: its notifier would take SIGTERM and tell
    # nobody. jaxdist answers SIGTERM itself (jaxdist._src.distributed.preemption); orbax
    # reads "no preemption service" as "no preemption".
    partition = os.environ.get("JAX_PARTITION_INDEX")
    state.partition_index = int(partition) if partition is not None else None


class FreezeGuard:
    """Ends this process with one typed line when it resumes after being frozen too long.

    A process stopped (SIGSTOP, a debugger, a paused VM) for longer than the heartbeat timeout
    is declared lost by the coordination service; when it continues, XLA's heartbeat thread
    learns it on its next heartbeat (about a second later) and aborts the process with a C++
    ``Check failure stack trace`` (SIGABRT): jaxlib 0.10 offers no callback that could turn it
    into an exception (see the module docstring). This guard's daemon thread wakes every
    ``tick`` seconds; a wake-up that comes ``heartbeat_timeout`` seconds or more after the
    previous one while the process used little CPU time meanwhile (a thread holding the GIL
    that long would have used it) means the whole process was stopped. Stopped for less than
    twice the timeout, it asks the service (for at most 0.25 s) whether this task still
    counts alive, and carries on if so; otherwise it writes one line,
    ``jaxdist.ProcessFrozenError: ...``, to stderr and ends the process with
    status 1 before the heartbeat thread aborts it. A wait whose deadline passed while the
    process was stopped returns as soon as it continues, so the guard wakes first.

    With a ``link`` (``LinkGuard``), each wake-up also checks that the coordination service
    still answers: out of reach for half the heartbeat timeout (a cut link, a lost host), the
    guard ends the process with one line, ``jaxdist.PeerLostError: <task>: lost the
    coordination service (<task> at <address>) ...``, and status 1, before XLA's heartbeat
    thread would abort it.

    Example:
        >>> from jaxdist._src.distributed.runtime import FreezeGuard
        >>> client = None   # the coordination service's client, in a multi-process job
        >>> guard = FreezeGuard("worker:1", 1, 2, heartbeat_timeout=10, client=client)
        >>> guard = guard.start()
        >>> guard.stop()      # at an orderly shutdown
    """

    def __init__(self, name: str, process_id: int, num_processes: int,
                 heartbeat_timeout: float, client: Any, tick: float = 0.25,
                 exit: Callable[[str, int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], float] = time.process_time,
                 link: LinkGuard | None = None):
        self.link = link
        self.name, self.process_id, self.num_processes = name, process_id, num_processes
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.client, self.tick = client, tick
        self._exit = exit or _exit_with_line
        self._clock, self._cpu_clock = clock, cpu_clock
        self._last, self._last_cpu = clock(), cpu_clock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxdist-freeze-guard",
                                        daemon=True)

    def start(self) -> FreezeGuard:
        """Starts the guard's daemon thread (and the link guard's); returns the guard."""
        if self.link is not None:
            self.link.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        """The guard does nothing more (an orderly shutdown)."""
        self._stop.set()
        if self.link is not None:
            self.link.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.tick):
            if self.check():
                return

    def check(self) -> bool:
        """One wake-up: measures the time since the previous one; returns True if it ended
        the process (``exit`` was called)."""
        now, cpu = self._clock(), self._cpu_clock()
        gap, used = now - self._last, cpu - self._last_cpu
        self._last, self._last_cpu = now, cpu
        if self._stop.is_set():
            return False
        if gap >= self.heartbeat_timeout and self._frozen(gap, used):
            return True
        if gap > 4 * self.tick and self.link is not None:
            # This thread was late (stopped, starved or behind a GIL holder): so may the
            # link guard's questions have been; count their silence from now on.
            self.link.restart_window(now)
            return False
        if self.link is not None and self.link.lost(now):
            self._exit(self.link.message(now), 1)
            return True
        if self.link is not None and self.link.silent_peers(now):
            self._exit(self.link.peer_message(now), 1)
            return True
        return False

    def _frozen(self, gap: float, used: float) -> bool:
        """After a wake-up ``gap`` s late with ``used`` s of CPU time meanwhile: ends the
        process if it was stopped and the service declared it lost; returns True if so."""
        # A thread holding the GIL that long would have burnt CPU time: the process was
        # stopped only if it used little.
        if used > 0.5 * gap:
            return False
        # Stopped for twice the timeout: certainly declared lost. Just past it: the service
        # may not have noticed yet (it does not answer a lost task's question at all).
        if gap < 2 * self.heartbeat_timeout and self._alive():
            log.warning("%s was stopped for %.1f s; the coordination service still counts it "
                        "alive", self.name, gap)
            return False
        self._exit(
            f"jaxdist.ProcessFrozenError: {self.name}: this process was "
            f"stopped for {gap:.1f} s (SIGSTOP, a debugger or a paused host), longer than "
            f"the {self.heartbeat_timeout:g} s heartbeat timeout: the coordination service "
            f"declared {self.name} lost and the training cluster is broken; exiting. "
            f"Restart the job (it resumes from the last checkpoint)", 1)
        return True

    def _alive(self) -> bool | None:
        """Whether the service still counts this task alive (None: no answer in 0.25 s)."""
        out: dict[str, Any] = {}

        def probe() -> None:
            out["live"] = self.client.get_live_nodes(list(range(self.num_processes)))

        finished, error = call_with_timeout(probe, 0.25, "jaxdist-freeze-probe")
        if not finished or error is not None:
            return None
        return self.process_id in set(out["live"])


def write_line(line: str) -> None:
    """Flushes Python's streams and writes ``line`` to stderr's file descriptor directly (safe
    from any thread, also while the process is about to end).

    Example:
        >>> from jaxdist._src.distributed.runtime import write_line
        >>> write_line("jaxdist: worker:1: stopping")
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


def _exit_with_line(line: str, status: int) -> None:
    """Writes ``line`` (``write_line``) and ends the process at once."""
    write_line(line)
    os._exit(status)


def join_abandoned() -> bool:
    """A registration timed out and is still pending: this process must not exit normally.

    JAX would abort it when the pending registration finally fails (or hang on the client's
    shutdown), so the exit path ends the process with ``os._exit`` instead.
    """
    return _abandoned.is_set()


__all__ = ["FreezeGuard", "JoinTimeout", "join_abandoned", "start_runtime", "write_line"]
