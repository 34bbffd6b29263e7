"""SIGTERM to ``python -m jaxdist.train`` saves the step every process agreed on and exits 42;
the rerun resumes there and ends where an uninterrupted run ends, bit for bit.

One process (MirroredStrategy over 2 forced CPU devices) and a MultiWorkerMirrored job of two
processes on 127.0.0.1 (the SIGTERM goes to the chief; both stop). The interrupted runs are
configured with far more epochs than they get to train (they never finish on their own); the
rerun trains the reference's epochs, so a lost or repeated step shows in the final parameters.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess

import numpy as np
import pytest
from devutil import xla_flags

from jaxdist.testing import LocalCluster, python_command

pytestmark = [pytest.mark.slow, pytest.mark.platform("cpu")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NEVER_ENDS = "train.epochs=100000"


def _args(config: str, *sets: str) -> list[str]:
    args = ["--config", os.path.join(ROOT, "configs", config),
            "--set", "logging.progress_bar=never", "--set", "logging.dir=null"]
    for s in sets:
        args += ["--set", s]
    return args


def _final_params(ckpt) -> tuple[int, dict[str, np.ndarray]]:
    from jaxdist.train import Checkpointer

    c = Checkpointer(ckpt, read_only=True)
    step = c.latest_step()
    state, _ = c.restore(step)
    flat = {"/".join(str(k) for k in path): np.asarray(v)
            for path, v in _leaves(state["params"])}
    return step, flat


def _leaves(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, prefix + (k,))
    else:
        yield prefix, tree


def _steps(ckpt) -> list[int]:
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())


def _env(devices: int) -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices))
    env["XLA_FLAGS"] = xla_flags(devices)
    env.pop("TF_CONFIG", None)
    return env


def _one_process(*sets: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(python_command("jaxdist.train", *_args("default.yaml", *sets)),
                          env=_env(2), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(240)
def test_one_process_sigterm_saves_the_next_step_and_the_rerun_matches(tmp_path):
    epochs = "train.epochs=12"          # 12 x 22 = 264 steps
    # The uninterrupted reference runs at the same time as the run to interrupt.
    ref = subprocess.Popen(
        python_command("jaxdist.train", *_args("default.yaml", epochs,
                                                f"checkpoint.dir={tmp_path / 'ref'}")),
        env=_env(2), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ckpt = tmp_path / "ckpt"
    p = subprocess.Popen(
        python_command("jaxdist.train", *_args(
            "default.yaml", _NEVER_ENDS, f"checkpoint.dir={ckpt}", "logging.every_steps=1",
            "checkpoint.every_steps=50")),
        env=_env(2), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = 0
    for line in p.stdout:
        m = re.match(r"\[train\] step (\d+) ", line)
        if m and int(m.group(1)) >= 60:
            seen = int(m.group(1))
            break
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 42, err[-3000:]
    saved = _steps(ckpt)[-1]
    # the step it stopped at is the next one it had not started: nothing logged is lost
    assert seen <= saved < 264, (seen, saved)
    assert f"stopped before step {saved}: the checkpoint of step {saved} is written; " \
           f"exiting with 42" in err
    assert "Traceback" not in err
    _, ref_err = ref.communicate(timeout=120)
    assert ref.returncode == 0, ref_err[-3000:]
    rerun = _one_process(epochs, f"checkpoint.dir={ckpt}")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"Resumed from checkpoint at step {saved}" in rerun.stdout
    ref_step, ref_params = _final_params(tmp_path / "ref")
    step, params = _final_params(ckpt)
    assert step == ref_step == 264
    for name, value in ref_params.items():
        np.testing.assert_array_equal(params[name], value, err_msg=name)


def _mw_command(ckpt, *sets: str):
    def command(job, idx):
        return python_command("jaxdist.train", *_args(
            "multi_worker.yaml", f"checkpoint.dir={ckpt}", "strategy.timeout_seconds=30",
            *sets))
    return command


@pytest.mark.timeout(180)
def test_multi_worker_sigterm_to_the_chief_stops_both_at_one_step(tmp_path):
    """SIGTERM to worker:0 (the chief, which also hosts the coordination service); the same
    to worker:1 under the launcher's restarts, resumed bit for bit, is in
    tests/test_restart_training.py."""
    ckpt = tmp_path / "ckpt"
    with LocalCluster(workers=2, devices_per_process=1, cwd=ROOT) as c:
        c.start(_mw_command(ckpt, _NEVER_ENDS, "logging.every_steps=1",
                            "checkpoint.every_steps=50"))
        seen = int(c.wait_for_output("worker:0", r"\[train\] step ([3-9]\d)\b", 120).group(1))
        c.kill("worker:0", signal.SIGTERM)
        codes = c.join(timeout=60)
        assert codes == {"worker:0": 42, "worker:1": 42}, c.describe()
        saved = _steps(ckpt)[-1]
        assert seen <= saved, (seen, saved)
        for name in ("worker:0", "worker:1"):
            out = c.output(name)
            assert f"preempted (SIGTERM on worker:0); stopped before step {saved}" in out, out
            assert "Traceback" not in out
        assert f"the checkpoint of step {saved} is written" in c.output("worker:0")
        assert f"the chief wrote the checkpoint of step {saved}" in c.output("worker:1")
