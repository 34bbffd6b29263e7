"""Bounded waits on calls that may never return (a collective, a registration).

Example:
    >>> finished, error = call_with_timeout(client.connect, 30.0, "jaxdist-connect")
"""

from __future__ import annotations

import threading
from collections.abc import Callable


def call_with_timeout(fn: Callable[[], object], timeout: float,
                      name: str) -> tuple[bool, BaseException | None]:
    """Runs ``fn()`` on a daemon thread named ``name`` and waits up to ``timeout`` seconds.

    Returns:
        ``(finished, error)``: whether ``fn`` returned or raised in time, and what it raised.
        An unfinished call keeps running on its daemon thread, which cannot keep the process
        alive.

    Example:
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


__all__ = ["call_with_timeout"]
