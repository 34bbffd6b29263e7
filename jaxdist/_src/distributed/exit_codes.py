"""The exit codes every jaxdist process uses, so a scheduler (the launcher, Slurm, Kubernetes,
Ray) can tell what happened from the status alone.

* 0: training finished; nothing to do.
* 1: training failed (an error in the program or the data, a lost peer); a scheduler that
  restarts failures (``--max-restarts``) may restart it: the job resumes from its latest
  checkpoint.
* 2: bad config, command line or checkpoint (the settings must change); never restart.
* 3: nothing to train: the checkpoint already completes the configured epochs or steps
  (a rerun of a finished config); never restart.
* 42: preempted: the job saved a checkpoint of the step it stopped at (TF's restart code);
  restart it, and it resumes from that checkpoint.
* 130 / 143: interrupted by Ctrl-C (SIGINT) / ended by SIGTERM with nothing to checkpoint.

Example:
    >>> from jaxdist._src.distributed.exit_codes import RESTART_EXIT_CODE, restartable
    >>> RESTART_EXIT_CODE
    42
    >>> restartable(42), restartable(2)
    (True, False)
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
#: A rerun whose checkpoint already completes the configured training (nothing was run).
EXIT_ALREADY_DONE = 3
#: TensorFlow's ``PreemptionCheckpointHandler`` exits with 42 after its preemption checkpoint.
RESTART_EXIT_CODE = 42
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


def restartable(code: int | None) -> bool:
    """Whether a task that exited with ``code`` may be restarted: preempted (42), failed (1)
    or killed by a signal (negative codes, or 128 + a signal other than SIGINT); never a
    finished task (0), a bad config (2), a rerun with nothing to train (3) or an interrupt
    (130).

    Example:
        >>> from jaxdist._src.distributed.exit_codes import restartable
        >>> [restartable(c) for c in (0, 1, 2, 3, 42, 130, -9, 137)]
        [False, True, False, False, True, False, True, True]
    """
    if code is None or code in (EXIT_OK, EXIT_CONFIG, EXIT_ALREADY_DONE, EXIT_INTERRUPTED):
        return False
    return True


#: Set to ``"1"`` in a serving task's environment (a ps; a coordinator's worker) where a
#: preemption's SIGTERM reaches every process (a Slurm step): ``jaxdist.server`` then ignores
#: SIGTERM, serves while the training tasks agree where to stop and save, and is stopped with
#: SIGINT once they have ended.
SERVER_IGNORES_SIGTERM_ENV = "JAXDIST_SERVER_IGNORE_SIGTERM"

__all__ = ["EXIT_ALREADY_DONE", "EXIT_CONFIG", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK",
           "EXIT_TERMINATED", "RESTART_EXIT_CODE", "SERVER_IGNORES_SIGTERM_ENV", "restartable"]
