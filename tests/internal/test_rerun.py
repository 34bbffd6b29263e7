"""A rerun never silently does nothing: the settings recorded with a checkpoint, a changed global
batch, a finished checkpoint, a one-process strategy under a cluster, a checkpoint directory
that cannot be written (``python -m jaxdist.train`` in-process and the ``Trainer``; CPU, any
number of devices)."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import optax
import pytest
from devutil import xla_flags
from flax import nnx

import jaxdist
from jaxdist._src.job.cli import main
from jaxdist._src.job.interrupt import main_module
from jaxdist._src.train.run_record import RECORD_FILE
from jaxdist.train import (
    CheckpointMismatchError,
    SettingsChangedError,
    Trainer,
    TrainingCompleteError,
    read_metrics,
)

ROOT = pathlib.Path(__file__).parent.parent.parent


def _train(tmp_path, capsys, *sets, config="one_device.yaml"):
    """Runs ``python -m jaxdist.train`` in this process on a small MLP; returns (status,
    stdout, stderr)."""
    args = ["--config", str(ROOT / "configs" / config)]
    for s in (f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'runs'}",
              "model.name=mlp", "logging.verbose=2", "logging.tensorboard=false",
              "train.epochs=1", *sets):
        args += ["--set", s]
    status = main(args)
    out = capsys.readouterr()
    return status, out.out, out.err


def _record(tmp_path):
    return json.loads((tmp_path / "ckpt" / RECORD_FILE).read_text())


def _runs(tmp_path):
    return sorted((tmp_path / "runs").iterdir())


def test_rerun_with_other_settings_stops_before_training(tmp_path, capsys):
    assert _train(tmp_path, capsys)[0] == 0
    record = _record(tmp_path)
    assert record["settings"]["optimizer.learning_rate"] == 0.01
    assert record["position"] == {"step": 22, "epoch": 1, "step_in_epoch": 0}
    status, out, err = _train(tmp_path, capsys, "train.epochs=2",
                              "optimizer.learning_rate=0.1", "model.hidden_sizes=[64]")
    assert status == 2, err
    (line,) = err.strip().splitlines()
    assert "checkpoint error: the checkpoint in" in line and "(step 22)" in line
    assert "model.hidden_sizes: [128] -> [64], optimizer.learning_rate: 0.01 -> 0.1" in line
    assert "checkpoint.allow_changes: [model.hidden_sizes, optimizer.learning_rate]" in line
    assert "another checkpoint.dir" in line
    assert len(_runs(tmp_path)) == 1                 # stopped before a run directory
    assert _record(tmp_path) == record


def test_allowed_change_is_applied_and_recorded(tmp_path, capsys):
    assert _train(tmp_path, capsys)[0] == 0
    status, out, err = _train(tmp_path, capsys, "train.epochs=2", "optimizer.learning_rate=0.1",
                              "checkpoint.allow_changes=[optimizer.learning_rate]")
    assert status == 0, err
    assert ("Note: resuming with changed settings (allowed by checkpoint.allow_changes): "
            "optimizer.learning_rate: 0.01 -> 0.1") in out
    record = _record(tmp_path)
    assert record["settings"]["optimizer.learning_rate"] == 0.1
    assert record["position"]["epoch"] == 2
    (change,) = record["changes"]
    assert change["changes"] == {"optimizer.learning_rate": [0.01, 0.1]}
    train = [r for r in read_metrics(tmp_path / "runs") if r["event"] == "train"]
    assert train and all(abs(r["learning_rate"] - 0.1) < 1e-6 for r in train)  # applied
    assert "allow_changes:\n  - optimizer.learning_rate" in \
        (_runs(tmp_path)[-1] / "config.yaml").read_text()


def test_unknown_allowed_change_is_a_config_error(tmp_path, capsys):
    status, _, err = _train(tmp_path, capsys, "checkpoint.allow_changes=[optimizer.lr]")
    assert status == 2
    assert "checkpoint.allow_changes: 'optimizer.lr' is not a recorded setting; expected " \
           "some of:" in err


def test_finished_rerun_says_so_and_exits_3(tmp_path, capsys):
    assert _train(tmp_path, capsys)[0] == 0
    (run,) = _runs(tmp_path)
    metrics = (run / "metrics.jsonl").read_text()
    status, out, err = _train(tmp_path, capsys)
    assert status == 3, err
    assert err.strip() == (f"python -m jaxdist.train: the checkpoint at step 22 in "
                           f"{tmp_path / 'ckpt'} already completes the configured 1 epochs: "
                           f"nothing to train; raise train.epochs to train further, use "
                           f"another checkpoint.dir to start anew, or set "
                           f"checkpoint.allow_finished=true (CheckpointConfig("
                           f"allow_finished=True)) to only evaluate it")
    assert _runs(tmp_path) == [run] and (run / "metrics.jsonl").read_text() == metrics
    status, out, err = _train(tmp_path, capsys, "checkpoint.allow_finished=true")
    assert status == 0, err                         # asked for: evaluates only
    assert _record(tmp_path)["position"]["step"] == 22
    status, out, err = _train(tmp_path, capsys, "train.epochs=2")    # raised: trains on
    assert status == 0, err
    assert _record(tmp_path)["position"] == {"step": 44, "epoch": 2, "step_in_epoch": 0}


def test_changed_global_batch_keeps_epochs_meaning_epochs(tmp_path, capsys):
    # 1437 examples: 22 steps of 64, 44 of 32. Stop at step 30 (epoch 1, step 8: 512
    # examples), then go on at 32 per step: step 16 of epoch 1, 28 + 44 more steps.
    assert _train(tmp_path, capsys, "train.steps=30")[0] == 0
    assert _record(tmp_path)["position"] == {"step": 30, "epoch": 1, "step_in_epoch": 8}
    status, out, err = _train(tmp_path, capsys, "train.epochs=3", "train.global_batch_size=32")
    assert status == 2 and "train.global_batch_size: 64 -> 32" in err
    status, out, err = _train(tmp_path, capsys, "train.epochs=3", "train.global_batch_size=32",
                              "checkpoint.allow_changes=[train.global_batch_size]")
    assert status == 0, err
    assert "step 8 of epoch 1 (512 examples) is now step 16 of epoch 1 (44 steps each)" in out
    assert _record(tmp_path)["position"] == {"step": 102, "epoch": 3, "step_in_epoch": 0}
    ends = [r for r in read_metrics(tmp_path / "runs") if r["event"] == "end"]
    assert ends[-1]["epoch"] == 3 and ends[-1]["step"] == 102


def test_a_record_without_checkpoints_describes_nothing(tmp_path, capsys):
    assert _train(tmp_path, capsys, "train.steps=10")[0] == 0
    for step in (tmp_path / "ckpt").iterdir():
        if step.name != RECORD_FILE:
            shutil.rmtree(step)
    status, out, err = _train(tmp_path, capsys, "train.steps=10", "optimizer.learning_rate=0.1")
    assert status == 0, err                          # a new run: no comparison, no resume
    assert _record(tmp_path)["settings"]["optimizer.learning_rate"] == 0.1


def test_old_checkpoint_without_a_record_resumes_with_a_note(tmp_path, capsys):
    assert _train(tmp_path, capsys, "train.steps=10")[0] == 0
    (tmp_path / "ckpt" / RECORD_FILE).unlink()
    status, out, err = _train(tmp_path, capsys, "optimizer.learning_rate=0.1")
    assert status == 0, err
    assert "has no record of the settings it was trained with" in out
    assert _record(tmp_path)["settings"]["optimizer.learning_rate"] == 0.1


@pytest.mark.parametrize("where, message", [
    ("file", "cannot be created: {tmp}/file is a file; expected a directory"),
    ("/proc/self/jaxdist-ckpt", "is not writable (its parent /proc/self is not)"),
])
def test_checkpoint_dir_that_cannot_be_written_exits_2(tmp_path, capsys, where, message):
    (tmp_path / "file").write_text("")
    if where.startswith("/proc") and not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux /proc")
    ckpt = where if where.startswith("/") else f"{tmp_path}/{where}/ckpt"
    status, out, err = _train(tmp_path, capsys, f"checkpoint.dir={ckpt}")
    assert status == 2
    (line,) = err.strip().splitlines()
    assert line.startswith(f"python -m jaxdist.train: config error: checkpoint.dir {ckpt!r} ")
    assert message.format(tmp=tmp_path) in line
    assert not (tmp_path / "runs").exists()          # before anything was built


def test_one_process_strategy_in_a_cluster_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"worker": ["localhost:1", "localhost:2"]},
        "task": {"type": "worker", "index": 1}}))
    status, out, err = _train(tmp_path, capsys)
    assert status == 2
    (line,) = err.strip().splitlines()
    assert ("config error: strategy.name: 'one_device' trains in one process, but TF_CONFIG "
            "(worker:1 of worker x2) starts 2 processes: each would train its own unrelated "
            "copy; expected a multi-process strategy: multi_worker (configs/multi_worker.yaml)"
            in line)
    assert not (tmp_path / "runs").exists()
    monkeypatch.delenv("TF_CONFIG")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", "0")
    status, out, err = _train(tmp_path, capsys)
    assert status == 2 and "srun (SLURM_STEP_NUM_TASKS=2, SLURM_PROCID=0) starts 2" in err


@pytest.mark.slow
def test_launch_of_a_one_process_config_is_refused(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1", XLA_FLAGS=xla_flags())
    out = subprocess.run(
        [sys.executable, "-m", "jaxdist.launch", "--workers", "2", "--", sys.executable, "-m",
         "jaxdist.train", "--config", str(ROOT / "configs" / "default.yaml"), "--set",
         f"logging.dir={tmp_path}"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "strategy.name: 'mirrored' trains in one process" in out.stdout + out.stderr
    assert not list(tmp_path.iterdir())               # neither copy trained


# --- the Trainer library ----------------------------------------------------------------------

class _MLP(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
        return self.dense(x)


def _fit(ckpt, batch, epochs=1, **checkpoint):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype(np.float32), rng.integers(0, 3, 64)
    trainer = Trainer(_MLP(nnx.Rngs(0)), optax.sgd(0.1),
                      strategy=jaxdist.OneDeviceStrategy("/cpu:0"),
                      checkpoint=jaxdist.train.CheckpointConfig(dir=str(ckpt), **checkpoint),
                      config=jaxdist.train.TrainConfig(global_batch_size=batch))
    trainer.fit((x, y), epochs=epochs, verbose=0)
    return trainer


def test_trainer_refuses_a_resume_with_another_global_batch(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert _fit(ckpt, 16, epochs=1).step == 4
    with pytest.raises(SettingsChangedError, match=r"train.global_batch_size: 16 -> 8") as e:
        _fit(ckpt, 8, epochs=2)
    assert isinstance(e.value, CheckpointMismatchError) and e.value.exit_code == 2
    assert e.value.differences == [("train.global_batch_size", 16, 8)]
    trainer = _fit(ckpt, 8, epochs=2, allow_changes=["train.global_batch_size"])
    assert (trainer.epoch, trainer.step) == (2, 4 + 8)
    with pytest.raises(TrainingCompleteError, match="already completes the configured 2 "
                                                    "epochs") as e:
        _fit(ckpt, 8, epochs=2)
    assert e.value.exit_code == 3
    assert _fit(ckpt, 8, epochs=2, allow_finished=True).step == 12


def test_main_module_reads_the_interpreter_command_line():
    assert main_module(["python", "-u", "-m", "jaxdist.train", "-c", "x.yaml"]) == \
        "jaxdist.train"
    assert main_module(["python", "-X", "dev", "-m", "jaxdist.train"]) == "jaxdist.train"
    assert main_module(["python", "-m", "pytest", "-m", "slow"]) == "pytest"
    assert main_module(["python", "train.py"]) is None
