"""Side-car evaluator: TF_CONFIG's ``evaluator`` task evaluates the chief's checkpoints."""

import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import pytest

from jaxdist._src.train.evaluator import EvaluatorTimeoutError, SidecarEvaluator, evaluator_task
from jaxdist._src.train.runs import latest_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tf_config(task_type, index=0):
    return json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"],
                                   "evaluator": ["127.0.0.1:3"]},
                       "task": {"type": task_type, "index": index}})


def test_evaluator_task_is_read_from_tf_config():
    assert evaluator_task({"TF_CONFIG": _tf_config("evaluator")}) == "evaluator:0"
    assert evaluator_task({"TF_CONFIG": _tf_config("worker", 1)}) is None
    assert evaluator_task({}) is None


def test_idle_timeout_is_a_typed_error_naming_the_directory(tmp_path):
    import numpy as np
    import optax
    from flax import nnx

    import jaxdist
    from jaxdist._src.job.models import MLP

    strategy = jaxdist.OneDeviceStrategy(jax.devices()[0])
    with strategy.scope():
        trainer = jaxdist.Trainer(MLP(4, [8], 3, rngs=nnx.Rngs(0)), optax.sgd(0.1),
                                  global_batch_size=4, progress_bar="never")
    data = (np.zeros((8, 4), np.float32), np.zeros((8,), np.int32))
    ev = SidecarEvaluator(trainer, data, str(tmp_path / "ckpt"), final_step=10,
                          poll_seconds=0.05, idle_timeout_seconds=0.3)
    start = time.monotonic()
    with pytest.raises(EvaluatorTimeoutError, match=r"evaluator:0: no new checkpoint in .*ckpt "
                       r"within 0.3 s \(no checkpoint yet; expected up to step 10\)"):
        ev.start()
    assert time.monotonic() - start < 30  # a hang guard: the 0.3 s idle timeout ended it
    assert not (tmp_path / "ckpt").exists()  # read only: nothing created


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_launcher_evaluator_evaluates_each_new_checkpoint(tmp_path):
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("TF_CONFIG", None)
    cmd = [sys.executable, "-m", "jaxdist.launch", "--workers", "2", "--evaluator",
           "--devices-per-process", "2", "--evaluator-grace", "60", "--",
           sys.executable, "-m", "jaxdist.train", "--config", "configs/multi_worker.yaml"]
    for s in ("train.epochs=2", f"checkpoint.dir={ckpt}", "checkpoint.every_steps=20",
              f"logging.dir={logs}", "logging.progress_bar=never",
              "evaluator.poll_seconds=0.2", "evaluator.idle_timeout_seconds=60"):
        cmd += ["--set", s]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=140)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "[evaluator:0] evaluator:0: evaluated the final checkpoint (step 44); done" in out
    with open(logs / "eval" / "metrics.jsonl") as f:
        evals = [json.loads(line) for line in f]
    steps = [r["step"] for r in evals]
    assert all(r["event"] == "evaluation" for r in evals)
    assert steps == sorted(set(steps)) and steps[-1] == 44
    assert set(steps) <= {20, 40, 44}
    assert list((logs / "eval").rglob("events.out.tfevents.*"))
    with open(pathlib.Path(latest_run(logs)) / "metrics.jsonl") as f:
        chief = [json.loads(line) for line in f]
    end = [r for r in chief if r["event"] == "end"][0]
    # the evaluator restored the chief's final weights: the same validation result
    assert evals[-1]["accuracy"] == pytest.approx(end["val_accuracy"], abs=1e-6)
    assert evals[-1]["loss"] == pytest.approx(end["val_loss"], rel=1e-4)
    # the evaluator stayed out of the training cluster and trained nothing
    assert "[evaluator:0] [train]" not in out


