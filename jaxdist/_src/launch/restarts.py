"""What ``python -m jaxdist.launch --max-restarts N`` restarts, when, and how it says so.

A task that ends with a restartable exit code (``exit_codes.restartable``: preempted with 42,
failed with 1, killed by a signal) is restarted while restarts are left; 0 (done), 2 (bad
config or command line) and 130 (interrupted) never are. What is restarted depends on the
task and the cluster (``restart_scope``):

* a synchronous job (MultiWorkerMirrored chief/worker tasks, and a between-graph
  parameter-server job, whose ps tasks restore the chief's latest checkpoint at start):
  **every task**, as a fresh cluster (new ports, hence a new coordination-service port, and a
  new cluster token so that no process of the previous run can join; the same TLS identities
  and coordinator credentials);
* under ``--coordinator`` (TF2 ``ClusterCoordinator``) a lost **worker** task alone, on the
  same address with the same identity: the chief re-sends the closures it had scheduled there;
  a lost chief or ps task restarts every task as above;
* an evaluator (a side-car that follows the checkpoints) alone.

Before a restart of every task, the other tasks are stopped (SIGTERM, SIGKILL after
``--grace`` seconds); after an exit with 42 they are preempted too and first get ``--grace``
seconds to save and exit on their own. Each restart then waits ``delay`` seconds (1 s by
default: a fixed wait, no growing back-off, since ``--max-restarts`` already bounds a crash
loop).

Example:
    >>> from jaxdist._src.launch.restarts import describe_exit, restart_scope
    >>> describe_exit(42), describe_exit(-9), describe_exit(1)
    ('preempted', 'killed by SIGKILL', 'failed')
    >>> restart_scope("worker", coordinator=True), restart_scope("worker", coordinator=False)
    ('task', 'job')
"""

from __future__ import annotations

import signal

from jaxdist._src.distributed.exit_codes import (
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    RESTART_EXIT_CODE,
    restartable,
)

#: Seconds the launcher waits before each restart.
DEFAULT_RESTART_DELAY = 1.0

_MEANINGS = {EXIT_OK: "finished", EXIT_FAILED: "failed", EXIT_CONFIG: "bad config",
             RESTART_EXIT_CODE: "preempted", EXIT_INTERRUPTED: "interrupted"}


def describe_exit(code: int) -> str:
    """What a task's exit code means, in a few words (``code`` as ``Popen.returncode`` gives
    it: a negative number for a death by a signal).

    Example:
        >>> from jaxdist._src.launch.restarts import describe_exit
        >>> describe_exit(137), describe_exit(-15), describe_exit(7)
        ('killed by SIGKILL', 'killed by SIGTERM', 'failed')
    """
    if code in _MEANINGS:
        return _MEANINGS[code]
    signum = -code if code < 0 else code - 128 if 128 < code < 128 + 65 else None
    if signum is not None:
        try:
            return f"killed by {signal.Signals(signum).name}"
        except ValueError:
            return f"killed by signal {signum}"
    return "failed"


def restart_scope(job: str, coordinator: bool) -> str:
    """``"task"`` when a lost task of ``job`` is restarted alone, ``"job"`` when every task is.

    Example:
        >>> from jaxdist._src.launch.restarts import restart_scope
        >>> restart_scope("evaluator", coordinator=False), restart_scope("ps", True)
        ('task', 'job')
    """
    if job == "evaluator" or (coordinator and job == "worker"):
        return "task"
    return "job"


class RestartBudget:
    """Counts the restarts of one launch against ``--max-restarts``.

    Args:
        max_restarts: how many restarts are allowed (0: none).

    Example:
        >>> from jaxdist._src.launch.restarts import RestartBudget
        >>> budget = RestartBudget(1)
        >>> budget.take(42), budget.used, budget.take(42)
        (True, 1, False)
        >>> budget.take(2)            # a bad config is never restarted
        False
    """

    def __init__(self, max_restarts: int):
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) \
                or max_restarts < 0:
            raise ValueError(f"max_restarts must be a whole number >= 0, got {max_restarts!r}")
        self.max_restarts = max_restarts
        self.used = 0

    def take(self, code: int) -> bool:
        """Whether a task that exited with ``code`` is restarted (and counts it if so)."""
        if not restartable(code) or self.used >= self.max_restarts:
            return False
        self.used += 1
        return True


__all__ = ["DEFAULT_RESTART_DELAY", "RestartBudget", "describe_exit", "restart_scope"]
