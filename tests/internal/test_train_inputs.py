"""Trainer inputs: arrays, dicts, jaxdist.Dataset, generators, grain, tf.data-like, weights."""

import grain
import jax
import numpy as np
import optax
import pytest
from devutil import first_devices
from flax import nnx

import jaxdist
from jaxdist._src.train.data import DataError
from jaxdist._src.train.trainer import Trainer

GBS = 16


class Net(nnx.Module):
    def __init__(self, *, rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.l2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


class DictNet(nnx.Module):
    """Takes named features: ``{"a": (n, 3), "b": (n, 1)}``."""

    def __init__(self, *, rngs):
        self.inner = Net(rngs=rngs)

    def __call__(self, x):
        return self.inner(jax.numpy.concatenate([x["a"], x["b"]], axis=-1))


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 1).astype(np.int32)
    return x, y


@pytest.fixture(scope="module")
def strategy():
    return jaxdist.MirroredStrategy(first_devices(2))


def _trainer(strategy, model=None, lr=0.1, **kw):
    kw.setdefault("shuffle", False)
    return Trainer(model or Net(rngs=nnx.Rngs(0)), optax.sgd(lr), global_batch_size=GBS,
                   strategy=strategy, progress_bar="never", **kw)


def _params(t):
    return [np.asarray(a) for a in jax.tree.leaves(jax.device_get(t.params))]


def _same(a, b, **tol):
    for u, v in zip(_params(a), _params(b)):
        np.testing.assert_allclose(u, v, **(tol or {"rtol": 1e-6, "atol": 1e-7}))


@pytest.fixture(scope="module")
def reference(data, strategy):
    x, y = data
    t = _trainer(strategy)
    t.fit((x, y), steps=6)
    return t


def test_arrays_dicts_and_y_keyword_are_the_same_data(data, strategy, reference):
    x, y = data
    for form in ({"x": x, "y": y}, [x, y]):
        t = _trainer(strategy)
        t.fit(form, steps=6)
        _same(t, reference)
    t = _trainer(strategy)
    t.fit(x, y=y, steps=6)
    _same(t, reference)


def test_dict_of_features(data, strategy, reference):
    x, y = data
    t = _trainer(strategy, DictNet(rngs=nnx.Rngs(0)))
    feats = {"a": x[:, :3], "b": x[:, 3:]}
    t.fit((feats, y), steps=6)
    _same(t, reference)
    assert t.predict(feats).shape == (64, 3)
    np.testing.assert_allclose(t.predict(feats), reference.predict(x), rtol=1e-5, atol=1e-6)


def test_streams_give_the_same_steps_as_arrays(data, strategy, reference):
    x, y = data
    ds = jaxdist.Dataset.from_tensor_slices((x, y)).batch(8)    # rebatched to 16 rows
    t = _trainer(strategy)
    t.fit(ds, epochs=2)     # len 8 elements of 8 rows: 4 steps an epoch
    assert t.step == 8
    t2 = _trainer(strategy)
    t2.fit((x, y), epochs=2)
    _same(t, t2)

    def gen():
        while True:
            for i in range(0, 64, GBS):
                yield {"x": x[i:i + GBS], "y": y[i:i + GBS]}

    with pytest.raises(DataError, match="steps_per_epoch"):
        _trainer(strategy).fit(gen())
    t3 = _trainer(strategy)
    t3.fit(gen(), epochs=2, steps_per_epoch=3)      # a generator is read on across epochs
    _same(t3, reference)

    # single examples (scalar labels) are batched; evaluate pads and masks the last batch
    examples = [(x[i], y[i]) for i in range(50)]
    ev = reference.evaluate(examples)
    assert ev == pytest.approx(reference.evaluate((x[:50], y[:50])), rel=1e-6)
    np.testing.assert_allclose(reference.predict(iter([x[:20], x[20:50]])),
                               reference.predict(x[:50]), rtol=1e-6)


