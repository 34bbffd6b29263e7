"""Keras callbacks in Trainer.fit: hook order, History, EarlyStopping, ReduceLROnPlateau,
TerminateOnNaN, ModelCheckpoint, BackupAndRestore, CSVLogger, TensorBoard, config entries."""

import csv
import logging
import os

import jax
import numpy as np
import optax
import pytest
from devutil import first_devices
from flax import nnx

import jaxdist
from jaxdist._src.job import data as job_data
from jaxdist._src.job.config import ConfigError, load_config
from jaxdist._src.job.models import MLP
from jaxdist._src.train import callbacks as C
from jaxdist._src.train.trainer import Trainer

GBS = 32


@pytest.fixture(scope="module")
def data():
    train, val = job_data.make_synthetic(num_examples=260, num_features=12, num_classes=4,
                                         validation_split=0.25)
    return (train.x, train.y), (val.x, val.y)


def _trainer(strategy=None, optimizer=None, **kw):
    strategy = strategy or jaxdist.OneDeviceStrategy(jax.devices()[0])
    kw.setdefault("progress_bar", "never")
    kw.setdefault("log_every_steps", 1000)
    with strategy.scope():
        model = MLP(12, [16], 4, rngs=nnx.Rngs(0))
        tx = optimizer or optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
        return Trainer(model, tx, global_batch_size=GBS, strategy=strategy, **kw)


def _params(trainer):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(trainer.params))]


class Scripted(C.Callback):
    """Overwrites a logged value with a scripted sequence (callbacks after it see it)."""

    def __init__(self, key, values):
        super().__init__()
        self.key, self.values = key, list(values)

    def on_epoch_end(self, epoch, logs=None):
        logs[self.key] = self.values[epoch]


class Recorder(C.Callback):
    def __init__(self):
        super().__init__()
        self.calls, self.weights = [], []

    def on_train_begin(self, logs=None):
        self.calls.append("train_begin")

    def on_epoch_begin(self, epoch, logs=None):
        self.calls.append(f"epoch_begin {epoch}")

    def on_train_batch_begin(self, batch, logs=None):
        self.calls.append(f"batch_begin {batch}")

    def on_train_batch_end(self, batch, logs=None):
        assert np.isfinite(logs["loss"]) and 0 <= logs["accuracy"] <= 1
        self.calls.append(f"batch_end {batch}")

    def on_test_begin(self, logs=None):
        self.calls.append("test_begin")

    def on_test_end(self, logs=None):
        self.calls.append("test_end")

    def on_epoch_end(self, epoch, logs=None):
        assert {"loss", "accuracy", "learning_rate", "val_loss", "val_accuracy"} <= set(logs)
        self.calls.append(f"epoch_end {epoch}")
        self.weights.append(_params(self.model))

    def on_train_end(self, logs=None):
        self.calls.append("train_end")


def test_hook_order_history_and_params(data):
    train, val = data
    rec = Recorder()
    t = _trainer(steps_per_execution=2)
    h = t.fit(train, epochs=2, validation_data=val, callbacks=[rec], verbose=0)
    spe = len(train[1]) // GBS  # 6: three dispatches of 2 steps per epoch
    epoch = ["batch_begin 1", "batch_end 1", "batch_begin 3", "batch_end 3", "batch_begin 5",
             "batch_end 5", "test_begin", "test_end"]
    assert rec.calls == ["train_begin", "epoch_begin 0", *epoch, "epoch_end 0",
                         "epoch_begin 1", *epoch, "epoch_end 1", "train_end"]
    assert isinstance(h, C.History) and h.epoch == [0, 1]
    assert h.params == {"epochs": 2, "steps": spe, "verbose": 0}
    assert set(h.history) == {"loss", "accuracy", "learning_rate", "val_loss", "val_accuracy"}
    assert all(len(v) == 2 for v in h.history.values())
    assert h.history["learning_rate"] == pytest.approx([0.1, 0.1])
    assert rec.model is t and rec.trainer is t


