"""The Trainer under ParameterServerStrategy: in-process (no cluster), configs, and a real
``jaxdist.launch --workers 2 --ps 2`` cluster end to end."""

import json
import os
import pathlib
import subprocess
import sys
import time
from types import SimpleNamespace

import jax
import numpy as np
import optax
import pytest
from devutil import first_devices, xla_flags

import jaxdist
from jaxdist._src.cluster.task_info import TaskInfo
from jaxdist._src.job.cli import main as train_main
from jaxdist._src.job.config import ConfigError, load_config
from jaxdist._src.job.job import run_job
from jaxdist._src.job.parameter_server import ps_optimizer_from_config
from jaxdist._src.ps import optimizers as O
from jaxdist._src.train.metrics import read_metrics
from jaxdist._src.train.parameter_server.between_graph import ParameterServerHook

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "parameter_server.yaml"


@pytest.fixture(autouse=True)
def _no_cluster(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)


def _local_strategy():
    return jaxdist.ParameterServerStrategy(compute_devices=first_devices(2), timeout=30.0)


def _cfg(tmp_path, *overrides):
    return load_config(CONFIG, [f"logging.dir={tmp_path / 'logs'}", "logging.tensorboard=false",
                                f"checkpoint.dir={tmp_path / 'ckpt'}",
                                "logging.progress_bar=never", *overrides])


@pytest.fixture(scope="module")
def six_epochs(tmp_path_factory):
    """One in-process 6-epoch run, shared: one test reads it, the other resumes from its ps
    checkpoint (one run fewer)."""
    tmp_path = tmp_path_factory.mktemp("ps_job")
    t0 = time.monotonic()
    history = run_job(_cfg(tmp_path, "train.epochs=6"), strategy=_local_strategy())
    wall = time.monotonic() - t0
    pointer = json.loads((tmp_path / "ckpt" / "checkpoint").read_text())
    task_dirs = [d for d in (tmp_path / "ckpt").iterdir() if d.is_dir()]
    kept = [sorted(int(d.name[5:]) for d in t.iterdir() if d.name.startswith("ckpt-"))
            for t in task_dirs]
    return {"path": tmp_path, "history": history, "wall": wall, "pointer": pointer,
            "kept": kept}


@pytest.mark.timing
def test_in_process_training_takes_under_two_minutes(six_epochs):
    """A speed claim (deselected by default): six epochs under the in-process ps."""
    assert six_epochs["wall"] < 120


