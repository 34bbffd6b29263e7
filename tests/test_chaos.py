"""Chaos: jobs under ``python -m jaxdist.launch --max-restarts`` are sent SIGTERM and SIGKILL at
random steps, several times, and still end where an uninterrupted run ends.

* A MultiWorkerMirrored ``jaxdist.train`` job (2 processes x 3 forced CPU devices, a
  deterministic config): SIGTERM and SIGKILL, to a random worker at a random step each, three
  times; the final parameters equal an uninterrupted run's bit for bit; a SIGTERM loses no step
  (the job resumes at or after the last step logged before the signal), a SIGKILL at most what
  the latest complete checkpoint had not yet covered.
* A between-graph parameter-server job (2 workers, 1 ps): SIGTERM to the chief and SIGKILL to the
  other worker at random steps; asynchronous training is not deterministic, so it must finish
  its steps, reach the accuracy of the uninterrupted job, and resume a SIGTERM at or after the
  chief's last logged step.

The events' steps and targets come from a seeded generator (printed on failure).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from jaxdist.train import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.platform("cpu")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED = 20261128


def _launch(config: str, ckpt, logs, mark: str, *sets: str, workers: int = 2, ps: int = 0,
            devices: int = 1, max_restarts: int = 0, cwd=None) -> subprocess.Popen:
    argv = [sys.executable, "-m", "jaxdist.launch", "--workers", str(workers),
            "--devices-per-process", str(devices), "--grace", "3",
            "--max-restarts", str(max_restarts), "--restart-delay", "0.2"]
    if ps:
        argv += ["--ps", str(ps), "--checkpoint-root", str(cwd)]
    argv += ["--", sys.executable, "-m", "jaxdist.train", "--config",
             os.path.join(ROOT, "configs", config), "--set", "logging.progress_bar=never",
             "--set", f"checkpoint.dir={ckpt}", "--set", f"logging.dir={logs}"]
    for s in sets:
        argv += ["--set", s]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAXDIST_TEST_MARK=mark)
    env.pop("TF_CONFIG", None)
    return subprocess.Popen(argv, env=env, cwd=cwd or ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _chaos(proc: subprocess.Popen, mark: str, ckpt, events, timeout: float = 240
           ) -> tuple[str, list[tuple[str, int, int, int]]]:
    """Sends each ``(signal, worker index, at step)`` of ``events`` once worker:0 logs that step
    (in the current run); returns the output and ``(signal name, step seen, latest checkpoint
    on disk, run)`` per event."""
    lines: list[str] = []
    done = []
    run, pending = 0, list(events)
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("[launch] started "):
            run += 1
        m = re.match(r"\[worker:0\] \[train\] step (\d+) ", line)
        if not (m and pending and done_runs(done) < run):
            continue
        sig, worker, at = pending[0]
        if int(m.group(1)) < at:
            continue
        pids = _task_pids(proc.pid, mark, worker)
        if not pids:
            continue
        on_disk = _steps_on_disk(ckpt)
        for pid in pids:
            os.kill(pid, sig)
        pending.pop(0)
        done.append((signal.Signals(sig).name, int(m.group(1)), on_disk[-1] if on_disk else 0,
                     run))
    out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    return "".join(lines) + out, done


def _task_pids(launcher: int, mark: str, index: int) -> list[int]:
    """The launcher's own child running worker task ``index`` (not that task's children, such
    as the coordination service's helper process of worker:0)."""
    want = f'"task": {{"type": "worker", "index": {index}}}'.encode()
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == launcher and f"JAXDIST_TEST_MARK={mark}".encode() in env and want in env:
            pids.append(int(pid))
    return pids


def _steps_on_disk(ckpt) -> list[int]:
    """The complete checkpoints in ``ckpt`` (orbax renames a checkpoint into place when done)."""
    if not os.path.isdir(ckpt):
        return []
    return sorted(int(p) for p in os.listdir(ckpt) if p.isdigit())


def done_runs(done) -> int:
    """The run of the latest event (one event per run: the next waits for the restart)."""
    return done[-1][3] if done else 0


def _resumed(out: str) -> list[int]:
    return [int(s) for s in re.findall(
        r"\[worker:0\] Resumed from checkpoint at step (\d+) \(epoch", out)]


