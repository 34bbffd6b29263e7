"""The preemption watcher: SIGTERM and watcher-function notices, the agreement on one step, the
grace period, a second SIGTERM (``jaxdist._src.distributed.preemption``).

The agreement runs here between simulated processes in threads that share an in-memory
key-value store with the coordination service's semantics (first writer wins, blocking reads
with a timeout), stepping in lockstep within a bounded skew as synchronous training does; the
real multi-process path is in tests/test_preemption_jobs.py.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from devutil import PRECISE

from jaxdist._src.distributed import preemption
from jaxdist._src.distributed.preemption import PreemptionError, PreemptionWatcher, _Peers
from jaxdist._src.distributed.termination import (
    TerminationConfig,
    TerminationConfigError,
    check_exit_code,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _no_installed_watcher():
    yield
    preemption.uninstall()


class FakeStore:
    """The coordination service's key-value calls jaxdist uses, in memory."""

    def __init__(self):
        self.values: dict[str, str] = {}
        self.cond = threading.Condition()

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        with self.cond:
            if key in self.values and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            self.values[key] = value
            self.cond.notify_all()

    def key_value_try_get(self, key: str) -> str:
        with self.cond:
            if key not in self.values:
                raise RuntimeError(f"NOT_FOUND: {key}")
            return self.values[key]

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.values, timeout_in_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.values[key]


def _watchers(n: int, store: FakeStore, grace: float = 10.0, exits=None,
              running: int | None = None):
    """The watchers of ``n`` processes; with ``running``, only the first ``running`` exist (the
    others are silent: killed or frozen processes say nothing)."""
    names = [f"worker:{i}" for i in range(n)]
    out = []
    for i in range(n if running is None else running):
        out.append(PreemptionWatcher(
            TerminationConfig(grace_period=grace, exit_fn=lambda: None),
            peers=lambda i=i: _Peers(store, i, n, names),
            task=lambda i=i: (names[i], i == 0),
            hard_exit=(exits.append if exits is not None else None) or (lambda code: None)))
    return out


# ---------------------------------------------------------------------- TerminationConfig
@pytest.mark.parametrize("code", [0, 2, 3, 128, 255, -1, "42", 4.2, True, None])
def test_exit_codes_that_do_not_mean_restart_are_refused(code):
    with pytest.raises(TerminationConfigError, match="exit_code"):
        TerminationConfig(exit_code=code)


@pytest.mark.parametrize("seconds", [0, -1, float("nan"), float("inf"), "30", True])
def test_grace_periods_that_cannot_work_are_refused(seconds):
    with pytest.raises(TerminationConfigError, match="grace_period"):
        TerminationConfig(grace_period=seconds)


def test_functions_must_be_callable_and_defaults_are_tfs():
    with pytest.raises(TerminationConfigError, match="exit_fn"):
        TerminationConfig(exit_fn=42)
    config = TerminationConfig()
    assert (config.exit_code, config.grace_period) == (42, 30.0)
    assert check_exit_code(1) == 1
    with pytest.raises(SystemExit) as e:
        config.exit()
    assert e.value.code == 42


# ---------------------------------------------------------------------- one process
def test_one_process_stops_at_its_next_step():
    w = PreemptionWatcher(TerminationConfig(grace_period=10), hard_exit=lambda c: None)
    try:
        assert not any(w.should_stop(s, 2) for s in (0, 2, 4))
        w.notice("a test")
        assert w.wait_for_agreement(5.0) == 6
        assert w.should_stop(6, 2)
        assert w.agreed_step == 6 and w.notice_from == "this process"
    finally:
        w.close()


def test_a_notice_during_a_step_stops_before_the_next(tmp_path):
    w = PreemptionWatcher(TerminationConfig(grace_period=10), hard_exit=lambda c: None)
    try:
        assert not w.should_stop(0)       # step 0 "runs" while the notice arrives
        w.notice()
        time.sleep(3 * preemption.POLL_SECONDS)
        assert w.should_stop(1)           # nothing beyond the step in flight
    finally:
        w.close()


def test_the_watcher_function_is_a_notice():
    flag = threading.Event()
    w = PreemptionWatcher(TerminationConfig(termination_watcher_fn=flag.is_set,
                                            grace_period=10), hard_exit=lambda c: None)
    try:
        w.should_stop(0)
        assert w.agreed_step is None
        flag.set()
        assert w.wait_for_agreement(5.0) == 1
        assert w.reason == "the termination watcher"
    finally:
        w.close()


def test_finish_saves_then_exits_with_the_configured_function():
    calls = []
    w = PreemptionWatcher(TerminationConfig(grace_period=10, exit_fn=lambda: calls.append("exit")),
                          hard_exit=lambda c: calls.append(("hard", c)))
    try:
        w.notice()
        step = w.wait_for_agreement(5.0)
        assert w.should_stop(step)
        w.finish(step, lambda: calls.append("save"), is_chief=True)
        assert calls == ["save", "exit"]
    finally:
        w.close()