class FakeTFData:
    """What the Trainer uses of a tf.data.Dataset: as_numpy_iterator and cardinality."""

    def __init__(self, x, y, batch):
        self.x, self.y, self.batch = x, y, batch

    def as_numpy_iterator(self):
        for i in range(0, len(self.x), self.batch):
            yield self.x[i:i + self.batch], self.y[i:i + self.batch]

    def cardinality(self):
        return -(-len(self.x) // self.batch)


def test_tf_data_like_objects(data, strategy, reference):
    x, y = data
    t = _trainer(strategy)
    t.fit(FakeTFData(x, y, GBS), steps=6)
    _same(t, reference)
    assert t.evaluate(FakeTFData(x, y, 10)) == pytest.approx(t.evaluate((x, y)), rel=1e-6)


def test_grain_datasets_and_resume_keeps_the_position(data, strategy, tmp_path):
    x, y = data
    records = [{"x": x[i], "y": y[i]} for i in range(64)]
    ds = grain.MapDataset.source(records).shuffle(seed=3).batch(GBS)
    # uninterrupted: 3 epochs of 4 steps, a grain MapDataset is iterated anew every epoch
    full = _trainer(strategy)
    full.fit(ds, epochs=3)
    assert full.step == 12
    iter_ds = ds.to_iter_dataset()
    full_iter = _trainer(strategy)
    full_iter.fit(iter_ds, epochs=3, steps_per_epoch=4)
    _same(full, full_iter)
    # interrupted after 6 steps (mid-epoch), resumed from the checkpoint
    first = _trainer(strategy, checkpoint_dir=str(tmp_path), checkpoint_every_steps=6)
    first.fit(iter_ds, steps=6, steps_per_epoch=4)
    from jaxdist._src.train.checkpoint import Checkpointer

    _, meta = Checkpointer(str(tmp_path), read_only=True).restore(6)
    assert meta["data_position"]["epoch"] == 1 and meta["data_position"]["batches"] == 2
    assert meta["data_position"]["grain_state"]["next_index"] == 2
    resumed = _trainer(strategy, model=Net(rngs=nnx.Rngs(9)), checkpoint_dir=str(tmp_path))
    resumed.fit(iter_ds, epochs=3, steps_per_epoch=4)
    assert resumed.step == 12
    _same(resumed, full)


def test_grain_missing_gives_the_install_command(monkeypatch):
    import builtins

    from jaxdist._src.train import inputs

    real = builtins.__import__

    def fake(name, *a, **k):
        if name == "grain":
            raise ImportError("no grain")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ImportError, match=r"pip install 'jaxdist\[grain\]'"):
        inputs.import_grain()


def test_sample_and_class_weights_weight_the_loss_and_the_metrics(data, strategy):
    x, y = data
    doubled = _trainer(strategy, weighted_metrics=["accuracy"])
    doubled.fit((x, y), steps=3, sample_weight=np.full(64, 2.0, np.float32))
    faster = _trainer(strategy, lr=0.2)
    faster.fit((x, y), steps=3)
    _same(doubled, faster, rtol=1e-5, atol=1e-6)
    by_class = _trainer(strategy)
    by_class.fit((x, y), steps=3, class_weight={0: 2.0, 1: 2.0, 2: 2.0})
    _same(by_class, faster, rtol=1e-5, atol=1e-6)
    # zero weights: those rows count for nothing in the weighted metrics (Keras'
    # weighted_metrics, named weighted_accuracy beside the unweighted accuracy) and the loss
    w = (np.arange(64) < 40).astype(np.float32)
    m = doubled.evaluate((x, y, w))
    ref = doubled.evaluate((x[:40], y[:40]))
    assert m["weighted_accuracy"] == pytest.approx(ref["accuracy"], rel=1e-6)
    assert m["accuracy"] == pytest.approx(doubled.evaluate((x, y))["accuracy"], rel=1e-6)
    assert m["loss"] == pytest.approx(ref["loss"] * 40 / 64, rel=1e-5)   # sum(w*l)/n
    with pytest.raises(DataError, match="class_weight has no weight for class 2"):
        _trainer(strategy).fit((x, y), steps=1, class_weight={0: 1.0, 1: 1.0})


def test_validation_split_takes_the_last_rows(data, strategy):
    x, y = data
    t = _trainer(strategy)
    h = t.fit((x, y), epochs=1, validation_split=0.25)
    assert t.step == 3       # 48 training rows
    assert h.history["val_loss"][-1] == pytest.approx(t.evaluate((x[48:], y[48:]))["loss"],
                                                      rel=1e-6)
    with pytest.raises(DataError, match="validation_split works with array data only"):
        t.fit(jaxdist.Dataset.from_tensor_slices((x, y)).batch(16), validation_split=0.5)


