"""Metrics output: JSON lines, TensorBoard event files, and a progress bar or plain log lines.

Every record is one JSON object per line in ``<log_dir>/metrics.jsonl``, e.g.::

    {"event": "train", "step": 20, "epoch": 0, "loss": 0.41, "accuracy": 0.88,
     "examples_per_sec": 5120.3, "step_time_ms": 12.5, "time": 1718000000.0}
    {"event": "validation", "step": 22, "epoch": 0, "loss": 0.30, "accuracy": 0.93, ...}
    {"event": "end", "step": 220, ...}

The same scalars go to TensorBoard, each phase in its own subdirectory under the same tags
(``<log_dir>/train`` and ``<log_dir>/validation`` both hold ``loss`` and ``accuracy``), as Keras
writes them, so TensorBoard overlays the training and validation curves of a run.

Console output follows Keras' ``verbose``: 0 prints nothing; 1 shows an epoch progress bar
(tqdm) on a terminal, or each record as a log line otherwise; 2 prints one line per epoch.

Example:
    >>> from jaxdist.train import MetricsLogger
    >>> logger = MetricsLogger("runs/x", total_steps=100)
    >>> logger.write("train", step=10, epoch=0, loss=0.5)
    [train] step 10 epoch=0 loss=0.5
    {'event': 'train', 'step': 10, 'epoch': 0, 'loss': 0.5, 'time': ...}
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
        verbose: Keras' ``verbose``: 0 silent, 1 a progress bar (or log lines), 2 one line per
            epoch (``epoch_end``).
        per_epoch_bar: the bar covers one epoch (``begin_epoch``) instead of the whole run.
    """

    def __init__(self, log_dir: str | os.PathLike | None = None, total_steps: int | None = None,
                 initial_step: int = 0, tensorboard: bool = True, progress_bar: str = "auto",
                 enabled: bool = True, stream: TextIO | None = None, verbose: int = 1,
                 per_epoch_bar: bool = False):
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.log_dir = os.fspath(log_dir) if log_dir is not None else None
        self.verbose = int(verbose)
        self._jsonl: TextIO | None = None
        self._tensorboard = tensorboard
        self._tb: dict[str, Any] = {}
        self._bar = None
        self._use_bar = False
        if not enabled:
            return
        if self.log_dir is not None:
            os.makedirs(self.log_dir, exist_ok=True)
            self._jsonl = open(os.path.join(self.log_dir, "metrics.jsonl"), "a")
        isatty = getattr(self.stream, "isatty", lambda: False)()
        self._use_bar = self.verbose == 1 and (
            progress_bar == "always" or (progress_bar == "auto" and isatty))
        if self._use_bar and not per_epoch_bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=initial_step, unit="step",
                             file=self.stream, dynamic_ncols=True)

    def _writer(self, phase: str) -> Any:
        if phase not in self._tb:
            from tensorboardX import SummaryWriter

            self._tb[phase] = SummaryWriter(logdir=os.path.join(self.log_dir, phase))
        return self._tb[phase]

    def begin_epoch(self, epoch: int, epochs: int, steps: int, initial: int = 0) -> None:
        """Starts the epoch's progress bar (verbose 1 on a terminal, ``per_epoch_bar``)."""
        if not (self.enabled and self._use_bar):
            return
        from tqdm.auto import tqdm

        if self._bar is not None:
            self._bar.close()
        self._bar = tqdm(total=steps, initial=initial, unit="step", file=self.stream,
                         desc=f"Epoch {epoch + 1}/{epochs}", dynamic_ncols=True)

    def end_epoch(self, epoch: int, epochs: int, logs: dict[str, Any], seconds: float) -> None:
        """Closes the epoch's bar; with verbose 2 prints Keras' one line for the epoch."""
        if not self.enabled:
            return
        if self._bar is not None and self._use_bar and self._bar.total is not None \
                and self._bar.desc.startswith("Epoch"):
            post = {k: f"{v:.4g}" for k, v in logs.items() if isinstance(v, (int, float))}
            self._bar.set_postfix(post, refresh=True)
            self._bar.close()
            self._bar = None
        if self.verbose == 2:
            parts = [f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}"
                     for k, v in logs.items()]
            print(f"Epoch {epoch + 1}/{epochs} - {seconds:.1f}s - " + " - ".join(parts),
                  file=self.stream, flush=True)

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
        if self._tensorboard and self.log_dir is not None and event != "end":
            for k, v in record.items():
                if k in ("event", "step", "time", "epoch") or isinstance(v, (str, bool)):
                    continue
                if isinstance(v, (int, float)):
                    self._writer(event).add_scalar(k, v, global_step=int(step))
            if event in self._tb:
                self._tb[event].flush()
        if self.verbose != 1:
            return record
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
        """Prints a plain line (through the bar, if any; nothing with verbose 0)."""
        if not self.enabled or self.verbose == 0:
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
        for w in self._tb.values():
            w.close()
        self._tb.clear()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Reads a ``metrics.jsonl`` file.

    A directory means its ``metrics.jsonl``, or, for the parent of run directories (a
    ``logging.dir``), the newest run's (``jaxdist._src.train.runs.latest_run``).
    """
    from jaxdist._src.train.runs import latest_run

    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(latest_run(path), "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
