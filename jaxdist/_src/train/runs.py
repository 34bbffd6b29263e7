"""Run directories: every ``fit`` writes into a directory of its own, never into an earlier run's.

A run directory is ``<log_dir>/<timestamp>`` (``20261123-093512``, with ``-1``, ``-2`` ... when
two runs start in the same second) or ``<log_dir>/<run_name>``. It holds ``metrics.jsonl``,
``config.yaml`` (jobs) and the TensorBoard event files of each phase in ``train/`` and
``validation/``, so ``tensorboard --logdir runs/`` shows every run and overlays the training and
validation curves of each.

Example:
    >>> from jaxdist._src.train.runs import latest_run, new_run_dir
    >>> from jaxdist._src.train.metrics import MetricsLogger
    >>> run = new_run_dir("runs/digits")             # runs/digits/20261123-093512
    >>> run = new_run_dir("runs/digits", "baseline")  # runs/digits/baseline
    >>> logger = MetricsLogger(run)                  # a run is a directory with metrics.jsonl
    >>> _ = logger.write("train", step=1, loss=0.5); logger.close()
    [train] step 1 loss=0.5
    >>> latest_run("runs/digits")
    'runs/digits/baseline'
"""

from __future__ import annotations

import os
import time

METRICS_FILE = "metrics.jsonl"
#: The side-car evaluator's directory under ``logging.dir`` (not a training run).
EVAL_DIR = "eval"


class RunDirError(ValueError):
    """A run directory that cannot be used (it already holds a run, or no run is found)."""


def _holds_run(path: str) -> bool:
    return os.path.isdir(path) and any(os.scandir(path))


def new_run_dir(log_dir: str | os.PathLike, run_name: str | None = None) -> str:
    """Creates and returns a fresh run directory under ``log_dir``.

    Args:
        log_dir: the parent of the runs (e.g. ``runs/<name>``).
        run_name: the run's directory name; ``None``: the start time ``%Y%m%d-%H%M%S``.

    Returns:
        The new, empty directory.

    Raises:
        RunDirError: ``run_name`` names a directory that already holds files (a run is never
            appended to), or contains a path separator.

    Example:
        >>> from jaxdist._src.train.runs import new_run_dir
        >>> new_run_dir("runs/digits", "lr-0.1")
        'runs/digits/lr-0.1'
    """
    parent = os.fspath(log_dir)
    os.makedirs(parent, exist_ok=True)
    if run_name is not None:
        if not run_name or os.sep in run_name or run_name in (".", ".."):
            raise RunDirError(f"run name {run_name!r} is not valid; expected one directory "
                              f"name such as 'baseline'")
        path = os.path.join(parent, run_name)
        if _holds_run(path):
            raise RunDirError(f"run directory {path} already holds a run; runs are never "
                              f"appended to: choose another run name, or leave it unset for a "
                              f"timestamped directory")
        os.makedirs(path, exist_ok=True)
        return path
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        path = os.path.join(parent, stamp if i == 0 else f"{stamp}-{i}")
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            continue
    raise RunDirError(f"no free run directory for {stamp} under {parent}")  # pragma: no cover


def list_runs(log_dir: str | os.PathLike) -> list[str]:
    """The run directories under ``log_dir`` (those with a ``metrics.jsonl``, the evaluator's
    ``eval`` excepted), oldest first.

    Example:
        >>> from jaxdist._src.train.runs import list_runs
        >>> list_runs("runs/digits")     # the runs that wrote metrics, oldest first
        []
    """
    parent = os.fspath(log_dir)
    if not os.path.isdir(parent):
        return []
    runs = [e.path for e in os.scandir(parent) if e.is_dir() and e.name != EVAL_DIR
            and os.path.isfile(os.path.join(e.path, METRICS_FILE))]
    return sorted(runs, key=lambda p: (os.path.getmtime(os.path.join(p, METRICS_FILE)), p))


def latest_run(log_dir: str | os.PathLike) -> str:
    """The newest run directory under ``log_dir`` (``log_dir`` itself if it is a run).

    Raises:
        RunDirError: there is no run there.

    Example:
        >>> from jaxdist._src.train.runs import latest_run, new_run_dir
        >>> from jaxdist._src.train.metrics import MetricsLogger
        >>> logger = MetricsLogger(new_run_dir("runs/digits", "baseline"))
        >>> _ = logger.write("train", step=1, loss=0.5); logger.close()
        [train] step 1 loss=0.5
        >>> latest_run("runs/digits")
        'runs/digits/baseline'
    """
    parent = os.fspath(log_dir)
    if os.path.isfile(os.path.join(parent, METRICS_FILE)):
        return parent
    runs = list_runs(parent)
    if not runs:
        raise RunDirError(f"no run under {parent}: no directory there holds a {METRICS_FILE}")
    return runs[-1]


__all__ = ["EVAL_DIR", "METRICS_FILE", "RunDirError", "latest_run", "list_runs", "new_run_dir"]