def test_early_stopping_restores_the_best_weights(data):
    train, val = data
    rec = Recorder()
    stop = C.EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True)
    t = _trainer()
    h = t.fit(train, epochs=10, validation_data=val, verbose=0,
              callbacks=[Scripted("val_loss", [1.0, 0.5, 0.7, 0.8, 0.9, 0.1]), rec, stop])
    assert h.epoch == [0, 1, 2, 3] and stop.stopped_epoch == 3 and stop.best_epoch == 1
    assert h.history["val_loss"] == [1.0, 0.5, 0.7, 0.8]  # History sees the same logs
    for a, b in zip(_params(t), rec.weights[1]):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(_params(t)[0], rec.weights[3][0])


def test_early_stopping_baseline_min_delta_and_start_from_epoch():
    class Model:
        stop_training = False

    def run(values, **kw):
        cb = C.EarlyStopping(monitor="m", **kw)
        cb.set_model(Model())
        cb.model.stop_training = False
        cb.on_train_begin()
        for e, v in enumerate(values):
            cb.on_epoch_end(e, {"m": v})
            if cb.model.stop_training:
                return e
        return None

    assert run([1.0, 0.99, 0.98, 0.97], patience=1, min_delta=0.05) == 1
    assert run([1.0, 0.9, 0.8], patience=1) is None
    # Keras: an epoch that does not beat the baseline does not reset the patience
    assert run([0.9, 0.95, 0.97], patience=2, baseline=0.5) == 1
    assert run([0.9, 0.95, 0.97], patience=2) == 2
    assert run([0.5, 0.6, 0.7, 0.8], patience=1, mode="max") is None
    assert run([1.0, 1.0, 1.0, 1.0, 1.0], patience=1, start_from_epoch=3) == 4
    with pytest.raises(ValueError, match="mode='up'"):
        C.EarlyStopping(mode="up")


def test_reduce_lr_on_plateau_changes_the_rate_without_recompiling(data, caplog):
    train, _ = data
    seen = []
    t = _trainer()
    cb = C.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1, min_lr=0.02)
    t.fit(train, epochs=5, verbose=0, callbacks=[
        Scripted("loss", [1.0] * 5), cb,
        C.LambdaCallback(on_epoch_end=lambda e, logs: seen.append(t.learning_rate))])
    assert seen == pytest.approx([0.1, 0.05, 0.025, 0.02, 0.02])
    # the new rate is the one the step uses (a rate of 0 leaves the parameters as they are),
    # and the compiled step is reused
    t.learning_rate = 0.0
    before = _params(t)
    caplog.set_level(logging.WARNING)
    with jax.log_compiles():
        t.fit(train, epochs=1, verbose=0)
    assert not [r for r in caplog.records if "train_replica" in r.getMessage()]
    for a, b in zip(before, _params(t)):
        np.testing.assert_array_equal(a, b)


def test_reduce_lr_needs_an_injected_rate(data):
    t = _trainer(optimizer=optax.sgd(0.1))
    with pytest.raises(ValueError, match="inject_hyperparams"):
        t.fit(data[0], epochs=1, verbose=0, callbacks=[C.ReduceLROnPlateau()])
    sched = optax.inject_hyperparams(optax.sgd)(learning_rate=optax.linear_schedule(0.1, 0, 9))
    with pytest.raises(ValueError, match="schedule"):
        _trainer(optimizer=sched).learning_rate = 0.5


def test_terminate_on_nan_ends_fit_normally(data):
    x, y = data[0]
    x = x.copy()
    x[2 * GBS:3 * GBS] = np.nan  # shuffle off: the third step sees NaN
    t = _trainer(halt_on_nan=False, shuffle=False)
    h = t.fit((x, y), epochs=3, verbose=0, callbacks=[C.TerminateOnNaN()])
    assert t.step == 3 and t.stop_training
    assert np.isnan(h.history["loss"][0])


def test_model_checkpoint_best_only_and_load_weights(data, tmp_path):
    train, val = data
    rec = Recorder()
    t = _trainer()
    path = str(tmp_path / "ckpt" / "e{epoch:02d}-{val_loss:.1f}")
    best = C.ModelCheckpoint(path, monitor="val_loss", save_best_only=True,
                             save_weights_only=True)
    t.fit(train, epochs=4, validation_data=val, verbose=0,
          callbacks=[Scripted("val_loss", [1.0, 0.5, 0.7, 0.4]), rec, best])
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["e01-1.0", "e02-0.5", "e04-0.4"]
    t.load_weights(tmp_path / "ckpt" / "e02-0.5")
    for a, b in zip(_params(t), rec.weights[1]):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="names 'nope'"):
        t.fit(train, epochs=5, verbose=0,  # one more epoch
              callbacks=[C.ModelCheckpoint(str(tmp_path / "{nope}"))])


