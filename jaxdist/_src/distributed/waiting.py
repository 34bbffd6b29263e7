"""Bounded waits on calls that may never return (a collective, a registration).

Example:
    >>> from jaxdist._src.distributed.waiting import call_with_timeout
    >>> finished, error = call_with_timeout(lambda: 42, 30.0, "jaxdist-connect")
    >>> finished, error
    (True, None)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def call_with_timeout(fn: Callable[[], object], timeout: float,
                      name: str) -> tuple[bool, BaseException | None]:
    """Runs ``fn()`` on a daemon thread named ``name`` and waits up to ``timeout`` seconds.

    Returns:
        ``(finished, error)``: whether ``fn`` returned or raised in time, and what it raised.
        An unfinished call keeps running on its daemon thread, which cannot keep the process
        alive.

    Example:
        >>> from jaxdist._src.distributed.waiting import call_with_timeout
        >>> call_with_timeout(lambda: None, 1.0, "jaxdist-example")
        (True, None)
    """
    done = threading.Event()
    result: dict[str, BaseException] = {}

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            result["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    if not done.wait(timeout):
        return False, None
    return True, result.get("error")


class Watchdog:
    """Calls ``on_overrun`` from a daemon thread when a watched section runs past its deadline.

    For calls that block inside C++ and cannot be interrupted: a collective on a frozen peer
    blocks the dispatching thread itself (XLA's CPU client runs small computations inline), so
    no bounded wait in that thread can ever run. ``on_overrun(elapsed)`` runs while the section
    is still in progress; it returns True when it dealt with it (typically by ending the
    process with a typed error) or False to keep watching for another period.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxdist._src.distributed.waiting import Watchdog
        >>> dog = Watchdog("jaxdist-step-watchdog")
        >>> with dog.watch(30.0, lambda elapsed: print(f"step stuck for {elapsed:.0f} s")):
        ...     _ = jnp.ones(3).block_until_ready()     # the step; done well within 30 s
    """

    def __init__(self, name: str):
        self._name = name
        self._cond = threading.Condition()
        self._generation = 0
        self._armed: tuple[int, float, float, float, Callable[[float], bool]] | None = None
        self._thread: threading.Thread | None = None
        # When the thread wakes next (inf: idle, waiting for an arm). An arm with a later
        # deadline needs no notify: the thread re-reads the arm when it wakes. One notify per
        # watched section would cost a context switch per training step.
        self._wakes_at = float("inf")

    @contextmanager
    def watch(self, seconds: float, on_overrun: Callable[[float], bool]) -> Iterator[None]:
        """Watches the body of the ``with`` block for ``seconds`` at a time."""
        now = time.monotonic()
        with self._cond:
            self._generation += 1
            self._armed = (self._generation, now, now + seconds, seconds, on_overrun)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            if now + seconds < self._wakes_at:
                self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._armed = None

    def _run(self) -> None:
        while True:
            with self._cond:
                armed = self._armed
                if armed is None:
                    self._wakes_at = float("inf")
                    self._cond.wait()
                    continue
                generation, start, deadline, seconds, on_overrun = armed
                left = deadline - time.monotonic()
                if left > 0:
                    self._wakes_at = deadline
                    self._cond.wait(left)
                    continue
            handled = on_overrun(time.monotonic() - start)
            with self._cond:
                if self._armed is not None and self._armed[0] == generation:
                    self._armed = None if handled else (
                        generation, start, time.monotonic() + seconds, seconds, on_overrun)


__all__ = ["Watchdog", "call_with_timeout"]
