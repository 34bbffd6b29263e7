"""``python -m jaxdist.train`` end to end, in subprocesses (CPU, 2 forced devices)."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from devutil import xla_flags

from jaxdist.train import read_metrics

ROOT = pathlib.Path(__file__).parent.parent


def _env(devices: int = 2) -> dict:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_NUM_CPU_DEVICES"] = str(devices)
    env["XLA_FLAGS"] = xla_flags(devices)
    return env


def _cmd(config: str, *overrides: str) -> list:
    cmd = [sys.executable, "-m", "jaxdist.train", "--config", str(ROOT / "configs" / config)]
    for o in overrides:
        cmd += ["--set", o]
    return cmd


def _run(config: str, *overrides: str, devices: int = 2, timeout: float = 120):
    return subprocess.run(_cmd(config, *overrides), env=_env(devices), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _records(log_dir) -> list:
    return read_metrics(log_dir)  # the newest run directory under logging.dir


@pytest.mark.slow
def test_help_lists_the_options(cli_runs):
    out, _ = cli_runs["help"]
    assert out.returncode == 0
    for word in ("--config", "--set", "global_batch_size", "steps_per_execution",
                 "central_storage", "cross_device_ops", "halt_on_nan", "every_steps"):
        assert word in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("timed", [False, pytest.param(True, marks=pytest.mark.timing)])
def test_default_config_reaches_95_percent(tmp_path, timed):
    start = time.time()
    out = _run("default.yaml", f"logging.dir={tmp_path}")
    wall = time.time() - start
    assert out.returncode == 0, out.stderr[-2000:]
    records = _records(tmp_path)
    end = [r for r in records if r["event"] == "end"][-1]
    assert end["val_accuracy"] >= 0.95, end
    train = [r for r in records if r["event"] == "train"]
    assert {"loss", "accuracy", "examples_per_sec", "step_time_ms"} <= set(train[-1])
    (run,) = tmp_path.iterdir()  # the run's own directory, named in the start-up line
    assert f"writing to {run}" in out.stdout
    assert list((run / "train").glob("events.out.tfevents*"))
    assert list((run / "validation").glob("events.out.tfevents*"))
    assert "[validation]" in out.stdout  # plain log lines when stdout is not a terminal
    assert wall < 60 or not timed  # a speed claim: only in the `timing` run


_BAD_CONFIGS = [
    (["train.epochs=ten"], 2, "train.epochs: 'ten' (str) is not an int"),
    (["strategy.name=multi_gpu"], 2, "strategy.name: 'multi_gpu' is not a known strategy"),
    (["model.name=transformer"], 2, "model.name: 'transformer' is not valid"),
    (["train.global_batch_size=30"], 4,
     "train.global_batch_size: 30 does not divide across the 4 replicas"),
    (["strategy.devices=[/cpu:9]"], 2, "strategy: 'mirrored' cannot be built"),
    (["optimiser.name=sgd"], 2, "optimiser: unknown key"),
]


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Each bad config's run, ``{index: (CompletedProcess, its logging.dir)}``, plus the missing
    config file's (``"missing"``) and ``--help``'s (``"help"``): the processes start together
    and are waited for together (each exits at start-up; most of their time is importing)."""
    procs = {}
    try:
        for i, (overrides, devices, _) in enumerate(_BAD_CONFIGS):
            log_dir = tmp_path_factory.mktemp(f"bad{i}")
            procs[i] = (subprocess.Popen(
                _cmd("default.yaml", f"logging.dir={log_dir}", *overrides), env=_env(devices),
                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), log_dir)
        procs["missing"] = (subprocess.Popen(
            _cmd("no_such.yaml"), env=_env(), cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True), None)
        procs["help"] = (subprocess.Popen(
            [sys.executable, "-m", "jaxdist.train", "--help"], env=_env(), cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), None)
        runs = {}
        for key, (proc, log_dir) in procs.items():
            stdout, stderr = proc.communicate(timeout=120)
            runs[key] = (subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr),
                         log_dir)
        return runs
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("index, message", [(i, m) for i, (_, _, m) in enumerate(_BAD_CONFIGS)])
def test_bad_config_exits_2(index, message, cli_runs):
    out, log_dir = cli_runs[index]
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert not list(log_dir.rglob("metrics.jsonl"))  # nothing ran


