"""``jaxdist._src.distributed.waiting.Watchdog``: acts on sections that overrun, and only on
those."""

import threading
import time

from jaxdist._src.distributed.waiting import Watchdog


def test_an_overrunning_section_is_reported_until_handled():
    dog = Watchdog("test-watchdog")
    calls, handled = [], threading.Event()

    def on_overrun(elapsed):
        calls.append(elapsed)
        if len(calls) == 2:
            handled.set()
            return True
        return False  # keep watching

    with dog.watch(0.1, on_overrun):
        assert handled.wait(5.0)
        time.sleep(0.3)  # handled: no further calls
    assert len(calls) == 2
    assert 0.1 <= calls[0] < calls[1]
    assert calls[1] >= 0.2


def test_sections_that_finish_in_time_are_never_reported():
    dog = Watchdog("test-watchdog")
    calls = []
    for _ in range(50):
        with dog.watch(0.2, calls.append):
            pass
    time.sleep(0.4)
    assert calls == []
