"""The Trainer with a ClusterCoordinator (``strategy.name: parameter_server_coordinator``):
config errors, per-worker data shares, and real clusters: ``jaxdist.launch --coordinator``
end to end, resume from the ps checkpoint, and a worker killed in the middle of training."""

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from devutil import xla_flags

from jaxdist._src.input.options import InputContext
from jaxdist._src.job.cli import main as train_main
from jaxdist._src.train.data import epoch_order
from jaxdist._src.train.metrics import read_metrics
from jaxdist._src.train.parameter_server.coordinated import (
    CoordinatorHook,
    WorkerShard,
    worker_share,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "parameter_server_coordinator.yaml"
SPE = 2 * (1437 // 2 // 32)  # steps per epoch: 2 workers x 22 whole batches of their share


@pytest.fixture(autouse=True)
def _no_cluster(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)


# ---------------------------------------------------------------------- config errors
_CHIEF_ONLY = json.dumps({"cluster": {"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]},
                          "task": {"type": "chief", "index": 0}})


@pytest.mark.parametrize("overrides, tf_config, message", [
    ([], None, "TF_CONFIG is not set; start the job with python -m jaxdist.launch "
               "--coordinator"),
    ([], _CHIEF_ONLY, "needs chief, worker and ps jobs in TF_CONFIG; its cluster has "
                      "['chief', 'ps'] (missing worker)"),
    (["strategy.max_staleness=1"], None, "strategy.max_staleness: unknown key for strategy "
                                         "'parameter_server_coordinator'; valid keys:"),
    (["strategy.heartbeat_timeout=0.5"], None, "heartbeat_timeout (0.5) must be longer than "
                                               "heartbeat_interval (1.0)"),
    (["strategy.timeout=0"], None, "timeout must be > 0 seconds, got 0"),
    (["strategy.placement=random"], None, "strategy.placement: 'random' is not valid"),
])
def test_bad_configs_exit_2(overrides, tf_config, message, monkeypatch, capsys):
    if tf_config is not None:
        monkeypatch.setenv("TF_CONFIG", tf_config)
    args = ["--config", str(CONFIG), "--set", "logging.dir=null", "--set", "checkpoint.dir=null"]
    for o in overrides:
        args += ["--set", o]
    assert train_main(args) == 2
    err = capsys.readouterr().err
    assert "config error" in err and message in err, err


# ---------------------------------------------------------------------- data shares
def test_each_worker_iterates_a_disjoint_deterministic_share_of_every_epoch():
    x = np.arange(100, dtype=np.float32)[:, None]
    y = np.arange(100)
    shard = WorkerShard(x, y, batch_size=8, seed=3)
    for epoch_batches in (0, 1):
        shares = []
        for w in range(3):
            it = shard(InputContext(num_input_pipelines=3, input_pipeline_id=w))
            batches = [next(it) for _ in range(8)]          # 4 batches per epoch per worker
            rows = np.concatenate([b[1] for b in batches[4 * epoch_batches:
                                                         4 * epoch_batches + 4]])
            shares.append(rows)
            again = iter(shard(InputContext(num_input_pipelines=3, input_pipeline_id=w)))
            np.testing.assert_array_equal(next(again)[1], batches[0][1])  # deterministic
        assert all(len(s) == 32 for s in shares)
        assert len(set(np.concatenate(shares).tolist())) == 96            # disjoint
    # the epochs differ, and a resumed shard starts where it is told
    e0 = next(shard.batches(0, 3))[1]
    assert not np.array_equal(e0, next(WorkerShard(x, y, 8, 3, start_epoch=1).batches(0, 3))[1])
    third = list(zip(range(3), shard.batches(1, 3)))[2][1][1]
    np.testing.assert_array_equal(
        next(WorkerShard(x, y, 8, 3, start_batch=2).batches(1, 3))[1], third)


def test_an_epoch_is_every_workers_whole_batches():
    hook = CoordinatorHook.__new__(CoordinatorHook)
    hook.num_workers = 2
    trainer = type("T", (), {"seed": 0, "shuffle": True, "global_batch_size": 32})()
    order = hook.epoch_order(trainer, 1437, 0)
    assert len(order) == SPE * 32 and len(set(order.tolist())) == len(order)
    full = epoch_order(1437, 0, 0, True)
    np.testing.assert_array_equal(order[:22 * 32], worker_share(full, 0, 2, 32))
    np.testing.assert_array_equal(order[22 * 32:], full[1::2][:22 * 32])


# ---------------------------------------------------------------------- real clusters
def _env():
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1",
               XLA_FLAGS=xla_flags(1))
    return env


def _train_args(tmp_path, *overrides):
    args = ["-m", "jaxdist.train", "--config", str(CONFIG),
            "--set", f"logging.dir={tmp_path / 'logs'}",
            "--set", f"checkpoint.dir={tmp_path / 'ckpt'}",
            "--set", "logging.tensorboard=false", "--set", "logging.progress_bar=never"]
    for o in overrides:
        args += ["--set", o]
    return args


def _launch(tmp_path, *overrides, timeout=120):
    cmd = [sys.executable, "-m", "jaxdist.launch", "--coordinator", "--workers", "2", "--ps",
           "1", "--grace", "5", "--", sys.executable, *_train_args(tmp_path, *overrides)]
    t0 = time.monotonic()
    # The ps saves only under its checkpoint root (the launcher's default: its working dir).
    env = dict(_env(), JAXDIST_PS_CHECKPOINT_ROOT=str(tmp_path))
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    return proc, time.monotonic() - t0


def _records(tmp_path):
    return read_metrics(tmp_path / "logs")  # the newest run directory


def _steps_run(out: str) -> dict[str, int]:
    line = [ln for ln in out.splitlines() if "[coordinator] steps run:" in ln][-1]
    return {m[0]: int(m[1]) for m in re.findall(r"(worker:\d) (\d+)", line)}


E2E_EPOCHS = 12


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """One ``jaxdist.launch --coordinator`` run of E2E_EPOCHS epochs, shared: the end-to-end
    test reads it, the relaunch test resumes from its checkpoint (one launch fewer)."""
    tmp_path = tmp_path_factory.mktemp("coordinator")
    proc, wall = _launch(tmp_path, f"train.epochs={E2E_EPOCHS}")
    run_dirs = sorted((tmp_path / "logs").iterdir()) if (tmp_path / "logs").is_dir() else []
    ckpts = sorted(p.name for p in (tmp_path / "ckpt" / "ps-0").iterdir()) \
        if (tmp_path / "ckpt" / "ps-0").is_dir() else []
    files = sorted(p.name for p in run_dirs[0].iterdir()) if len(run_dirs) == 1 else None
    records = _records(tmp_path) if run_dirs and proc.returncode == 0 else []
    return {"path": tmp_path, "proc": proc, "wall": wall, "run_dirs": run_dirs,
            "ckpts": ckpts, "files": files, "records": records}


@pytest.mark.slow
@pytest.mark.parametrize("timed", [False, pytest.param(True, marks=pytest.mark.timing)])
def test_launch_coordinator_trains_digits_end_to_end(digits_run, timed):
    proc, wall = digits_run["proc"], digits_run["wall"]
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert wall < 60 or not timed, wall  # a speed claim: only in the `timing` run
    end = digits_run["records"][-1]
    assert end["event"] == "end" and end["step"] == E2E_EPOCHS * SPE
    assert end["val_accuracy"] >= 0.95, (end, wall)
    runs = _steps_run(out)
    assert sum(runs.values()) == E2E_EPOCHS * SPE and min(runs.values()) > 0, runs  # both
    # the chief asked the ps to checkpoint the final step; every server task stopped cleanly
    assert f"ckpt-{end['step']}" in digits_run["ckpts"], digits_run["ckpts"]
    for task in ("ps:0", "worker:0", "worker:1"):
        assert f"[{task}] jaxdist.server {task} stopped" in out, out[-3000:]
    assert "all training tasks finished" in out
    # The chief's own validation runs there on purpose: no "not scheduled" warning per batch.
    assert "without using `ClusterCoordinator.schedule`" not in out, out[-3000:]
    assert len(digits_run["run_dirs"]) == 1  # one run directory: the chief's
    assert digits_run["files"] == ["config.yaml", "metrics.jsonl"]


@pytest.mark.slow
def test_relaunch_resumes_from_the_ps_checkpoint(digits_run):
    # Relaunched with one more epoch, the job resumes from the first run's last checkpoint.
    first, tmp_path = digits_run["proc"], digits_run["path"]
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    assert len(digits_run["run_dirs"]) == 1  # the second run gets its own dir
    done = E2E_EPOCHS * SPE
    proc, _ = _launch(tmp_path, f"train.epochs={E2E_EPOCHS + 1}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert len(list((tmp_path / "logs").iterdir())) == 2
    assert f"Resumed from checkpoint at step {done}" in out
    records = _records(tmp_path)
    assert min(r["step"] for r in records) > done and records[-1]["step"] == done + SPE
    assert sum(_steps_run(out).values()) == SPE        # only the last epoch ran
    assert records[-1]["val_accuracy"] > 0.85


@pytest.mark.slow
def test_a_worker_killed_mid_training_is_survived(tmp_path):
    from jaxdist.testing import LocalCluster

    c = LocalCluster(workers=2, ps=1, chief=True, devices_per_process=1,
                     env={"JAX_NUM_CPU_DEVICES": "1"}, cwd=str(ROOT))
    try:
        for name in ("ps:0", "worker:0", "worker:1"):  # the ps saves under its checkpoint root
            c.start_task(name, [sys.executable, "-m", "jaxdist.server",
                                *(["--checkpoint_root", str(tmp_path)] if name == "ps:0" else [])])
        for name in ("ps:0", "worker:0", "worker:1"):
            c.wait_for_output(name, r"listening on", 60)
        c.start_task("chief:0", [sys.executable, *_train_args(
            # Long enough that the chief still trains when worker:1 is back (a restart takes
            # seconds; one worker alone runs ~100 steps/s here).
            tmp_path, "train.epochs=20", "strategy.heartbeat_interval=0.2",
            "strategy.heartbeat_timeout=2", "logging.every_steps=4")])
        c.wait_for_output("chief:0", r"\[train\] step 4\d ", 60)
        c.kill("worker:1")                                # SIGKILL with steps in flight
        c.wait_for_output("chief:0", r"\[train\] step 1[0-9]\d ", 60)  # goes on with worker:0
        c.restart("worker:1")                              # comes back, rejoins on its own
        assert c.wait("chief:0", 120) == 0, c.output("chief:0")[-3000:]
        out = c.output("chief:0")
    finally:
        c.stop()
    end = _records(tmp_path)[-1]
    assert end["event"] == "end" and end["step"] == 20 * SPE
    assert end["val_accuracy"] >= 0.9, end
    runs = _steps_run(out)
    assert sum(runs.values()) >= 20 * SPE, runs         # at least once: lost steps ran again
    assert "worker:1 restarted" in out or "(restarted" in out, out[-3000:]


@pytest.mark.parametrize("task, serves", [("ps", True), ("worker", True), ("chief", False)])
def test_ps_and_worker_tasks_running_the_train_command_serve(task, serves, monkeypatch):
    from jaxdist._src.job.config import load_config
    from jaxdist._src.job.parameter_server import is_ps_task

    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster,
                                                "task": {"type": task, "index": 0}}))
    assert is_ps_task(load_config(CONFIG)) is serves
    between_graph = load_config(ROOT / "configs" / "parameter_server.yaml")
    assert is_ps_task(between_graph) is (task == "ps")   # its workers train