def _params(ckpt, step):
    from jaxdist.train import Checkpointer

    state, _ = Checkpointer(ckpt, read_only=True).restore(step)
    flat = {}

    def walk(tree, prefix=()):
        if isinstance(tree, dict):
            for k, v in tree.items():
                walk(v, (*prefix, k))
        else:
            flat["/".join(map(str, prefix))] = np.asarray(tree)

    walk(state["params"])
    return flat


@pytest.mark.timeout(420)
def test_multi_worker_job_survives_random_sigterm_and_sigkill(tmp_path):
    rng = random.Random(SEED)
    steps, every = 120, 10
    sets = ("train.global_batch_size=48", f"train.steps={steps}", "logging.every_steps=1",
            f"checkpoint.every_steps={every}", "strategy.timeout_seconds=10")
    kinds = [signal.SIGTERM, signal.SIGKILL, rng.choice([signal.SIGTERM, signal.SIGKILL])]
    rng.shuffle(kinds)
    ats = sorted(rng.sample(range(12, steps - 12), 3))
    events = [(k, rng.randrange(2), at) for k, at in zip(kinds, ats)]
    ref = _launch("multi_worker.yaml", tmp_path / "ref", tmp_path / "ref_logs", "ref", *sets,
                  devices=3)
    mark = uuid.uuid4().hex
    ckpt = tmp_path / "ckpt"
    proc = _launch("multi_worker.yaml", ckpt, tmp_path / "logs", mark, *sets, devices=3,
                   max_restarts=len(events))
    out, done = _chaos(proc, mark, ckpt, events)
    ref_out, _ = ref.communicate(timeout=240)
    where = f"seed {SEED}, events {events}, done {done}\n{out[-5000:]}"
    assert ref.returncode == 0, ref_out[-3000:]
    assert proc.returncode == 0 and len(done) == len(events), where
    resumed = _resumed(out)
    assert len(resumed) == len(events), where
    for (sig, seen, on_disk, _), at in zip(done, resumed):
        if sig == "SIGTERM":
            assert at >= seen, where            # nothing lost beyond the step in flight
        else:
            assert at >= on_disk and seen - at <= 2 * every, where
    ends = [r for r in read_metrics(tmp_path / "logs") if r["event"] == "end"]
    assert [e["step"] for e in ends] == [steps], where
    want, got = _params(tmp_path / "ref", steps), _params(ckpt, steps)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=f"{name}; {where[:300]}")


@pytest.mark.timeout(420)
def test_parameter_server_job_survives_sigterm_to_the_chief_and_sigkill_to_a_worker(tmp_path):
    rng = random.Random(SEED + 1)
    epochs = 30                              # 22 steps an epoch
    steps = epochs * 22
    at_term, at_kill = sorted(rng.sample(range(60, steps - 200, 10), 2))
    events = [(signal.SIGTERM, 0, at_term), (signal.SIGKILL, 1, at_kill)]
    rng.shuffle(events)
    events.sort(key=lambda e: e[2])
    mark = uuid.uuid4().hex
    ckpt = tmp_path / "ckpt"
    proc = _launch("parameter_server.yaml", ckpt, tmp_path / "logs", mark,
                   f"train.epochs={epochs}", "checkpoint.every_steps=50",
                   "logging.every_steps=10", "strategy.timeout=10", ps=1,
                   max_restarts=len(events), cwd=tmp_path)
    out, done = _chaos(proc, mark, ckpt, events)
    where = f"seed {SEED + 1}, events {events}, done {done}\n{out[-5000:]}"
    assert proc.returncode == 0 and len(done) == len(events), where
    resumed = _resumed(out)
    assert len(resumed) == len(events), where
    for (sig, seen, on_disk, _), at in zip(done, resumed):
        if sig == "SIGTERM":
            assert at >= seen, where            # the chief saved the step it stopped at
        else:
            assert at >= on_disk, where
    ends = [r for r in read_metrics(tmp_path / "logs") if r["event"] == "end"]
    assert [e["step"] for e in ends] == [steps], where
    assert ends[0]["val_accuracy"] >= 0.9, where
