"""A process cut off from the coordination service exits with one typed line before XLA's
heartbeat thread aborts it (issue 33, point 5). The guard's decisions are unit-tested here with
a fake clock and client; the real cut link (``ip link set eth0 down`` in a network namespace)
runs in tests/test_netns_cluster.py. CPU only; no accelerator needed."""

import threading

from jaxdist._src.distributed.link_guard import LinkGuard
from jaxdist._src.distributed.runtime import FreezeGuard


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

    def key_value_set(self, key, value, allow_overwrite=False):
        self._answer()
        self.store[key] = value

    def key_value_dir_get(self, prefix):
        self._answer()
        return [(k, v) for k, v in sorted(self.store.items()) if k.startswith(prefix)]

    def _answer(self):
        if self.mode == "fail":
            raise RuntimeError("UNAVAILABLE: failed to connect to all addresses\nmore")
        if self.mode == "hang":
            self.release.wait(5)
            raise RuntimeError("DEADLINE_EXCEEDED")


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


def _beat(client, q, value):
    client.store[f"jaxdist/link_guard/{q}"] = str(value)


def test_a_silent_peer_is_one_typed_line_while_the_service_answers():
    clock, client = _Clock(), _Client()
    link, guard, exits = _guards(clock, client)      # hb 4 s: a peer silent 5 s is lost
    for t in range(8):
        _beat(client, 0, t)
        _beat(client, 1, t)
        link.ask()
        assert not _tick(clock, guard, 0.5)
    for t in range(8, 30):                           # worker:1 stops beating
        _beat(client, 0, t)
        link.ask()
        if _tick(clock, guard, 0.25):
            break
    (line, status), = exits
    assert status == 1 and "\n" not in line
    assert line.startswith("jaxdist.PeerLostError: worker:2: lost peer task(s) worker:1: no "
                           "heartbeat for 5.0 s (heartbeat timeout 4 s) while the coordination "
                           "service (worker:0 at 10.213.0.1:23001) answers this task"), line


def test_a_peer_that_left_in_order_or_this_tasks_own_silence_is_not_a_lost_peer():
    clock, client = _Clock(), _Client()
    link, guard, exits = _guards(clock, client)
    _beat(client, 0, 1)
    _beat(client, 1, 1)
    link.ask()
    client.store["jaxdist/link_guard/1"] = "left"    # worker:1 shut down in order
    for t in range(2, 40):
        _beat(client, 0, t)
        link.ask()
        assert not _tick(clock, guard, 0.25), exits
    # this task's own questions go unanswered: the service's silence, not worker:0's
    client.mode = "hang"
    asking = threading.Thread(target=link.ask, daemon=True)
    asking.start()
    try:
        assert not _tick(clock, guard, 1.75) and exits == []
    finally:
        client.release.set()
        asking.join(5)
    assert link.silent_peers(clock.now) == []


def test_stop_marks_this_task_left():
    clock, client = _Clock(), _Client()
    link, _, _ = _guards(clock, client)
    link.ask()
    link.stop()
    assert client.store["jaxdist/link_guard/2"] == "left"