# ---------------------------------------------------------------------- steps and their stats
@pytest.mark.devices(2)
def test_a_worker_step_computes_every_metric_and_honours_sample_weights():
    """``WorkerStep`` (what a worker runs) on an in-process ps: the step's loss, accuracy and
    metric sums equal the synchronous trainer's first step on the same batch."""
    import jax
    import optax
    from flax import nnx

    import jaxdist
    from jaxdist._src.job.models import MLP
    from jaxdist._src.ps import optimizers as O
    from jaxdist._src.train.keras_metrics import AUC, SparseTopKCategoricalAccuracy
    from jaxdist._src.train.parameter_server.coordinated import StepStats, WorkerStep

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    w = np.linspace(0.0, 2.0, 16).astype(np.float32)
    metrics = [AUC(), SparseTopKCategoricalAccuracy(k=1, name="top1")]

    def trainer(strategy, opt):
        with strategy.scope():
            return jaxdist.Trainer(MLP(5, [8], 2, rngs=nnx.Rngs(0)), opt, global_batch_size=16,
                                   strategy=strategy, metrics=["accuracy", *metrics],
                                   log_dir=None, progress_bar="never", shuffle=False)

    ps = jaxdist.ParameterServerStrategy(compute_devices=jax.devices()[:2], timeout=30.0)
    t = trainer(ps, O.sgd(0.1))
    ctx = t.context
    step = WorkerStep(ctx.model_state, ctx.loss_fn, 16, t._hook.variables, t.rest, ps, None,
                      ctx.metric_specs)
    got = step(iter([(x, y, w)]))

    class Ready:  # a RemoteValue that is ready
        def __init__(self, value):
            self.value = value

        def fetch(self):
            return self.value

    stats = StepStats([Ready(got), Ready(got)])
    assert stats["loss"].shape == (2,) and set(stats["metrics"]) == {"auc", "top1"}

    sync = trainer(jaxdist.MirroredStrategy(jax.devices()[:2]), optax.sgd(0.1))
    history = sync.fit((x, y), sample_weight=w, steps=1, verbose=0)
    logged = {k: v[0] for k, v in history.history.items()}
    assert float(got["loss"]) == pytest.approx(logged["loss"], rel=1e-5)
    assert float(got["correct"]) / float(got["weight"]) == pytest.approx(logged["accuracy"])
    for m in metrics:
        sums = {k: np.asarray(v, np.float64) for k, v in got["metrics"][m.name].items()}
        assert m.result(sums) == pytest.approx(logged[m.name], rel=1e-6), m.name
    # the pushed gradient equals the synchronous step's update
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 t._hook.variables.pull(), jax.device_get(sync.params))