def test_ps_checkpoint_reader_reassembles_partitioned_leaves(tmp_path):
    import numpy as np

    from jaxdist._src.ps.checkpoints import PSCheckpointReader, write_checkpoint_pointer
    from jaxdist._src.ps.service import ParameterService
    from jaxdist._src.train.evaluator import PSCheckpointState

    w = np.arange(15, dtype=np.float32).reshape(5, 3)
    b = np.array([7.0], np.float32)
    ps0, ps1 = ParameterService("ps:0"), ParameterService("ps:1")
    ps0.create({"model/dense/w/part_0": w[:3], "model/dense/b": b}, {})
    ps1.create({"model/dense/w/part_1": w[3:]}, {})
    like = {"dense": {"w": np.zeros((5, 3), np.float32), "b": np.zeros(1, np.float32)}}
    reader = PSCheckpointReader(str(tmp_path))
    assert reader.latest_step() is None
    for svc in (ps0, ps1):
        svc.save(str(tmp_path), 10)
    assert reader.latest_step() is None          # not complete until the chief marks it
    write_checkpoint_pointer(str(tmp_path), 10)
    assert reader.latest_step() == 10 and not reader.is_final(10)
    got = reader.restore_tree(10, like)
    np.testing.assert_array_equal(got["dense"]["w"], w)
    np.testing.assert_array_equal(got["dense"]["b"], b)
    write_checkpoint_pointer(str(tmp_path), 10, final=True)
    assert reader.is_final(10)
    state, meta = PSCheckpointState(str(tmp_path), steps_per_epoch=4).restore(
        10, {"params": like, "rest": {}, "opt_state": None})
    np.testing.assert_array_equal(state["params"]["dense"]["w"], w)
    assert meta == {"step": 10, "epoch": 2}
    with pytest.raises(ValueError, match="has no variable 'model/dense/k'"):
        reader.restore_tree(10, {"dense": {"k": np.zeros(1)}})
    with pytest.raises(ValueError, match=r"has shape \(5, 3\), expected \(4, 3\)"):
        reader.restore_tree(10, {"dense": {"w": np.zeros((4, 3)), "b": np.zeros(1)}})


@pytest.mark.slow
def test_launcher_evaluator_reads_parameter_server_checkpoints(tmp_path):
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("TF_CONFIG", None)
    cmd = [sys.executable, "-m", "jaxdist.launch", "--workers", "2", "--ps", "2",
           "--evaluator", "--evaluator-grace", "60", "--",
           sys.executable, "-m", "jaxdist.train", "--config", "configs/parameter_server.yaml"]
    for s in ("train.epochs=2", f"checkpoint.dir={ckpt}", "checkpoint.every_steps=20",
              "checkpoint.keep=2", f"logging.dir={logs}", "logging.progress_bar=never",
              "evaluator.poll_seconds=0.2", "evaluator.idle_timeout_seconds=60"):
        cmd += ["--set", s]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    final = 2 * (1437 // 2 // 32)   # the chief's steps: its half of every epoch
    assert f"evaluator:0: evaluated the final checkpoint (step {final}); done" in out, out[-3000:]
    with open(logs / "eval" / "metrics.jsonl") as f:
        evals = [json.loads(line) for line in f]
    steps = [r["step"] for r in evals]
    assert steps == sorted(set(steps)) and steps[-1] == final
    with open(pathlib.Path(latest_run(logs)) / "metrics.jsonl") as f:
        end = [r for r in map(json.loads, f) if r["event"] == "end"][0]
    # the evaluator reassembled the ps shards of the chief's final weights
    assert evals[-1]["accuracy"] == pytest.approx(end["val_accuracy"], abs=1e-6)
    assert evals[-1]["loss"] == pytest.approx(end["val_loss"], rel=1e-4)
    assert json.loads((ckpt / "checkpoint").read_text()) == {"step": final, "final": True}
    for i in (0, 1):   # checkpoint.keep=2 pruned the ps checkpoints
        assert len(list((ckpt / f"ps-{i}").glob("ckpt-*"))) <= 2