def test_labels_of_the_wrong_kind_are_one_clear_error(data, strategy):
    x, y = data
    t = _trainer(strategy)
    with pytest.raises(DataError, match="labels are floats such as 1.5") as e:
        t.fit((x, y + 0.5), steps=1)
    assert e.value.exit_code == 2
    with pytest.raises(DataError, match=r"labels of shape \(64, 3\) look one-hot") as e:
        t.fit((x, np.eye(3, dtype=np.float32)[y]), steps=1)
    assert e.value.exit_code == 2
    t.fit((x, y.astype(np.float32)), steps=1)      # whole-number floats are class ids (Keras)
    onehot = _trainer(strategy, loss="categorical_crossentropy")
    onehot.fit((x, np.eye(3, dtype=np.float32)[y]), steps=1)
    with pytest.raises(DataError, match="expects one-hot labels"):
        onehot.fit((x, y), steps=1)
    with pytest.raises(DataError, match="labels are floats"):    # in a stream, too
        t.fit([(x[:16], y[:16] + 0.25)], steps=1)


def test_not_an_npz_file_names_the_path(tmp_path):
    from jaxdist._src.job.data import load_npz

    bad = tmp_path / "data.npz"
    bad.write_text("x,y\n1,2\n")
    with pytest.raises(DataError, match=f"{bad}: is not a .npz file") as e:
        load_npz(bad)
    assert e.value.exit_code == 2
    np.save(tmp_path / "one.npy", np.zeros(3))
    with pytest.raises(DataError, match="one.npy: is not a .npz file"):
        load_npz(tmp_path / "one.npy")


def _cli(tmp_path, *overrides):
    import pathlib

    from jaxdist._src.job.cli import main

    config = pathlib.Path(__file__).resolve().parents[2] / "configs" / "one_device.yaml"
    args = ["--config", str(config)]
    for o in ("logging.progress_bar=never", "logging.tensorboard=false", "model.name=mlp",
              "model.hidden_sizes=[8]", "train.global_batch_size=16", "train.steps=2",
              f"logging.dir={tmp_path / 'logs'}", *overrides):
        args += ["--set", o]
    return main(args)


def test_cli_float_labels_and_a_file_that_is_not_npz_exit_2(tmp_path, capsys):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    np.savez(tmp_path / "float.npz", x=x, y=rng.random(64).astype(np.float32))
    rc = _cli(tmp_path, "data.name=npz", f"data.path={tmp_path / 'float.npz'}",
              "model.num_classes=3")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "labels are floats such as" in err[0] and "expects integer class ids" in err[0]
    (tmp_path / "table.npz").write_text("x,y\n1,2\n")
    rc = _cli(tmp_path, "data.name=npz", f"data.path={tmp_path / 'table.npz'}")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert f"{tmp_path / 'table.npz'}: is not a .npz file" in err[0]


def test_cli_checkpoint_of_another_model_exits_2_in_one_line(tmp_path, capsys):
    ckpt = f"checkpoint.dir={tmp_path / 'ckpt'}"
    assert _cli(tmp_path, "data.name=synthetic", "data.num_examples=128", "data.num_features=4",
                ckpt) == 0
    capsys.readouterr()
    rc = _cli(tmp_path, "data.name=synthetic", "data.num_examples=128", "data.num_features=4",
              "model.hidden_sizes=[16]", "train.steps=4", ckpt)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err   # the recorded settings say so first
    assert "was trained with other settings: model.hidden_sizes: [8] -> [16]" in err[0]
    rc = _cli(tmp_path, "data.name=synthetic", "data.num_examples=128", "data.num_features=4",
              "model.hidden_sizes=[16]", "train.steps=4", ckpt,
              "checkpoint.allow_changes=[model.hidden_sizes]")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err   # allowed, the arrays still cannot be restored
    assert "was written for another model" in err[0]
    assert "(4, 8) there and (4, 16) here" in err[0] or "(8,) there and (16,) here" in err[0]
    assert err[0].endswith("use another checkpoint.dir or checkpoint.resume=false")
