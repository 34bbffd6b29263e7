"""A frozen sync peer that continues exits cleanly (issue 27, point 4): one typed line,
``jaxdist.ProcessFrozenError``, and status 1, never XLA's C++ ``Check failure
stack trace`` (SIGABRT). The guard's decisions are unit-tested with a fake clock; the real
SIGSTOP / SIGCONT runs in tests/test_multi_worker_frozen_peer.py. CPU only; no accelerator
needed."""

import time

from jaxdist._src.cluster.errors import PeerLostError, ProcessFrozenError
from jaxdist._src.distributed.runtime import FreezeGuard


class _Clock:
    def __init__(self):
        self.now, self.cpu = 1000.0, 5.0

    def advance(self, seconds, cpu=0.0):
        self.now += seconds
        self.cpu += cpu


class _Client:
    def __init__(self, live, delay=0.0):
        self.live, self.delay, self.calls = live, delay, 0

    def get_live_nodes(self, ids):
        self.calls += 1
        time.sleep(self.delay)
        return self.live


def _guard(clock, client, hb=3.0):
    """A guard on a fake clock whose thread is never started: the test calls ``check``."""
    exits = []
    guard = FreezeGuard("worker:1", 1, 2, hb, client,
                        exit=lambda line, status: exits.append((line, status)),
                        clock=lambda: clock.now, cpu_clock=lambda: clock.cpu)
    return guard, exits


def test_a_stop_past_twice_the_heartbeat_timeout_exits_with_one_typed_line():
    clock = _Clock()
    guard, exits = _guard(clock, _Client(live=[0, 1]))
    clock.advance(13.0, cpu=0.01)
    assert guard.check() is True
    (line, status), = exits
    assert status == 1 and "\n" not in line
    assert line.startswith("jaxdist.ProcessFrozenError: worker:1: this process "
                           "was stopped for 13.0 s")
    assert "longer than the 3 s heartbeat timeout" in line and "declared worker:1 lost" in line
    assert issubclass(ProcessFrozenError, PeerLostError)


def test_just_past_the_timeout_the_service_decides():
    clock = _Clock()
    alive = _Client(live=[0, 1])
    guard, exits = _guard(clock, alive)
    clock.advance(4.0)
    assert guard.check() is False and exits == [] and alive.calls == 1  # still counted alive
    lost = _Client(live=[0])
    guard, exits = _guard(clock, lost)
    clock.advance(4.0)
    assert guard.check() is True and len(exits) == 1
    silent = _Client(live=[0, 1], delay=2.0)  # a lost task's question is never answered
    guard, exits = _guard(clock, silent)
    clock.advance(4.0)
    assert guard.check() is True and len(exits) == 1


def test_short_stops_busy_gil_holders_and_a_stopped_guard_do_not_exit():
    clock = _Clock()
    client = _Client(live=[0])
    guard, exits = _guard(clock, client)
    clock.advance(2.9)  # shorter than the heartbeat timeout
    assert guard.check() is False
    clock.advance(30.0, cpu=29.0)  # a thread held the GIL, burning CPU: not stopped
    assert guard.check() is False
    guard.stop()
    clock.advance(30.0)
    assert guard.check() is False
    assert exits == [] and client.calls == 0


# The real SIGSTOP / SIGCONT of a task in a 2-process cluster runs in
# tests/test_multi_worker_frozen_peer.py, which checks the survivor's side and the frozen
# side (one typed line, exit status 1) on the same cluster.