def test_the_grace_period_running_out_exits_at_once():
    exits = []
    w = PreemptionWatcher(TerminationConfig(grace_period=0.5), hard_exit=exits.append)
    try:
        w.notice()
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
        assert exits == [42]
    finally:
        w.close()


# ---------------------------------------------------------------------- the agreement
def _simulate(n: int, seed: int, k: int = 2, per_step: float = 0.002):
    """``n`` simulated processes step in lockstep (none more than ``k`` steps ahead of the
    slowest, as the steps in flight allow); one gets a notice at a random moment."""
    rng = random.Random(seed)
    store = FakeStore()
    watchers = _watchers(n, store)
    started = [0] * n        # steps started (= next step)
    stopped_at: list[int | None] = [None] * n
    lock = threading.Condition()
    errors = []

    def proc(i: int) -> None:
        try:
            step = 0
            while step < 10_000:
                with lock:  # a step needs every process to have started it - k
                    lock.wait_for(lambda s=step: s - min(started) < k or stopped_at[i] is not None,
                                  timeout=10)
                if watchers[i].should_stop(step):
                    with lock:
                        stopped_at[i] = step
                        lock.notify_all()
                    return
                with lock:
                    started[i] = step + 1
                    lock.notify_all()
                time.sleep(per_step * rng.random())
                step += 1
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=proc, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    time.sleep(0.05 + 0.1 * rng.random())
    victim = rng.randrange(n)
    watchers[victim].notice("SIGTERM")
    for t in threads:
        t.join(30)
    for w in watchers:
        w.close()
    assert not errors, errors
    return stopped_at, started, watchers, victim


@pytest.mark.parametrize("seed", range(6))
def test_every_process_stops_at_the_same_step_none_has_started(seed):
    stopped_at, started, watchers, victim = _simulate(3, seed)
    assert len(set(stopped_at)) == 1, stopped_at
    agreed = stopped_at[0]
    assert started == [agreed] * 3          # every step below it ran, none at or above it
    assert all(w.agreed_step == agreed for w in watchers)
    assert all(w.notice_from == f"worker:{victim}" for w in watchers)
    assert all(w.reason == "SIGTERM" for w in watchers)


@pytest.mark.parametrize("precise", PRECISE)
def test_a_silent_peer_is_a_typed_error_within_the_grace_period(precise):
    store = FakeStore()
    a, = _watchers(2, store, grace=1.0, running=1)   # worker:1 never promises
    try:
        a.should_stop(0)
        a.notice()
        time.sleep(3 * preemption.POLL_SECONDS)   # the listener promised step 1
        t0 = time.monotonic()
        with pytest.raises(PreemptionError, match="worker:1 did not say where it stops"):
            a.should_stop(1)
        assert not precise or time.monotonic() - t0 < 3.0  # grace 1 s (a wall-clock claim)
    finally:
        a.close()


def test_close_ends_a_listener_that_waits_on_a_silent_peer():
    # A process whose training ends while its listener waits for a peer's promise: the
    # listener must not be left inside the coordination service's client (a thread blocked in
    # there when the interpreter exits aborts the process with "FATAL: exception not
    # rethrown"): close() ends the wait, the thread is gone and no error is recorded.
    store = FakeStore()
    a, = _watchers(2, store, grace=60.0, running=1)  # worker:1 never promises
    try:
        a.notice()
        deadline = time.monotonic() + 10
        while store.values.get("jaxdist/preemption/promise/0") is None:
            assert time.monotonic() < deadline, "worker:0's listener never promised"
            time.sleep(preemption.POLL_SECONDS)
        time.sleep(2 * preemption.WAIT_PIECE_SECONDS)   # now waiting for worker:1's promise
        assert a._thread.is_alive()
    finally:
        a.close()
    assert not a._thread.is_alive()
    assert a._error is None


def test_a_notice_after_a_peer_finished_agrees_on_the_end_of_its_training():
    # TF's corner case: the notice reaches worker:0 at step 28 after worker:1 ran its last
    # step (29) and left. Leaving, worker:1 promised its end (30): worker:0 agrees on 30 at
    # once and runs its last two steps, instead of waiting out the grace period and exiting
    # without a checkpoint.
    store = FakeStore()
    a, b = _watchers(2, store, grace=30.0)
    try:
        assert not any(b.should_stop(step) for step in range(30))
        assert not any(a.should_stop(step) for step in range(28))
        b.close()                   # worker:1's training ended: its exit hook closes it
        a.notice()
        assert a.wait_for_agreement(10.0) == 30
        assert not a.should_stop(28) and not a.should_stop(29)
        assert a.should_stop(30)
    finally:
        a.close()
        b.close()


