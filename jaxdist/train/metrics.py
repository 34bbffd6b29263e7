"""Metrics output: JSON lines, TensorBoard event files, and a progress bar or plain log lines.

Every record is one JSON object per line in ``<log_dir>/metrics.jsonl``, e.g.::

    {"event": "train", "step": 20, "epoch": 0, "loss": 0.41, "accuracy": 0.88,
     "examples_per_sec": 5120.3, "step_time_ms": 12.5, "time": 1718000000.0}
    {"event": "validation", "step": 22, "epoch": 0, "loss": 0.30, "accuracy": 0.93, ...}
    {"event": "end", "step": 220, ...}

The same scalars go to TensorBoard (``train/loss``, ``validation/accuracy``, ...). On a terminal
a tqdm bar shows the loss and examples/s; otherwise each record is also printed as a log line.

Example:
    >>> logger = MetricsLogger("runs/x", total_steps=100)
    >>> logger.write("train", step=10, epoch=0, loss=0.5)
    >>> logger.close()
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, TextIO


def _clean(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them readable
    return v


class MetricsLogger:
    """Writes metric records to JSON lines, TensorBoard and the console.

    Args:
        log_dir: directory for ``metrics.jsonl`` and event files (``None``: console only).
        total_steps: the step the run ends at (for the progress bar).
        initial_step: the step the run starts from (after a resume).
        tensorboard: write TensorBoard event files.
        progress_bar: ``"auto"`` (a tqdm bar when ``stream`` is a terminal), ``"always"`` or
            ``"never"`` (plain log lines).
        enabled: ``False`` writes nothing (non-chief workers).
        stream: the console stream (default ``sys.stdout``).
    """

    def __init__(self, log_dir: str | os.PathLike | None = None, total_steps: int | None = None,
                 initial_step: int = 0, tensorboard: bool = True, progress_bar: str = "auto",
                 enabled: bool = True, stream: TextIO | None = None):
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.log_dir = os.fspath(log_dir) if log_dir is not None else None
        self._jsonl: TextIO | None = None
        self._tb = None
        self._bar = None
        if not enabled:
            return
        if self.log_dir is not None:
            os.makedirs(self.log_dir, exist_ok=True)
            self._jsonl = open(os.path.join(self.log_dir, "metrics.jsonl"), "a")
            if tensorboard:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(logdir=self.log_dir)
        isatty = getattr(self.stream, "isatty", lambda: False)()
        if progress_bar == "always" or (progress_bar == "auto" and isatty):
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=initial_step, unit="step",
                             file=self.stream, dynamic_ncols=True)

    @property
    def path(self) -> str | None:
        """The JSON lines file, if any."""
        return None if self.log_dir is None else os.path.join(self.log_dir, "metrics.jsonl")

    def write(self, event: str, step: int, **values: Any) -> dict[str, Any]:
        """Records one event (``"train"``, ``"validation"``, ``"end"``, ...) at ``step``."""
        record = {"event": event, "step": int(step)}
        record.update({k: _clean(v) for k, v in values.items()})
        record["time"] = round(time.time(), 3)
        if not self.enabled:
            return record
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in record.items():
                if k in ("event", "step", "time", "epoch") or isinstance(v, (str, bool)):
                    continue
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(f"{event}/{k}", v, global_step=int(step))
            self._tb.flush()
        if self._bar is not None:
            if event == "train":
                post = {k: f"{record[k]:.4g}" for k in ("loss", "examples_per_sec")
                        if isinstance(record.get(k), (int, float))}
                self._bar.set_postfix(post, refresh=False)
            else:
                self._bar.write(self._line(record))
        else:
            print(self._line(record), file=self.stream, flush=True)
        return record

    def advance(self, steps: int) -> None:
        """Moves the progress bar ``steps`` forward."""
        if self._bar is not None:
            self._bar.update(steps)

    def message(self, text: str) -> None:
        """Prints a plain line (through the bar, if any)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, file=self.stream, flush=True)

    @staticmethod
    def _line(record: dict[str, Any]) -> str:
        parts = [f"[{record['event']}] step {record['step']}"]
        for k, v in record.items():
            if k in ("event", "step", "time"):
                continue
            parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
        return " ".join(parts)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Reads a ``metrics.jsonl`` file (a directory means its ``metrics.jsonl``)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
