"""Notices that this process lost the coordination service (a cut link, a lost host) in time
to exit with one typed line before XLA's heartbeat thread aborts it.

XLA's coordination client sends a heartbeat every ``heartbeat_timeout / 2`` seconds, each an
RPC with that deadline; when one fails it waits one second and then calls its
``missed_heartbeat_callback``, whose default aborts the process (``LOG(FATAL)``: "Terminating
process because the JAX distributed service detected fatal errors", a C++ stack trace,
SIGABRT), and jaxlib 0.10 offers no callback that works from Python (see
``jaxdist._src.cluster.runtime``). So the earliest such abort comes ``heartbeat_timeout / 2 +
1`` seconds after the link went down.

``LinkGuard`` asks the service a cheap question (a key-value lookup of this task's own key)
every ``interval`` seconds on a daemon thread, one question at a time. A question unanswered
(or failing) for ``heartbeat_timeout / 2`` seconds, the deadline XLA's own heartbeat has, means
the service is out of reach: ``FreezeGuard``, which wakes every quarter second, then ends the
process with ``jaxdist.PeerLostError: <task>: lost the coordination service ...`` naming the
task that hosts it and the peers behind the cut. Its decision comes at most ``heartbeat_timeout
/ 2 + interval + tick`` seconds after the cut, before XLA's earliest abort.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

_PROBE_KEY = "jaxdist/link_guard/{}"


class LinkGuard:
    """Asks the coordination service a question every ``interval`` s; says how long it has gone
    unanswered.

    Args:
        name: this task's name (``"worker:2"``).
        process_id: this task's index in the group.
        peers: the other tasks' names, in process order.
        service: the task hosting the coordination service and its address, as
            ``"worker:0 at 10.0.0.1:2222"``.
        heartbeat_timeout: the client's heartbeat timeout in seconds.
        client: the coordination service's client (``key_value_set`` / ``key_value_try_get``).
        interval: seconds between questions.
        clock: the monotonic clock.

    Example:
        >>> class Client:                    # a service that answers
        ...     def key_value_set(self, key, value): self.value = value
        ...     def key_value_try_get(self, key): return self.value
        >>> guard = LinkGuard("worker:1", 1, ["worker:0"], "worker:0 at 10.0.0.1:2222", 4,
        ...                   Client(), interval=0.01).start()
        >>> time.sleep(0.1)
        >>> guard.unanswered_for(time.monotonic()) < 0.1
        True
        >>> guard.stop()
    """

    def __init__(self, name: str, process_id: int, peers: Sequence[str], service: str,
                 heartbeat_timeout: float, client: Any, interval: float = 0.2,
                 clock: Callable[[], float] = time.monotonic):
        self.name, self.process_id, self.peers = name, process_id, tuple(peers)
        self.service, self.client, self.interval = service, client, interval
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.limit = self.heartbeat_timeout / 2  # the deadline of XLA's own heartbeat RPC
        self._clock = clock
        self._key = _PROBE_KEY.format(process_id)
        self._asked: float | None = None  # when the oldest unanswered question was asked
        self._since = clock()  # questions asked before this do not count (see restart_window)
        self._error: BaseException | None = None
        self._set = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxdist-link-guard",
                                        daemon=True)

    def start(self) -> LinkGuard:
        """Starts asking; returns the guard."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops asking (an orderly shutdown)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.ask()
            self._stop.wait(self.interval)

    def ask(self) -> bool:
        """Asks the service once (blocking: on a cut link this may never return); returns
        whether it answered."""
        if self._asked is None:
            self._asked = self._clock()
        try:
            if not self._set:
                self.client.key_value_set(self._key, "1")
                self._set = True
            self.client.key_value_try_get(self._key)
        except Exception as e:  # noqa: BLE001 - the service did not answer; keep the window
            self._error = e
            return False
        self._asked, self._error = None, None
        return True

    def restart_window(self, now: float) -> None:
        """Counts only from ``now`` on (after this process was stopped or starved: the
        questions could not be asked or their answers not read meanwhile)."""
        self._since = now

    def unanswered_for(self, now: float) -> float:
        """Seconds the oldest unanswered question has waited (0 when none waits)."""
        asked = self._asked
        if asked is None or self._stop.is_set():
            return 0.0
        return max(0.0, now - max(asked, self._since))

    def lost(self, now: float) -> bool:
        """Whether the service has been out of reach for the limit (``heartbeat_timeout/2``)."""
        return self.unanswered_for(now) >= self.limit

    def message(self, now: float) -> str:
        """The one line ``FreezeGuard`` ends the process with."""
        error = self._error
        why = f"; last error: {_first_line(error)}" if error is not None else ""
        return (
            f"jaxdist.PeerLostError: {self.name}: lost the coordination service "
            f"({self.service}): no answer for {self.unanswered_for(now):.1f} s (heartbeat "
            f"timeout {self.heartbeat_timeout:g} s){why}; this task is cut off from peer "
            f"task(s) {', '.join(self.peers)} (a lost link or host) and the training cluster "
            f"is broken; exiting. Restart the job (it resumes from the last checkpoint)")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0][:200] if text else type(e).__name__).replace("\n", " ")


__all__ = ["LinkGuard"]
