"""``TerminationConfig``: how a platform announces a preemption and how the job answers it
(TF's ``tf.distribute.experimental.TerminationConfig``).

Example:
    >>> from jaxdist import TerminationConfig
    >>> config = TerminationConfig(grace_period=25)
    >>> config.grace_period, config.exit_code
    (25.0, 42)
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

from jaxdist._src.distributed.exit_codes import (
    EXIT_ALREADY_DONE,
    EXIT_CONFIG,
    EXIT_OK,
    RESTART_EXIT_CODE,
)

#: Seconds between the notice (SIGTERM) and the platform's SIGKILL when nothing says otherwise:
#: Kubernetes' default ``terminationGracePeriodSeconds``.
DEFAULT_GRACE_PERIOD = 30.0


class TerminationConfigError(ValueError):
    """A ``TerminationConfig`` (or the CLI's ``preemption`` section) with a value that cannot
    work; ``exit_code`` 2: the settings must change."""

    exit_code = EXIT_CONFIG


def check_exit_code(code: Any, what: str = "exit_code") -> int:
    """``code`` as the exit status a preempted process ends with, or ``TerminationConfigError``.

    It must be an integer in 1..127 that no other outcome uses: not 0 (done), 2 (bad config)
    or 3 (already done); 128 and above mean a death by signal.

    Example:
        >>> from jaxdist._src.distributed.termination import check_exit_code
        >>> check_exit_code(42)
        42
        >>> check_exit_code(0)
        Traceback (most recent call last):
        ...
        jaxdist._src.distributed.termination.TerminationConfigError: exit_code=0 ...
    """
    if isinstance(code, bool) or not isinstance(code, int):
        raise TerminationConfigError(
            f"{what}={code!r}: expected an integer exit status in 1..127 (default "
            f"{RESTART_EXIT_CODE}, the code that tells a scheduler to restart the job)")
    if not 1 <= code <= 127 or code in (EXIT_OK, EXIT_CONFIG, EXIT_ALREADY_DONE):
        raise TerminationConfigError(
            f"{what}={code} is not a restart code: expected 1..127 other than {EXIT_CONFIG} "
            f"(bad config) and {EXIT_ALREADY_DONE} (already done) — 0 means done and 128 and "
            f"above mean killed by a signal; default {RESTART_EXIT_CODE}")
    return code


def check_grace_period(seconds: Any, what: str = "grace_period") -> float:
    """``seconds`` as a grace period, or ``TerminationConfigError`` (a positive number).

    Example:
        >>> from jaxdist._src.distributed.termination import check_grace_period
        >>> check_grace_period(5)
        5.0
    """
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
            or not math.isfinite(seconds) or seconds <= 0:
        raise TerminationConfigError(
            f"{what}={seconds!r}: expected a positive number of seconds between the "
            f"preemption notice (SIGTERM) and the platform's SIGKILL (default "
            f"{DEFAULT_GRACE_PERIOD:g}; Kubernetes' terminationGracePeriodSeconds, 30 s on "
            f"spot VMs)")
    return float(seconds)


class TerminationConfig:
    """How a preemption is announced (SIGTERM, a watcher function) and answered (grace period, exit,
    save function): TF's ``TerminationConfig``.

    Args:
        termination_watcher_fn: ``fn() -> bool``, True once the platform announced this
            process's termination (polled every second on a thread, as TF does); ``None``:
            SIGTERM is the notice. SIGTERM is always a notice too.
        exit_fn: called (in the training loop's thread) after the checkpoint of the agreed
            step is written; default ``sys.exit(exit_code)``.
        grace_period: seconds from the notice until the platform kills the process. The job
            saves at the next step none of its processes has started and exits well before;
            if it has not exited when the grace period runs out (a step or the save hangs), it
            exits at once with ``exit_code`` and one line, without a new checkpoint. Default
            ``DEFAULT_GRACE_PERIOD`` (30 s).
        save_fn: ``fn()`` that saves instead of the handler's own checkpoint (TF's name; the
            chief calls it, the other processes wait for it).
        exit_code: the status of the default ``exit_fn`` (default 42, TF's restart code).

    Raises:
        TerminationConfigError: a grace period that is not a positive number, an exit code that
            is not a restart code, or a watcher / exit / save function that is not callable.

    Example:
        >>> from jaxdist import TerminationConfig
        >>> config = TerminationConfig(termination_watcher_fn=lambda: False, grace_period=60)
        >>> config.grace_period
        60.0
    """

    def __init__(self, termination_watcher_fn: Callable[[], bool] | None = None,
                 exit_fn: Callable[[], Any] | None = None,
                 grace_period: float | None = None,
                 save_fn: Callable[[], Any] | None = None,
                 exit_code: int = RESTART_EXIT_CODE):
        for name, fn in (("termination_watcher_fn", termination_watcher_fn),
                         ("exit_fn", exit_fn), ("save_fn", save_fn)):
            if fn is not None and not callable(fn):
                raise TerminationConfigError(f"{name}={fn!r}: expected a function or None")
        self.termination_watcher_fn = termination_watcher_fn
        self.exit_code = check_exit_code(exit_code)
        self.exit_fn = exit_fn
        self.grace_period = check_grace_period(
            DEFAULT_GRACE_PERIOD if grace_period is None else grace_period)
        self.save_fn = save_fn

    def exit(self) -> None:
        """Ends the process as configured: ``exit_fn()``, else ``sys.exit(exit_code)``."""
        if self.exit_fn is not None:
            self.exit_fn()
            return
        sys.exit(self.exit_code)

    def __repr__(self) -> str:
        return (f"TerminationConfig(grace_period={self.grace_period:g}, "
                f"exit_code={self.exit_code}, watcher={self.termination_watcher_fn is not None})")


__all__ = ["DEFAULT_GRACE_PERIOD", "TerminationConfig", "TerminationConfigError",
           "check_exit_code", "check_grace_period"]