@pytest.mark.slow
def test_missing_config_file_exits_2(cli_runs):
    out, _ = cli_runs["missing"]
    assert out.returncode == 2 and "no such file" in out.stderr


def _final_params(ckpt_dir, step):
    """The checkpoint's arrays, read onto this process's first device: the subprocesses wrote
    them from their own 2 devices, which this process need not have."""
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from jaxdist.train import Checkpointer

    ckpt = Checkpointer(ckpt_dir)
    assert ckpt.latest_step() == step
    stored = ocp.StandardCheckpointHandler().metadata(pathlib.Path(ckpt_dir) / str(step) / "state")
    stored = getattr(stored, "tree", stored)
    like = jax.tree.map(lambda m: jnp.zeros(m.shape, m.dtype), stored)
    state, meta = ckpt.restore(step, like=like)
    return [np.asarray(x) for x in jax.tree.leaves(state)], meta


@pytest.mark.slow
def test_sigkill_then_restart_equals_uninterrupted(tmp_path):
    steps_total = 160
    common = ["data.name=synthetic", "data.num_examples=2000", "data.num_features=16",
              "model.hidden_sizes=[32]", "train.global_batch_size=16",
              f"train.steps={steps_total}", "train.validation_freq=0",
              "checkpoint.every_steps=20", "checkpoint.keep=2", "logging.every_steps=50"]
    # The uninterrupted run and the run to kill are independent: they run at the same time.
    straight = tmp_path / "straight"
    straight_proc = subprocess.Popen(
        _cmd("mirrored.yaml", *common, f"checkpoint.dir={straight / 'ckpt'}",
             f"logging.dir={straight}"),
        env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    killed = tmp_path / "killed"
    ckpt = killed / "ckpt"
    cmd = _cmd("mirrored.yaml", *common, f"checkpoint.dir={ckpt}", f"logging.dir={killed}")
    proc = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            done = [p for p in ckpt.glob("*") if p.name.isdigit()] if ckpt.exists() else []
            if any(int(p.name) >= 40 for p in done):
                break
            assert proc.poll() is None, "training ended before it could be killed"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        _, straight_err = straight_proc.communicate(timeout=120)
    finally:
        for p in (proc, straight_proc):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert straight_proc.returncode == 0, straight_err[-2000:]
    assert proc.returncode == -signal.SIGKILL
    steps = sorted(int(p.name) for p in ckpt.glob("*") if p.name.isdigit())
    assert steps and steps[-1] < steps_total, steps

    out = _run("mirrored.yaml", *common, f"checkpoint.dir={ckpt}", f"logging.dir={killed}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"Resumed from checkpoint at step {steps[-1]}" in out.stdout

    a, meta_a = _final_params(straight / "ckpt", steps_total)
    b, meta_b = _final_params(ckpt, steps_total)
    assert meta_a == meta_b
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_nan_loss_exits_nonzero_and_keeps_last_good_checkpoint(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((128, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    x[96:] = np.nan  # with shuffle off, steps 1-6 are fine and step 7 sees NaN
    path = tmp_path / "data.npz"
    np.savez(path, x=x, y=y, x_val=x[:32], y_val=y[:32])
    out = _run("one_device.yaml", "data.name=npz", f"data.path={path}", "data.shuffle=false",
               "model.name=mlp", "model.hidden_sizes=[8]", "train.global_batch_size=16",
               "train.epochs=3", "checkpoint.every_steps=2", f"checkpoint.dir={tmp_path / 'c'}",
               f"logging.dir={tmp_path}")
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "loss is nan at step 7 (halt_on_nan); the last good checkpoint is step 6" in lines[0]
    params, meta = _final_params(tmp_path / "c", 6)
    assert meta["step"] == 6 and all(np.isfinite(p).all() for p in params)
