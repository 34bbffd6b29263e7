"""``python -m jaxdist.train`` (MultiWorkerMirrored) restarted and resized by the launcher.

Real processes on 127.0.0.1 with forced CPU devices. The digits MLP of
``configs/multi_worker.yaml`` with a global batch of 48 (29 steps an epoch), 40 steps in all:
the runs cross an epoch boundary. Every job here has 6 replicas (2 processes x 3 devices,
1 x 6, 3 x 2), so each replica gets the same 8 rows of every global batch; only the order in
which the cross-process all-reduce adds the replicas' gradients changes with the layout.

* A worker SIGKILLed (or sent SIGTERM, a preemption) mid-run under ``--max-restarts 1``: the
  launcher restarts both tasks, the job resumes from its latest checkpoint and ends with
  exactly the parameters of an uninterrupted run (same layout: bit for bit).
* A job checkpointed by 2 processes at step 15 (mid-epoch) resumes on 1 or 3 processes at the
  same step and position in the data: its final parameters equal the uninterrupted run's
  within float32 reduction-order tolerance (``RESIZE_RTOL``).
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from jaxdist.train import read_metrics

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "multi_worker.yaml")
STEPS = 40
#: Resumed on another process count, the all-reduce may add the 6 replicas' float32 gradients
#: in another order: a step's update then differs in the last bits, and the Adam steps after
#: the resume carry that forward. Measured: 6e-8 (1 x 6) and 0 (3 x 2) against parameters of
#: up to 0.39, i.e. ~1.5e-7 of the largest parameter; the bound is 1e-5 of it. A wrong
#: position in the data is far outside it (measured: one global batch skipped after the
#: resume, 0.034; another shuffle order, 0.057).
RESIZE_RTOL = 1e-5


def _launch(workers, devices, ckpt, logs, *sets, max_restarts=0, mark=""):
    """The launcher's argv and environment for a ``jaxdist.train`` job of this test."""
    argv = [sys.executable, "-m", "jaxdist.launch", "--workers", str(workers),
            "--devices-per-process", str(devices), "--grace", "5",
            "--max-restarts", str(max_restarts), "--restart-delay", "0.5", "--",
            sys.executable, "-m", "jaxdist.train", "--config", CONFIG,
            "--set", "logging.progress_bar=never", "--set", "train.global_batch_size=48",
            "--set", f"checkpoint.dir={ckpt}", "--set", "checkpoint.every_steps=10",
            "--set", f"logging.dir={logs}", "--set", "logging.every_steps=5",
            "--set", "strategy.timeout_seconds=10"]
    for s in sets:
        argv += ["--set", s]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAXDIST_TEST_MARK=mark)
    env.pop("TF_CONFIG", None)
    return argv, env


def _run(workers, devices, ckpt, logs, *sets, timeout=120):
    argv, env = _launch(workers, devices, ckpt, logs, *sets)
    proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def _params(ckpt, step=STEPS):
    from jaxdist.train import Checkpointer

    state, meta = Checkpointer(ckpt, read_only=True).restore(step)
    assert int(meta["step"]) == step
    return {"/".join(map(str, k)): np.asarray(v)
            for k, v in _flatten(state["params"]).items()}


def _flatten(tree, prefix=()):
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, (*prefix, k)))
        return out
    return {prefix: tree}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 2-process run of 40 steps: its final parameters."""
    d = tmp_path_factory.mktemp("reference")
    _run(2, 3, d / "ckpt", d / "logs", f"train.steps={STEPS}")
    return _params(d / "ckpt")


@pytest.fixture(scope="module")
def first_part(tmp_path_factory):
    """The first 15 steps on 2 processes: a checkpoint in the middle of epoch 0."""
    d = tmp_path_factory.mktemp("first_part")
    _run(2, 3, d / "ckpt", d / "logs", "train.steps=15")
    return d / "ckpt"


def _pids_of(mark, task_index):
    """The pids of this test's worker task ``task_index`` (by its environment)."""
    want = f'"task": {{"type": "worker", "index": {task_index}}}'.encode()
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if f"JAXDIST_TEST_MARK={mark}".encode() in env and want in env:
            pids.append(int(pid))
    return pids


