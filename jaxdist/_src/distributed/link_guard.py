"""Notices that this process lost the coordination service (a cut link, a lost host) in time
to exit with one typed line before XLA's heartbeat thread aborts it.

XLA's coordination client sends a heartbeat every ``heartbeat_timeout / 2`` seconds, each an
RPC with that deadline; when one fails it waits one second and then calls its
``missed_heartbeat_callback``, whose default aborts the process (``LOG(FATAL)``: "Terminating
process because the JAX distributed service detected fatal errors", a C++ stack trace,
SIGABRT), and jaxlib 0.10 offers no callback that works from Python (see
``jaxdist._src.distributed.runtime``). So the earliest such abort comes ``heartbeat_timeout / 2 +
1`` seconds after the link went down.

``LinkGuard`` asks the service a cheap question every ``interval`` seconds on a daemon thread,
one question at a time: it sets this task's own heartbeat key (a counter) and reads every
task's. A question unanswered
(or failing) for ``heartbeat_timeout / 2`` seconds, the deadline XLA's own heartbeat has, means
the service is out of reach: ``FreezeGuard``, which wakes every quarter second, then ends the
process with ``jaxdist.PeerLostError: <task>: lost the coordination service ...`` naming the
task that hosts it and the peers behind the cut. Its decision comes at most ``heartbeat_timeout
/ 2 + interval + tick`` seconds after the cut, before XLA's earliest abort.

The other side of the cut still reaches the service, but its step waits inside XLA for a peer
that is gone. The counters say so without asking the service's liveness view (a barrier among
the live tasks): a peer whose counter has not moved for ``heartbeat_timeout`` + 1 s while this
task's own questions are answered is lost, the rule the service applies to its own
heartbeats. ``FreezeGuard`` then ends the process with ``jaxdist.PeerLostError: <task>: lost
peer task(s) <peer> ...``, well within the step timeout (``CommunicationOptions.timeout_seconds``,
twice the heartbeat timeout). A task that leaves in order (``stop``) marks its key ``left``
first, so a peer still finishing its work never takes it for lost.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

_PROBE_DIR = "jaxdist/link_guard/"
_PROBE_KEY = _PROBE_DIR + "{}"
_LEFT = "left"
#: Seconds past the heartbeat timeout before a silent peer counts as lost.
PEER_MARGIN = 1.0


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
        >>> import time
        >>> from jaxdist._src.distributed.link_guard import LinkGuard
        >>> class Client:                    # a service that answers
        ...     def key_value_set(self, key, value, allow_overwrite=False): self.value = value
        ...     def key_value_dir_get(self, key): return [(key + "1", self.value)]
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
        self._beats = 0
        self._seen: dict[int, tuple[str, float]] = {}  # peer -> (its counter, when it moved)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxdist-link-guard",
                                        daemon=True)

    def start(self) -> LinkGuard:
        """Starts asking; returns the guard."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops asking (an orderly shutdown): marks this task ``left`` for its peers (at most
        one second's wait for the service)."""
        if self._stop.is_set():
            return
        self._stop.set()
        done = threading.Event()

        def leave() -> None:
            try:
                self.client.key_value_set(self._key, _LEFT, allow_overwrite=True)
            except Exception:  # noqa: BLE001 - the service is gone: nobody is watching
                pass
            done.set()

        threading.Thread(target=leave, name="jaxdist-link-guard-leave", daemon=True).start()
        done.wait(1.0)

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
            self._beats += 1
            self.client.key_value_set(self._key, str(self._beats), allow_overwrite=True)
            entries = self.client.key_value_dir_get(_PROBE_DIR)
        except Exception as e:  # noqa: BLE001 - the service did not answer; keep the window
            self._error = e
            return False
        now = self._clock()
        for key, value in entries:
            try:
                q = int(key.rsplit("/", 1)[-1])
            except ValueError:
                continue
            seen = self._seen.get(q)
            if q != self.process_id and (seen is None or seen[0] != value):
                self._seen[q] = (value, now)
        self._asked, self._error = None, None
        return True

    def _peer_name(self, q: int) -> str:
        i = q if q < self.process_id else q - 1
        return self.peers[i] if 0 <= i < len(self.peers) else f"process {q}"

    def silent_peers(self, now: float) -> list[tuple[str, float]]:
        """``(name, seconds)`` of the lost peers: once one peer's heartbeat has not moved for the
        heartbeat timeout + ``PEER_MARGIN`` while this task's own questions are answered, every
        peer silent for half the heartbeat timeout or more."""
        if self._asked is not None or self._stop.is_set():
            return []     # this task's own link waits: that is ``lost``'s to judge
        silence = [(self._peer_name(q), now - max(moved, self._since))
                   for q, (value, moved) in sorted(self._seen.items()) if value != _LEFT]
        if not any(s >= self.heartbeat_timeout + PEER_MARGIN for _, s in silence):
            return []
        # One peer is lost: so is every other one silent for longer than a healthy counter
        # ever is (a cut host's tasks stop together, a few hundredths of a second apart).
        return [(name, s) for name, s in silence if s >= self.limit]

    def peer_message(self, now: float) -> str:
        """The one line ``FreezeGuard`` ends the process with when peers went silent."""
        silent = self.silent_peers(now)
        names = ", ".join(name for name, _ in silent)
        longest = max((s for _, s in silent), default=0.0)
        return (
            f"jaxdist.PeerLostError: {self.name}: lost peer task(s) {names}: no heartbeat for "
            f"{longest:.1f} s (heartbeat timeout {self.heartbeat_timeout:g} s) while the "
            f"coordination service ({self.service}) answers this task (a lost link or host, "
            f"or a dead process); the training cluster is broken; exiting. Restart the job "
            f"(it resumes from the last checkpoint)")

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
