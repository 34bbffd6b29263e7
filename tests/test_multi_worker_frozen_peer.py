"""Real processes: a frozen (SIGSTOP) peer in sync training is a typed error on every other
process within the configured timeout: no hang, no abort with a C++ stack trace. The frozen
process, once continued (SIGCONT), exits with one typed line too (``ProcessFrozenError``; its
guard's decisions are unit-tested in tests/test_frozen_peer_exit.py): the same cluster checks
both sides."""

import signal
import time

import pytest

from jaxdist.testing import LocalCluster, python_command

pytestmark = pytest.mark.slow

TIMEOUT = 6


@pytest.mark.timeout(120)
@pytest.mark.parametrize("frozen", ["worker:1", "worker:0"])
def test_a_frozen_peer_is_a_typed_error_naming_it_on_the_other_process(frozen):
    survivor = "worker:0" if frozen == "worker:1" else "worker:1"
    with LocalCluster(workers=2, devices_per_process=1) as c:
        c.start(python_command("jaxdist.testing.workloads", "linreg", "--steps", "100000",
                               "--sleep", "0.05", "--timeout", str(TIMEOUT)))
        c.wait_for_output(survivor, r"^step 3 ", 60)
        c.wait_for_output(frozen, r"^step 3 ", 60)
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
    assert code == 1, out  # not 134 (an abort) and not a hang
    assert (f"jaxdist.PeerLostError: {survivor}: lost peer task(s) {frozen}"
            in out), out
    for abort in ("detected fatal errors", "Check failed", "terminate called", "*** "):
        assert abort not in out, out
    # A lost peer is named within about two timeouts (the step's wait, then the heartbeat).
    assert detected <= 3 * TIMEOUT + 5, f"took {detected:.1f}s"
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