def _read_until(proc: subprocess.Popen, marker: str, timeout: float = 90) -> list[str]:
    """The launcher's output lines up to the first that holds ``marker`` (asserted)."""
    lines: list[str] = []
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if marker in line:
            break
    assert lines and marker in lines[-1], "".join(lines)[-4000:]
    return lines


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_lost_or_preempted_worker_is_restarted_and_the_job_ends_as_an_uninterrupted_run(
        tmp_path, reference, sig):
    """SIGKILL: the launcher sees 137, restarts both tasks, the job resumes from its latest
    periodic checkpoint. SIGTERM (a preemption notice): both processes stop at one agreed step,
    the chief saves it, both exit 42, the launcher restarts them and the job resumes from that
    step (nothing lost). Either way the final parameters are the uninterrupted run's."""
    mark = uuid.uuid4().hex
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    argv, env = _launch(2, 3, ckpt, logs, f"train.steps={STEPS}", max_restarts=1, mark=mark)
    proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = _read_until(proc, "[worker:0] [train] step 20 ")
    pids = _pids_of(mark, 1)
    assert pids, "worker:1 not found"
    for pid in pids:
        os.kill(pid, sig)
    out, _ = proc.communicate(timeout=120)
    out = "".join(lines) + out
    assert proc.returncode == 0, out[-4000:]
    assert out.count("[launch] started ") == 2
    resumed = [int(s) for s in re.findall(
        r"\[worker:0\] Resumed from checkpoint at step (\d+) \(epoch", out)]
    assert len(resumed) == 1, out[-4000:]
    if sig == signal.SIGKILL:
        assert ("[launch] worker:1 exited with 137 (killed by SIGKILL); restart 1 of 1: "
                "restarting every task (worker:0, worker:1)") in out, out[-4000:]
        # the latest checkpoint when worker:1 died: step 20 (or 10 when the kill came before
        # the chief had written it, 30 when the chief ran ahead)
        assert resumed[0] in (10, 20, 30), out[-4000:]
    else:
        assert re.search(r"\[launch\] worker:[01] exited with 42 \(preempted\); restart 1 of "
                         r"1: restarting every task \(worker:0, worker:1\)", out), out[-4000:]
        assert 20 < resumed[0] < STEPS, out[-4000:]   # the agreed step: nothing lost
    ends = [r for r in read_metrics(logs) if r["event"] == "end"]
    assert [e["step"] for e in ends] == [STEPS], ends
    got = _params(ckpt)
    for name, want in reference.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers,devices", [(1, 6), (3, 2)])
def test_a_two_process_checkpoint_resumes_on_another_process_count_at_the_same_batch(
        tmp_path, reference, first_part, workers, devices):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(first_part, ckpt)
    out = _run(workers, devices, ckpt, tmp_path / "logs", f"train.steps={STEPS}")
    assert (f"{workers} process(es)" in out and "[worker:0] Resumed from checkpoint at step 15 "
            "(epoch 0, step 15 of 29)" in out), out[-4000:]
    got = _params(ckpt)
    scale = max(float(np.abs(v).max()) for v in reference.values())
    worst = max(float(np.abs(got[n] - reference[n]).max()) for n in reference)
    print(f"{workers} x {devices}: largest difference {worst:.3g} (largest parameter "
          f"{scale:.3g})")
    assert worst <= RESIZE_RTOL * scale, (worst, scale)


@pytest.mark.timeout(180)
def test_a_between_graph_parameter_server_job_restarts_every_task_and_resumes(tmp_path):
    """Between-graph (no coordinator): a lost worker restarts every task, ps included; the ps
    task restores the chief's latest checkpoint at start and the workers continue from its
    step (updates since that checkpoint are lost, as a ps restart loses them)."""
    mark = uuid.uuid4().hex
    epochs = 40   # 22 steps an epoch: 880 steps (~2 ms each), far from done at the kill
    argv = [sys.executable, "-m", "jaxdist.launch", "--workers", "2", "--ps", "1",
            "--devices-per-process", "1", "--grace", "5", "--max-restarts", "1",
            "--restart-delay", "0.5", "--checkpoint-root", str(tmp_path), "--",
            sys.executable, "-m", "jaxdist.train", "--config",
            os.path.join(ROOT, "configs", "parameter_server.yaml"),
            "--set", "logging.progress_bar=never", "--set", f"train.epochs={epochs}",
            "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--set", "checkpoint.every_steps=50",
            "--set", f"logging.dir={tmp_path / 'logs'}", "--set", "strategy.timeout=10"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAXDIST_TEST_MARK=mark)
    env.pop("TF_CONFIG", None)
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = _read_until(proc, "[worker:0] [train] step 100 ")
    for pid in _pids_of(mark, 1):
        os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=150)
    out = "".join(lines) + out
    assert proc.returncode == 0, out[-4000:]
    assert ("[launch] worker:1 exited with 137 (killed by SIGKILL); restart 1 of 1: restarting "
            "every task (worker:0, worker:1, ps:0)") in out, out[-4000:]
    resumed = [int(s) for s in re.findall(
        r"\[worker:0\] Resumed from checkpoint at step (\d+) \(epoch", out)]
    assert len(resumed) == 1 and resumed[0] >= 100 and resumed[0] % 50 == 0, out[-4000:]
    ends = [r for r in read_metrics(tmp_path / "logs") if r["event"] == "end"]
    assert [e["step"] for e in ends] == [epochs * 22], ends
