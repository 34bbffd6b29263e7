"""A process cut off from the coordination service exits with one typed line before XLA's
heartbeat thread aborts it (issue 33, point 5). The guard's decisions are unit-tested here with
a fake clock and client; the real cut link (``ip link set eth0 down`` in a network namespace)
runs in tests/test_netns_cluster.py. CPU only; no accelerator needed."""

import threading

from jaxdist._src.cluster.link_guard import LinkGuard
from jaxdist._src.cluster.runtime import FreezeGuard


class _Clock:
    def __init__(self):
        self.now, self.cpu = 1000.0, 5.0

    def advance(self, seconds, cpu=0.0):
        self.now += seconds
        self.cpu += cpu


class _Client:
    """A coordination client whose service answers, fails, or never answers (blocks)."""

    def __init__(self):
        self.mode, self.store = "answer", {}
        self.release = threading.Event()

    def key_value_set(self, key, value):
        self.store[key] = value

    def key_value_try_get(self, key):
        if self.mode == "fail":
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses\nmore")
        if self.mode == "hang":
            self.release.wait(5)
            raise RuntimeError("DEADLINE_EXCEEDED")
        return self.store[key]


def _guards(clock, client, hb=4.0):
    exits = []
    link = LinkGuard("worker:2", 2, ["worker:0", "worker:1"], "worker:0 at 10.213.0.1:23001",
                     hb, client, clock=lambda: clock.now)
    guard = FreezeGuard("worker:2", 2, 3, hb, client, link=link,
                        exit=lambda line, status: exits.append((line, status)),
                        clock=lambda: clock.now, cpu_clock=lambda: clock.cpu)
    return link, guard, exits


def _tick(clock, guard, seconds, step=0.25):
    """Advances the clock by ``seconds`` in guard ticks; returns whether the guard exited."""
    for _ in range(round(seconds / step)):
        clock.advance(step, cpu=0.01)
        if guard.check():
            return True
    return False


def test_a_service_out_of_reach_for_half_the_heartbeat_timeout_is_one_typed_line():
    clock, client = _Clock(), _Client()
    link, guard, exits = _guards(clock, client)
    assert link.ask() and not _tick(clock, guard, 5.0)  # answered questions: nothing
    client.mode = "fail"
    assert link.ask() is False
    assert not _tick(clock, guard, 1.75)  # 1.75 s < 2 s (half the 4 s heartbeat timeout)
    assert _tick(clock, guard, 0.5)
    (line, status), = exits
    assert status == 1 and "\n" not in line
    assert line.startswith("jaxdist.PeerLostError: worker:2: lost the coordination service "
                           "(worker:0 at 10.213.0.1:23001): no answer for 2.0 s (heartbeat "
                           "timeout 4 s); last error: UNAVAILABLE: failed to connect"), line
    assert "cut off from peer task(s) worker:0, worker:1" in line


def test_an_unanswered_question_counts_from_when_it_was_asked():
    clock, client = _Clock(), _Client()
    link, guard, exits = _guards(clock, client)
    client.mode = "hang"
    asking = threading.Thread(target=link.ask, daemon=True)
    asking.start()  # blocks, as a question on a cut link does
    try:
        assert not _tick(clock, guard, 1.75) and exits == []
        assert _tick(clock, guard, 0.5) and len(exits) == 1
        assert "no answer for 2.0 s (heartbeat timeout 4 s); this task is cut off" in exits[0][0]
    finally:
        client.release.set()
        asking.join(5)


def test_an_answer_a_late_guard_or_a_stop_resets_the_silence():
    clock, client = _Clock(), _Client()
    link, guard, exits = _guards(clock, client)
    client.mode = "fail"
    link.ask()
    assert not _tick(clock, guard, 1.5)
    client.mode = "answer"
    assert link.ask() and not _tick(clock, guard, 3.0)  # answered again: silence over
    client.mode = "fail"
    link.ask()
    clock.advance(1.5, cpu=1.4)  # this thread was late (a GIL holder): restart the window
    assert guard.check() is False
    assert not _tick(clock, guard, 1.75)
    guard.stop()
    assert not _tick(clock, guard, 10.0)
    assert exits == []


def test_a_frozen_process_is_reported_frozen_not_cut_off():
    clock, client = _Clock(), _Client()
    link, guard, exits = _guards(clock, client)
    client.mode = "fail"
    link.ask()
    clock.advance(9.0, cpu=0.01)  # stopped for over twice the heartbeat timeout
    assert guard.check() is True
    assert exits[0][0].startswith("jaxdist.ProcessFrozenError: worker:2: this process was "
                                  "stopped for 9.0 s")