def test_the_coordinator_refuses_a_stream_its_workers_cannot_read():
    from jaxdist._src.train.data import DataError
    from jaxdist._src.train.inputs import source

    hook = CoordinatorHook.__new__(CoordinatorHook)
    gen = ((np.zeros((4, 2), np.float32), np.zeros(4, np.int32)) for _ in range(3))
    hook._train = None
    accepted = "Pass \\(x, y\\) arrays or a grain.MapDataset"
    with pytest.raises(DataError, match="lives in the chief's process and the workers cannot "
                                        "read it. " + accepted):
        hook.begin_fit(None, None, source(gen, what="train_data"))
    stream = _grain_examples(8).batch(4).to_iter_dataset()        # a grain IterDataset
    with pytest.raises(DataError, match=r"got a grain\.\w*IterDataset: .*" + accepted):
        hook.begin_fit(None, None, source(stream, what="train_data"))


@pytest.mark.devices(2)
def test_the_chief_evaluates_and_predicts_on_more_devices_than_each_worker_has():
    """With a coordinator, ``num_replicas_in_sync`` is the workers' count (here 1) while the
    chief evaluates and predicts on its own devices (here 2): the numbers equal a one-device
    synchronous trainer's, also when the chief's devices do not divide the batch (3 rows)."""

    import jax
    import optax
    from flax import nnx

    import jaxdist
    from jaxdist._src.job.models import MLP
    from jaxdist._src.ps import optimizers as O

    class OneDeviceWorkers:  # what the chief's hook and strategy ask of a ClusterCoordinator
        num_workers = 1
        known_worker_num_replicas = 1
        stopping = False

        def worker_num_replicas(self):
            return 1

        def join(self):
            pass

    rng = np.random.default_rng(0)
    x = rng.normal(size=(11, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    w = np.linspace(0.5, 2.0, 11).astype(np.float32)

    def trainer(strategy, opt):
        with strategy.scope():
            return jaxdist.Trainer(MLP(5, [8], 2, rngs=nnx.Rngs(0)), opt, global_batch_size=3,
                                   strategy=strategy, metrics=["accuracy", "auc"],
                                   weighted_metrics=["accuracy"], log_dir=None,
                                   progress_bar="never")

    chief = jaxdist.ParameterServerStrategy(compute_devices=jax.devices()[:2], timeout=30.0)
    chief.attach_coordinator(OneDeviceWorkers())
    t = trainer(chief, O.sgd(0.1))
    assert type(t._hook).__name__ == "CoordinatorHook"
    assert chief.num_replicas_in_sync == 1 and chief.extended.num_replicas_in_mesh == 2
    ref = trainer(jaxdist.MirroredStrategy(jax.devices()[:1]), optax.sgd(0.1))
    got, want = t.evaluate(x, y, sample_weight=w), ref.evaluate(x, y, sample_weight=w)
    assert set(got) == set(want) == {"loss", "accuracy", "auc", "weighted_accuracy"}
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-5), k
    out = t.predict(x)
    assert out.shape == (11, 2)
    np.testing.assert_allclose(out, ref.predict(x), rtol=1e-5, atol=1e-6)


def _grain_examples(n=100):
    import grain

    x = np.arange(n, dtype=np.float32)[:, None]
    y = np.arange(n)
    return grain.MapDataset.source([(x[i], y[i]) for i in range(n)])


def test_each_worker_reads_its_share_of_a_grain_map_dataset_once_per_epoch():
    """A grain MapDataset under the coordinator: worker ``i`` reads elements ``i, i+n, ...``
    (pickled to it with the per-worker dataset), every example of an epoch once, the same order
    every epoch, and a resumed shard starts at the batch it is told."""
    import cloudpickle

    from jaxdist._src.train.data import DataError
    from jaxdist._src.train.inputs import source
    from jaxdist._src.train.parameter_server.coordinated import GrainWorkerShard

    ds = _grain_examples().batch(6)            # 17 elements: 16 of 6 rows, the last of 4
    hook = CoordinatorHook.__new__(CoordinatorHook)
    hook.num_workers, hook._train = 3, None
    trainer = type("T", (), {"global_batch_size": 8})()   # the TrainerContext's field it reads
    train = source(ds, what="train_data")
    hook.begin_fit(trainer, None, train)
    assert hook._grain == (16, 6)              # the short last element is dropped
    spe = hook.stream_steps_per_epoch(trainer, train, None)
    assert spe == 3 * (5 * 6 // 8)             # 5 elements (30 rows) per worker: 3 batches
    shard = cloudpickle.loads(cloudpickle.dumps(GrainWorkerShard(ds, 8, *hook._grain)))
    epochs = []
    for w in range(3):
        it = shard(InputContext(num_input_pipelines=3, input_pipeline_id=w))
        batches = [next(it) for _ in range(6)]   # two epochs of 3 batches
        assert all(b[0].shape == (8, 1) for b in batches)
        np.testing.assert_array_equal(batches[0][1][:6], np.arange(6 * w, 6 * w + 6))
        for e in (0, 1):
            epochs.append((e, np.concatenate([b[1] for b in batches[3 * e:3 * e + 3]])))
        resumed = GrainWorkerShard(ds, 8, *hook._grain, start_epoch=1, start_batch=2)
        np.testing.assert_array_equal(next(resumed.batches(w, 3))[1], batches[5][1])
    for e in (0, 1):
        rows = np.concatenate([r for ee, r in epochs if ee == e])
        assert len(rows) == spe * 8 and len(set(rows.tolist())) == len(rows)   # each once
    np.testing.assert_array_equal(epochs[0][1], epochs[1][1])   # the dataset's own order
    with pytest.raises(DataError, match=r"steps_per_epoch=4: with a ClusterCoordinator"):
        hook.stream_steps_per_epoch(trainer, train, 4)
