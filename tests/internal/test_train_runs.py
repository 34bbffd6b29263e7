"""Runs: each fit writes into its own run directory, the start-up line, Keras' verbose, and
the CLI's --run-name, strategy.name override, stale TF_CONFIG and launch errors."""

import io
import json
import os
import pathlib
import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist
from jaxdist._src.job.cli import main as train_main
from jaxdist._src.job.config import load_config
from jaxdist._src.job.models import MLP
from jaxdist._src.train import runs
from jaxdist._src.train.metrics import MetricsLogger, read_metrics
from jaxdist._src.train.trainer import Trainer

ROOT = pathlib.Path(__file__).resolve().parents[2]
GBS = 16


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    return x, y


def _trainer(**kw):
    strategy = kw.pop("strategy", None) or jaxdist.OneDeviceStrategy(jax.devices()[0])
    kw.setdefault("log_every_steps", 2)
    with strategy.scope():
        return Trainer(MLP(5, [4], 2, rngs=nnx.Rngs(0)), optax.sgd(0.1), global_batch_size=GBS,
                       strategy=strategy, **kw)


def test_new_run_dir_is_fresh_and_never_reused(tmp_path):
    a, b = runs.new_run_dir(tmp_path), runs.new_run_dir(tmp_path)
    assert a != b and re.fullmatch(r"\d{8}-\d{6}(-\d+)?", os.path.basename(b))
    named = runs.new_run_dir(tmp_path, "baseline")
    assert named == str(tmp_path / "baseline")
    (tmp_path / "baseline" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(runs.RunDirError, match="already holds a run"):
        runs.new_run_dir(tmp_path, "baseline")
    with pytest.raises(runs.RunDirError, match="not valid"):
        runs.new_run_dir(tmp_path, "a/b")
    assert runs.latest_run(tmp_path) == named
    with pytest.raises(runs.RunDirError, match="no run under"):
        runs.latest_run(tmp_path / "empty")


def test_two_trainers_write_two_runs_that_tensorboard_overlays(data, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = _trainer(log_dir=tmp_path)
    first.fit(data, epochs=2, validation_data=data, verbose=1)
    second = _trainer(log_dir=tmp_path, run_name="again")
    second.fit(data, epochs=1, verbose=1)
    assert first.run_dir != second.run_dir == str(tmp_path / "again")
    assert sorted(runs.list_runs(tmp_path)) == sorted([first.run_dir, second.run_dir])
    # every run starts at its own step 0: no file was appended to
    for run, last in ((first.run_dir, 8), (second.run_dir, 4)):
        steps = [r["step"] for r in read_metrics(run) if r["event"] == "train"]
        assert steps[0] == 2 and steps[-1] == last, steps
        assert os.path.isfile(os.path.join(run, "train", os.listdir(
            os.path.join(run, "train"))[0]))
    tags = {}
    for phase in ("train", "validation"):
        acc = EventAccumulator(os.path.join(first.run_dir, phase))
        acc.Reload()
        tags[phase] = set(acc.Tags()["scalars"])
    assert {"loss", "accuracy"} <= tags["train"] & tags["validation"]
    assert "learning_rate" not in tags["train"]  # optax.sgd(0.1) has no injected rate
    out = capsys.readouterr().out
    line = [ln for ln in out.splitlines() if ln.startswith("jaxdist: ")][0]
    kind = jax.devices()[0].platform
    assert line == (f"jaxdist: OneDeviceStrategy with 1 replica(s) on 1 {kind} device(s), "
                    f"1 process(es); writing to {first.run_dir}")
    # a later fit of the same trainer continues its run (the steps go on)
    first.fit(data, epochs=3, verbose=0)
    steps = [r["step"] for r in read_metrics(first.run_dir) if r["event"] == "train"]
    assert steps == sorted(steps) and steps[-1] == 12


@pytest.mark.devices(4)
def test_startup_line_names_replicas_devices_and_processes(data, capsys):
    devs = jax.devices()[:4]  # 4, or as many as exist
    n, kind = len(devs), devs[0].platform
    t = _trainer(strategy=jaxdist.MirroredStrategy(devs), progress_bar="never")
    t.fit(data, epochs=1, verbose=1)
    out = capsys.readouterr().out
    assert (f"jaxdist: MirroredStrategy with {n} replica(s) on {n} {kind} device(s), "
            "1 process(es); writing to nowhere (no log_dir)") in out


@pytest.mark.parametrize("verbose", [0, 1, 2])
def test_verbose_as_keras(verbose, data, capsys):
    t = _trainer(progress_bar="never")
    t.fit(data, epochs=2, validation_data=data, verbose=verbose)
    out = capsys.readouterr().out
    epoch_lines = [ln for ln in out.splitlines() if ln.startswith("Epoch ")]
    if verbose == 0:
        assert out == ""
    elif verbose == 1:
        assert "[train] step 2" in out and "[validation]" in out and not epoch_lines
    else:
        assert len(epoch_lines) == 2 and "[train]" not in out
        assert re.match(r"Epoch 2/2 - [\d.]+s - loss: [\d.]+ - accuracy: [\d.]+ - "
                        r"val_loss: [\d.]+ - val_accuracy: [\d.]+$", epoch_lines[1])
    with pytest.raises(ValueError, match="verbose=3"):
        t.fit(data, epochs=3, verbose=3)


def test_epoch_progress_bar_on_a_terminal(tmp_path):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    logger = MetricsLogger(None, stream=out, per_epoch_bar=True)
    for epoch in range(2):
        logger.begin_epoch(epoch, 2, 4)
        logger.advance(4)
        logger.end_epoch(epoch, 2, {"loss": 0.5}, 1.0)
    logger.close()
    text = out.getvalue()
    assert "Epoch 1/2" in text and "Epoch 2/2" in text and "4/4" in text


def _cli(tmp_path, *sets, run_name=None, config="default.yaml"):
    argv = ["--config", str(ROOT / "configs" / config)]
    for s in ("data.name=synthetic", "data.num_examples=128", "data.num_features=6",
              "model.name=mlp",
              "model.hidden_sizes=[4]", "train.global_batch_size=16", "train.steps=2",
              "train.validation_freq=0", "logging.tensorboard=false",
              "logging.progress_bar=never", f"logging.dir={tmp_path}", "checkpoint.dir=null",
              *sets):
        argv += ["--set", s]
    if run_name:
        argv += ["--run-name", run_name]
    return train_main(argv)


def test_cli_run_name_and_stale_tf_config(tmp_path, capsys, monkeypatch):
    # A TF_CONFIG left in the environment is read only by the strategies that use it.
    monkeypatch.setenv("TF_CONFIG", "not json")
    assert _cli(tmp_path, run_name="first", config="one_device.yaml") == 0
    run = tmp_path / "first"
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "metrics.jsonl"]
    assert [json.loads(ln)["event"] for ln in (run / "metrics.jsonl").read_text().splitlines()
            ][-1] == "end"
    capsys.readouterr()
    assert _cli(tmp_path, run_name="first", config="one_device.yaml") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a run" in err[0], err


def test_cli_strategy_name_override_drops_foreign_keys(capsys):
    code = train_main(["--config", str(ROOT / "configs" / "mirrored.yaml"),
                       "--set", "strategy.name=one_device", "--print-config"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert ("note: strategy.name=one_device does not take strategy.devices, "
            "strategy.cross_device_ops, strategy.num_packs; dropped them") in captured.err
    assert "strategy:\n  name: one_device\n  device: null\n" in captured.out
    # a key given on the command line is kept, and validated
    code = train_main(["--config", str(ROOT / "configs" / "mirrored.yaml"),
                       "--set", "strategy.name=one_device", "--set", "strategy.devices=[a]"])
    assert code == 2 and "strategy.devices: unknown key" in capsys.readouterr().err
    notes = []
    cfg = load_config(ROOT / "configs" / "mirrored.yaml", ["strategy.name=central_storage"],
                      notes=notes)
    assert cfg["strategy"]["devices"] is None  # central_storage takes devices: kept
    assert notes == ["strategy.name=central_storage does not take strategy.cross_device_ops, "
                     "strategy.num_packs; dropped them from the config"]


def test_launch_missing_command_is_one_line(capsys):
    from jaxdist.launch import main as launch_main

    assert launch_main(["--", "no-such-command-xyz", "--flag"]) == 127
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "command not found: 'no-such-command-xyz'" in err[0]
