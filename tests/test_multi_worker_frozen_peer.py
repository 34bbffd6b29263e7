"""Real processes: a frozen (SIGSTOP) peer in sync training is a typed error on every other
process within the configured timeout: no hang, no abort with a C++ stack trace. The frozen
process, once continued (SIGCONT), exits with one typed line too (``ProcessFrozenError``; its
guard's decisions are unit-tested in tests/test_frozen_peer_exit.py): the same cluster checks
both sides."""

import concurrent.futures
import signal
import threading
import time

import pytest
from devutil import PRECISE

from jaxdist.testing import LocalCluster, python_command

pytestmark = pytest.mark.slow

TIMEOUT = 6
FROZEN = ["worker:1", "worker:0"]


def _freeze(frozen: str, training: threading.Event) -> dict:
    """One cluster of 2 processes training; ``frozen`` is stopped at step 3 and continued once
    the other process has exited. Returns what both sides printed and how they exited;
    ``training`` is set once both train (or this failed)."""
    survivor = "worker:0" if frozen == "worker:1" else "worker:1"
    with LocalCluster(workers=2, devices_per_process=1) as c:
        try:
            c.start(python_command("jaxdist.testing.workloads", "linreg", "--steps", "100000",
                                   "--sleep", "0.05", "--timeout", str(TIMEOUT)))
            c.wait_for_output(survivor, r"^step 3 ", 60)
            c.wait_for_output(frozen, r"^step 3 ", 60)
        finally:
            training.set()
        c.kill(frozen, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            code = c.wait(survivor, 3 * TIMEOUT + 30)
            detected = time.monotonic() - frozen_at
            out = c.output(survivor)
        finally:
            c.kill(frozen, signal.SIGCONT)
        # The frozen side (one task is enough: its guard does not depend on the task's index).
        frozen_code = c.wait(frozen, 30) if frozen == "worker:1" else None
        frozen_out = c.output(frozen)
        c.kill(frozen)
    return {"survivor": survivor, "code": code, "detected": detected, "out": out,
            "frozen_code": frozen_code, "frozen_out": frozen_out}


@pytest.fixture(scope="module")
def frozen_runs():
    """Both cases, each on its own cluster: the second cluster starts once the first trains, so
    its start-up overlaps the first one's wait for the frozen peer's timeout (the start-ups do
    not overlap: each process must join its cluster within TIMEOUT)."""
    futures = {}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for f in FROZEN:
            training = threading.Event()
            futures[f] = pool.submit(_freeze, f, training)
            training.wait(130)
        concurrent.futures.wait(futures.values(), timeout=200)
    return futures  # each test takes its own case's result (or error)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("precise", PRECISE)
@pytest.mark.parametrize("frozen", FROZEN)
def test_a_frozen_peer_is_a_typed_error_naming_it_on_the_other_process(frozen, frozen_runs,
                                                                       precise):
    run = frozen_runs[frozen].result(timeout=0)
    survivor, code, detected, out = run["survivor"], run["code"], run["detected"], run["out"]
    frozen_code, frozen_out = run["frozen_code"], run["frozen_out"]
    assert code == 1, out  # not 134 (an abort) and not a hang
    assert (f"jaxdist.PeerLostError: {survivor}: lost peer task(s) {frozen}"
            in out), out
    for abort in ("detected fatal errors", "Check failed", "terminate called", "*** "):
        assert abort not in out, out
    # A lost peer is named within about two timeouts (the step's wait, then the heartbeat): a
    # wall-clock claim, held in the `timing` case (both cases read the same run).
    assert not precise or detected <= 3 * TIMEOUT + 5, f"took {detected:.1f}s"
    if frozen_code is not None:
        assert frozen_code == 1, frozen_out  # not -6 (SIGABRT)
        lines = [ln for ln in frozen_out.splitlines() if "ProcessFrozenError" in ln]
        assert len(lines) == 1, frozen_out
        assert lines[0].startswith(f"jaxdist.ProcessFrozenError: {frozen}: "
                                   f"this process was stopped for "), frozen_out
        assert f"the coordination service declared {frozen} lost" in lines[0]
        for abort in ("Check failure", "detected fatal errors", "terminate called", "*** ",
                      "Traceback"):
            assert abort not in frozen_out, frozen_out