def test_in_process_training_reaches_the_accuracy_bar(six_epochs):
    history = six_epochs["history"]
    assert history.history["val_accuracy"][-1] >= 0.95, history.history
    end = history.records[-1]
    assert end["event"] == "end"
    assert end["step"] == 6 * (1437 // 32)
    # the chief asked the (in-process) ps to checkpoint at the end
    assert six_epochs["pointer"]["step"] == end["step"]
    # checkpoint.keep (3) prunes the ps checkpoints: the newest three, the final one included
    (kept,) = six_epochs["kept"]
    assert len(kept) == 3 and kept[-1] == end["step"], kept


def test_in_process_resume_from_the_ps_checkpoint(six_epochs):
    history = run_job(_cfg(six_epochs["path"], "train.epochs=7"), strategy=_local_strategy())
    steps = [r["step"] for r in history.records]
    spe = 1437 // 32
    assert min(steps) > 6 * spe and max(steps) == 7 * spe   # continued after epoch 6, not 0
    assert history.history["val_accuracy"][-1] > 0.8


def test_trainer_api_with_a_ps_optimizer_spec_and_steps_per_execution():
    from flax import nnx

    from jaxdist._src.job.data import load_digits
    from jaxdist._src.job.models import MLP

    train, val = load_digits(0.2, 0)
    (x, y), (xv, yv) = (train.x, train.y), (val.x, val.y)
    strategy = _local_strategy()
    with strategy.scope():
        model = MLP(int(np.prod(x.shape[1:])), [64], 10, rngs=nnx.Rngs(0))
        trainer = jaxdist.Trainer(model, O.chain(O.clip_by_global_norm(5.0), O.adam(3e-3)),
                                  global_batch_size=32, strategy=strategy,
                                  steps_per_execution=4, log_dir=None, progress_bar="never")
    trainer.fit((x, y), epochs=4)
    assert trainer.step == 4 * (len(x) // 32)
    assert trainer.evaluate((xv, yv))["accuracy"] > 0.9
    assert trainer.predict(xv[:5]).shape == (5, 10)


def test_a_raw_optax_optimizer_is_rejected_under_parameter_servers():
    from flax import nnx

    from jaxdist._src.job.models import MLP

    with pytest.raises(ValueError, match="raw optax GradientTransformation cannot be split"):
        jaxdist.Trainer(MLP(4, [8], 3, rngs=nnx.Rngs(0)), optax.adam(1e-3),
                        global_batch_size=8, strategy=_local_strategy())


def test_config_optimizer_becomes_a_ps_spec():
    base = {"learning_rate": 0.1, "momentum": 0.0, "weight_decay": 1e-4, "clipnorm": None}
    assert ps_optimizer_from_config({**base, "name": "adam"}).to_json() == \
        O.adam(0.1).to_json()
    assert ps_optimizer_from_config({**base, "name": "sgd", "momentum": 0.9}).to_json() == \
        O.sgd(0.1, momentum=0.9).to_json()
    spec = ps_optimizer_from_config({**base, "name": "adamw", "clipnorm": 1.0})
    assert spec.worker_part().name == "clip_by_global_norm" and spec.ps_part().name == "adamw"
    with pytest.raises(ConfigError, match="optimizer.name: 'lamb' cannot run on a parameter "
                                          "server.*expected one of: sgd, adam"):
        ps_optimizer_from_config({**base, "name": "lamb"})


@pytest.mark.parametrize("overrides, message", [
    (["strategy.max_stalenes=1"], "strategy.max_stalenes: unknown key for strategy "
                                  "'parameter_server'; valid keys: max_staleness"),
    (["strategy.max_staleness=-1"], "strategy.max_staleness: -1 is too small"),
    (["strategy.placement=random"], "strategy.placement: 'random' is not valid; expected one "
                                    "of: round_robin, greedy"),
    (["strategy.variable_partitioner=fixed_shards"], "needs num_shards"),
    (["strategy.timeout=0"], "timeout must be > 0"),
])
def test_bad_strategy_configs_exit_2(overrides, message, capsys):
    args = ["--config", str(CONFIG), "--set", "logging.dir=null", "--set", "checkpoint.dir=null"]
    for o in overrides:
        args += ["--set", o]
    assert train_main(args) == 2
    err = capsys.readouterr().err
    assert "config error" in err and message in err, err


def _fake_strategy(task_type, task_id, workers=2):
    info = TaskInfo({"ps": ["a:1"], "worker": [f"w:{i}" for i in range(workers)]},
                    task_type, task_id, "t")
    ext = SimpleNamespace(task_info=info, worker_index=info.worker_index,
                          should_checkpoint=info.is_chief)
    return SimpleNamespace(extended=ext)


def test_each_worker_gets_a_disjoint_deterministic_share_of_every_epoch():
    trainer = SimpleNamespace(seed=3, shuffle=True)
    hooks = [ParameterServerHook(_fake_strategy("worker", i, workers=3)) for i in range(3)]
    assert [h.should_evaluate for h in hooks] == [True, False, False]
    for epoch in (0, 1):
        shares = [h.epoch_order(trainer, 100, epoch) for h in hooks]
        assert [len(s) for s in shares] == [33, 33, 33]
        assert len(set(np.concatenate(shares).tolist())) == 99
        again = hooks[1].epoch_order(trainer, 100, epoch)
        np.testing.assert_array_equal(again, shares[1])
    assert not np.array_equal(hooks[0].epoch_order(trainer, 100, 0),
                              hooks[0].epoch_order(trainer, 100, 1))


def _env():
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1",
               XLA_FLAGS=xla_flags(1))
    return env


@pytest.mark.slow
def test_launch_two_workers_two_ps_end_to_end(tmp_path):
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "jaxdist.launch", "--workers", "2", "--ps", "2", "--",
           sys.executable, "-m", "jaxdist.train", "--config", str(CONFIG),
           "--set", f"logging.dir={logs}", "--set", f"checkpoint.dir={ckpt}",
           "--set", "logging.tensorboard=false", "--set", "logging.progress_bar=never",
           "--set", "train.epochs=10"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    wall = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    records = read_metrics(logs)
    val = [r for r in records if r["event"] == "validation"]
    end = records[-1]
    assert end["event"] == "end"
    assert end["val_accuracy"] >= 0.95, (end, wall)
    assert end["step"] == 10 * (1437 // 2 // 32)
    assert val
    # both ps tasks served, were stopped by the launcher, and hold the final checkpoint
    for i in (0, 1):
        assert f"[ps:{i}] jaxdist.server ps:{i} stopped" in out, out[-3000:]
        assert (ckpt / f"ps-{i}" / f"ckpt-{end['step']}").is_dir()
        assert len(list((ckpt / f"ps-{i}").glob("ckpt-*"))) <= 3   # checkpoint.keep
    assert "all training tasks finished" in out
    # worker:1 trained (pushed) but wrote nothing: one config.yaml and the chief's metrics only
    (run,) = logs.iterdir()  # one run directory: the chief's
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "metrics.jsonl"]
    assert not any(line.startswith("[worker:1] [") for line in out.splitlines())


# ---------------------------------------------------------------------- metrics, LR, weights
def _binary_data(n=96, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    y = (x[:, 0] + 0.5 * rng.normal(size=n) > 0).astype(np.int32)
    return x, y


def _small_trainer(strategy, optimizer, **kwargs):
    from flax import nnx

    from jaxdist._src.job.models import MLP
    from jaxdist._src.train.keras_metrics import SparseTopKCategoricalAccuracy

    with strategy.scope():
        return jaxdist.Trainer(
            MLP(6, [8], 2, rngs=nnx.Rngs(0)), optimizer, global_batch_size=16,
            strategy=strategy, log_dir=None, progress_bar="never", log_every_steps=3,
            metrics=["accuracy", "auc", SparseTopKCategoricalAccuracy(k=1, name="top1")],
            weighted_metrics=["accuracy", "auc"], **kwargs)


@pytest.mark.devices(2)
def test_every_metric_is_computed_under_ps_and_equals_the_synchronous_trainers():
    """One in-process worker on the strategy's 2 devices runs the same steps as
    MirroredStrategy on them: loss, accuracy, AUC and top-k (and sample weights) agree."""
    x, y = _binary_data()
    w = np.linspace(0.5, 1.5, len(y)).astype(np.float32)
    ps = _small_trainer(_local_strategy(), O.sgd(0.1))
    sync = _small_trainer(jaxdist.MirroredStrategy(jax.devices()[:2]), optax.sgd(0.1))
    h_ps = ps.fit((x, y), epochs=2, sample_weight=w, validation_data=(x[:40], y[:40]),
                  verbose=0)
    h_sync = sync.fit((x, y), epochs=2, sample_weight=w, validation_data=(x[:40], y[:40]),
                      verbose=0)
    for key in ("loss", "accuracy", "auc", "top1", "val_loss", "val_auc", "val_top1",
                "weighted_accuracy", "weighted_auc", "val_weighted_auc"):
        assert key in h_ps.history, (key, sorted(h_ps.history))
        np.testing.assert_allclose(h_ps.history[key], h_sync.history[key], rtol=1e-4,
                                   atol=1e-5, err_msg=key)
    assert 0.5 < h_ps.history["auc"][-1] <= 1.0


@pytest.mark.devices(2)
def test_learning_rate_and_set_weights_reach_the_parameter_servers(tmp_path):
    from jaxdist._src.train.callbacks import ReduceLROnPlateau

    x, y = _binary_data()
    trainer = _small_trainer(_local_strategy(), O.sgd(0.1), checkpoint_dir=str(tmp_path))
    assert trainer.learning_rate == pytest.approx(0.1)
    trainer.learning_rate = 0.0             # a rate of 0: a step changes nothing
    before = trainer.get_weights()
    trainer.fit((x, y), steps=2, verbose=0)
    after = trainer.get_weights()
    jax.tree.map(np.testing.assert_array_equal, before["params"], after["params"])
    # set_weights assigns the ps variables; the next pull sees them
    zeros = jax.tree.map(np.zeros_like, after["params"])
    trainer.set_weights({"params": zeros, "rest": after["rest"]})
    jax.tree.map(np.testing.assert_array_equal, trainer.get_weights()["params"], zeros)
    # ReduceLROnPlateau on a loss that never improves by 10 after the first epoch: halves
    # the rate at the end of epochs 1 and 2 (the logs show the rate each epoch ran with)
    trainer.learning_rate = 0.2
    history = trainer.fit((x, y), epochs=3, verbose=0, callbacks=[
        ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1, min_delta=10.0)])
    assert history.history["learning_rate"] == pytest.approx([0.2, 0.2, 0.1]), history.history
    assert trainer.learning_rate == pytest.approx(0.05)
    # the ps checkpoints the changed rate with the optimizer
    trainer.save_checkpoint()
    fresh = jaxdist.ParameterServerStrategy(compute_devices=jax.devices()[:2], timeout=30.0)
    fresh.extended.restore(str(tmp_path))
    restored = _small_trainer(fresh, O.sgd(0.1))
    assert restored.learning_rate == pytest.approx(0.05)


def test_a_scheduled_ps_learning_rate_cannot_be_changed():
    from jaxdist._src.ps.errors import PSInvalidArgumentError

    trainer = _small_trainer(_local_strategy(), O.sgd(O.exponential_decay(0.1, 10, 0.5)))
    assert trainer.current_learning_rate() is None
    with pytest.raises(ValueError, match="follows a schedule on the ps"):
        trainer.learning_rate  # noqa: B018
    with pytest.raises(PSInvalidArgumentError, match="follows a schedule"):
        trainer.learning_rate = 0.01


@pytest.mark.devices(2)
def test_a_stream_trains_under_between_graph_as_under_a_synchronous_strategy():
    """Each worker reads the stream it is given; with one worker that is every batch."""
    x, y = _binary_data(64)
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]
    ps = _small_trainer(_local_strategy(), O.sgd(0.1))
    sync = _small_trainer(jaxdist.MirroredStrategy(jax.devices()[:2]), optax.sgd(0.1))
    ps.fit((b for b in batches), steps_per_epoch=4, epochs=1, verbose=0)
    sync.fit((b for b in batches), steps_per_epoch=4, epochs=1, verbose=0)
    assert ps.step == 4
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 ps.get_weights()["params"], jax.device_get(sync.get_weights()["params"]))