def test_backup_and_restore_resumes_and_deletes(data, tmp_path):
    train, _ = data
    backup = tmp_path / "backup"

    class Crash(C.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise KeyboardInterrupt

    t = _trainer()
    with pytest.raises(KeyboardInterrupt):
        t.fit(train, epochs=4, verbose=0, callbacks=[C.BackupAndRestore(backup), Crash()])
    assert backup.is_dir()  # kept: training did not finish
    spe = len(train[1]) // GBS
    t2 = _trainer()
    h = t2.fit(train, epochs=4, verbose=0, callbacks=[C.BackupAndRestore(backup)])
    assert h.epoch == [2, 3] and t2.step == 4 * spe  # resumed after the two saved epochs
    assert not backup.exists()  # delete_checkpoint=True once training finished
    straight = _trainer()
    straight.fit(train, epochs=4, verbose=0)
    for a, b in zip(_params(straight), _params(t2)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_csv_logger_and_tensorboard_overlay(data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train, val = data
    t = _trainer()
    t.fit(train, epochs=2, validation_data=val, verbose=0, callbacks=[
        C.CSVLogger(tmp_path / "log.csv"), C.TensorBoard(tmp_path / "tb")])
    with open(tmp_path / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows] == ["0", "1"]
    assert set(rows[0]) == {"epoch", "loss", "accuracy", "learning_rate", "val_loss",
                            "val_accuracy"}
    for phase in ("train", "validation"):
        acc = EventAccumulator(str(tmp_path / "tb" / phase))
        acc.Reload()
        tags = acc.Tags()["scalars"]
        assert "epoch_loss" in tags and "epoch_accuracy" in tags, (phase, tags)
        assert [e.step for e in acc.Scalars("epoch_loss")] == [0, 1]
    assert "epoch_learning_rate" in EventAccumulator(str(tmp_path / "tb" / "train")).Reload(
    ).Tags()["scalars"]


def test_file_writing_callbacks_run_on_the_chief_only(tmp_path):
    csv_cb, stop = C.CSVLogger(tmp_path / "x.csv"), C.EarlyStopping()
    worker = C.CallbackList([csv_cb, stop], model=object(), is_chief=False)
    assert worker.callbacks == [stop]
    chief = C.CallbackList([csv_cb, stop], model=object(), is_chief=True)
    assert chief.callbacks == [csv_cb, stop]
    with pytest.raises(TypeError, match=r"not a jaxdist\.\S*Callback"):
        C.CallbackList([print])


@pytest.mark.parametrize("entry, message", [
    ({"name": "EarlyStoping"}, "callbacks[0].name: 'EarlyStoping' is not a known callback"),
    ({"name": "EarlyStopping", "patiense": 3}, "callbacks[0].patiense: unknown argument of "
                                               "EarlyStopping"),
    ({"name": "EarlyStopping", "mode": "up"}, "callbacks[0] (EarlyStopping): mode='up'"),
    ({"name": "LambdaCallback"}, "LambdaCallback takes Python functions"),
    ("EarlyStopping", "expected a mapping with a class name"),
])
def test_config_callbacks_are_validated(entry, message):
    with pytest.raises(ConfigError) as e:
        load_config(raw={"callbacks": [entry]})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_config_callbacks_build_with_paths_in_the_run_dir(tmp_path):
    cfg = load_config(raw={"callbacks": [
        {"name": "EarlyStopping", "monitor": "val_accuracy", "patience": 2},
        {"name": "CSVLogger", "filename": "log.csv"}]})
    cbs = C.from_config(cfg["callbacks"], resolve_path=lambda p: str(tmp_path / p))
    assert isinstance(cbs[0], C.EarlyStopping) and cbs[0].patience == 2
    assert cbs[1].filename == str(tmp_path / "log.csv")


def test_evaluate_and_predict_take_callbacks(data):
    calls = []
    t = _trainer()
    cb = C.LambdaCallback(on_test_begin=lambda logs=None: calls.append("test_begin"),
                          on_test_end=lambda logs=None: calls.append(("test_end", sorted(logs))),
                          on_predict_begin=lambda logs=None: calls.append("predict_begin"),
                          on_predict_end=lambda logs=None: calls.append(
                              ("predict_end", logs["outputs"].shape)))
    t.evaluate(data[1], callbacks=[cb])
    t.predict(data[1][0], callbacks=[cb])
    assert calls == ["test_begin", ("test_end", ["accuracy", "loss"]), "predict_begin",
                     ("predict_end", (len(data[1][0]), 4))]


# ---------------------------------------------------------------------- test / predict batches
def C_top_k():
    from jaxdist._src.train.keras_metrics import SparseTopKCategoricalAccuracy

    return SparseTopKCategoricalAccuracy(k=2)


def _strategy(name):
    if name == "one_device":
        return jaxdist.OneDeviceStrategy(jax.devices()[0])
    if name == "mirrored":
        return jaxdist.MirroredStrategy(first_devices(2))
    return jaxdist.ParameterServerStrategy(compute_devices=first_devices(2), timeout=30.0)


@pytest.mark.parametrize("strategy", ["one_device", "mirrored", "parameter_server"])
def test_test_and_predict_batch_hooks_get_keras_logs(data, strategy, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    (x, y), (xv, yv) = data
    from jaxdist._src.ps import optimizers as O

    t = _trainer(_strategy(strategy),
                 optimizer=O.sgd(0.1) if strategy == "parameter_server" else None,
                 metrics=["accuracy", C_top_k()])
    events = []

    def record(name):
        return lambda *a: events.append((name, *a))

    cb = C.LambdaCallback(**{h: record(h) for h in (
        "on_test_begin", "on_test_end", "on_test_batch_begin", "on_test_batch_end",
        "on_predict_begin", "on_predict_end", "on_predict_batch_begin",
        "on_predict_batch_end")})
    rows = 2 * GBS + 8                     # three batches, the last one padded
    result = t.evaluate((x[:rows], y[:rows]), callbacks=[cb])
    names = [e[0] for e in events]
    assert names == ["on_test_begin", *["on_test_batch_begin", "on_test_batch_end"] * 3,
                     "on_test_end"], names
    assert [e[1] for e in events if e[0].startswith("on_test_batch")] == [0, 0, 1, 1, 2, 2]
    ends = [e[2] for e in events if e[0] == "on_test_batch_end"]
    # Keras: each batch's logs are the results over the batches so far
    assert ends[0] == pytest.approx(t.evaluate((x[:GBS], y[:GBS])))
    assert ends[-1] == pytest.approx(result) and events[-1][1] == result
    events.clear()
    out = t.predict(x[:rows], callbacks=[cb])
    assert [e[0] for e in events] == ["on_predict_begin", *["on_predict_batch_begin",
                                                            "on_predict_batch_end"] * 3,
                                      "on_predict_end"]
    batches = [e[2]["outputs"] for e in events if e[0] == "on_predict_batch_end"]
    assert [len(b) for b in batches] == [GBS, GBS, 8]
    np.testing.assert_array_equal(np.concatenate(batches), out)
    # fit's validation calls the test hooks of fit's callbacks
    events.clear()
    t.fit((x, y), steps=2, validation_data=(xv[:GBS], yv[:GBS]), callbacks=[cb], verbose=0)
    assert [e[0] for e in events] == ["on_test_begin", "on_test_batch_begin",
                                      "on_test_batch_end", "on_test_end"]


def test_fit_prepares_input_blocks_on_a_background_thread(data):
    """Trainer.fit keeps its block prefetch thread (InputOptions(prefetch_thread=True)) while
    plain distributed datasets now read ahead in the caller's thread."""
    import threading

    seen = []
    probe = C.LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(
        any(t.name == "jaxdist-prefetch" for t in threading.enumerate())))
    big, _ = job_data.make_synthetic(num_examples=160 * GBS, num_features=12, num_classes=4,
                                     validation_split=0.0)
    _trainer().fit((big.x, big.y), epochs=1, callbacks=[probe], verbose=0)
    assert len(seen) == 160 and any(seen)  # 5 blocks of 32 steps: the thread outlives block 1