def test_the_chief_saves_and_the_others_wait_for_it():
    store = FakeStore()
    chief, other = _watchers(2, store)
    events = []
    try:
        other.notice()
        for w in (chief, other):
            w.wait_for_agreement(5.0)
        t = threading.Thread(target=other.finish, args=(0, lambda: events.append("no")),
                             kwargs={"is_chief": False})
        t.start()
        time.sleep(0.3)
        assert t.is_alive()         # waiting for the chief's checkpoint
        chief.finish(0, lambda: events.append("chief saved"), is_chief=True)
        t.join(5)
        assert not t.is_alive() and events == ["chief saved"]
        assert store.values["jaxdist/preemption/saved"] == "0"
    finally:
        chief.close()
        other.close()


# ---------------------------------------------------------------------- real signals
_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from jaxdist._src.distributed import preemption
    from jaxdist._src.distributed.termination import TerminationConfig
    mode = sys.argv[1]
    w = preemption.install(TerminationConfig(grace_period=float(sys.argv[2])))
    print("ready", flush=True)
    if mode == "idle":            # no loop answers notices: SIGTERM ends the process
        time.sleep(30)
    with w.consume():
        step = 0
        while True:
            if mode == "hang" and w.reason is not None:
                time.sleep(30)    # a step that never ends: the grace period must end it
            if w.should_stop(step):
                break
            step += 1
            time.sleep(0.01)
        print("stopped at", step, flush=True)
        if mode == "slow_save":   # a second SIGTERM arrives while saving
            w.finish(step, lambda: time.sleep(30))
        w.finish(step, lambda: print("saved", step, flush=True))
""")


def _child(mode: str, grace: float = 10.0) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _CHILD, mode, str(grace)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


@pytest.mark.platform("cpu")
def test_sigterm_in_a_loop_saves_and_exits_42():
    p = _child("loop")
    time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 42, err
    step = int(out.split("stopped at")[1].split()[0])
    assert f"saved {step}" in out
    assert f"stopped before step {step}: the checkpoint of step {step} is written; " \
           f"exiting with 42" in err
    assert "Traceback" not in err


@pytest.mark.platform("cpu")
def test_sigterm_with_no_loop_ends_the_process_as_by_default():
    p = _child("idle")
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=30)
    assert p.returncode == -signal.SIGTERM


@pytest.mark.platform("cpu")
@pytest.mark.parametrize("precise", PRECISE)
def test_a_second_sigterm_exits_at_once_with_one_line(precise):
    p = _child("slow_save")
    time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 20
    line = ""
    while "stopped at" not in line and time.monotonic() < deadline:
        line = p.stdout.readline()
    time.sleep(0.2)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 42
    assert not precise or time.monotonic() - t0 < 5  # before the save ends (wall clock)
    assert "a second SIGTERM: exiting with 42 at once" in err
    assert "Traceback" not in err


@pytest.mark.platform("cpu")
@pytest.mark.parametrize("precise", PRECISE)
def test_a_hung_step_ends_when_the_grace_period_runs_out(precise):
    p = _child("hang", grace=2.0)
    time.sleep(0.2)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 42
    assert not precise or time.monotonic() - t0 < 6  # grace 2 s (a wall-clock claim)
    assert "the 2 s grace period ran out: exiting with 42 at once" in err


def test_install_only_swaps_the_config_before_a_notice():
    w = preemption.install(TerminationConfig(grace_period=5))
    assert signal.getsignal(signal.SIGTERM) == w.on_sigterm
    w2 = preemption.install(TerminationConfig(grace_period=7))
    assert w2 is w and w.config.grace_period == 7
    preemption.uninstall()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert preemption.installed() is None
    assert os.getpid() > 0


# ---------------------------------------------------------------------- the CLI's settings
@pytest.mark.parametrize("setting,words", [
    ("preemption.exit_code=2", "preemption.exit_code=2 is not a restart code"),
    ("preemption.exit_code=300", "preemption.exit_code=300 is not a restart code"),
    ("preemption.grace_period=0", "preemption.grace_period: 0"),
])
def test_bad_preemption_settings_name_the_value(setting, words, capsys):
    from jaxdist._src.job.cli import main

    code = main(["--config", os.path.join(ROOT, "configs", "default.yaml"), "--set", setting,
                 "--print-config"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and words in err, err


def test_a_grace_period_shorter_than_a_step_stops_before_training(tmp_path, capsys):
    from jaxdist._src.job.cli import main

    code = main(["--config", os.path.join(ROOT, "configs", "default.yaml"),
                 "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--set", "logging.dir=null",
                 "--set", "logging.progress_bar=never", "--set", "train.epochs=1",
                 "--set", "preemption.grace_period=0.000001"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "preemption grace period 1e-06 s is shorter than one step" in err[0]
