"""Real processes: a frozen (SIGSTOP) peer in sync training is a typed error on every other
process within the configured timeout: no hang, no abort with a C++ stack trace."""

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
            c.kill(frozen)
    assert code == 1, out  # not 134 (an abort) and not a hang
    assert (f"jaxdist.PeerLostError: {survivor}: lost peer task(s) {frozen}"
            in out), out
    for abort in ("detected fatal errors", "Check failed", "terminate called", "*** "):
        assert abort not in out, out
    # A lost peer is named within about two timeouts (the step's wait, then the heartbeat).
    assert detected <= 3 * TIMEOUT + 5, f"took {detected:.1f}s"
