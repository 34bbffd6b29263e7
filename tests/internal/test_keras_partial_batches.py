"""Keras ``fit`` / ``evaluate`` / ``predict`` on dataset sizes that do not divide over the replicas.

A last batch that does not split evenly (70 rows in batches of 32 on 4 replicas ends with 6
rows; 65 rows end with 1; ``predict`` of one sample) is padded and masked
(``jaxdist/_src/keras/partial_batches.py``). Every test compares with plain Keras on one device over
the same global batches: losses, metrics, weights after ``fit``, ``evaluate`` and ``predict``.
Needs 4 devices (8 forced CPU devices in CI, see conftest.py).
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":  # pragma: no cover
    pytest.skip("keras runs on another backend", allow_module_level=True)

from devutil import xla_flags  # noqa: E402

import jaxdist  # noqa: E402
from jaxdist._src.keras import partial_batches  # noqa: E402

_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(70, 5)).astype("float32")
Y = (X @ np.array([1.0, -2.0, 0.5, 1.5, -1.0], "float32") > 0).astype("int32")
W = _RNG.uniform(0.2, 2.0, size=70).astype("float32")


@pytest.fixture
def four():
    from devutil import first_devices

    # padding needs a batch that does not divide over the replicas
    return jaxdist.MirroredStrategy(first_devices(4))


def _model(batch_norm: bool = True, loss: object = None, steps_per_execution: int = 1,
           lr: float = 0.1):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((5,)), keras.layers.Dense(8, activation="relu")]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization())
    model = keras.Sequential([*layers, keras.layers.Dense(2)])
    model.compile(
        optimizer=keras.optimizers.SGD(lr),
        loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="w_acc")],
        steps_per_execution=steps_per_execution,
    )
    return model


def _in(strategy, make=_model, **kw):
    with strategy.scope():
        return make(**kw)


def _run(model, x=X, y=Y, **kw):
    """fit (2 epochs), evaluate, predict of every row and of one row."""
    hist = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, **kw).history
    ev = model.evaluate(x, y, batch_size=32, verbose=0, return_dict=True,
                        sample_weight=kw.get("sample_weight"))
    return {
        "hist": hist,
        "eval": ev,
        "pred": model.predict(x, batch_size=32, verbose=0),
        "one": model.predict(x[:1], verbose=0),
        "weights": [np.asarray(w) for w in model.get_weights()],
    }


_REFERENCES: dict = {}


def _reference(rows: int = 70, weighted: bool = False):
    """``_run`` of plain Keras on one device over the first ``rows`` rows (computed once per
    module: several tests compare with the same reference, and read it only)."""
    key = (rows, weighted)
    if key not in _REFERENCES:
        kw = {"sample_weight": W[:rows]} if weighted else {}
        _REFERENCES[key] = _run(_model(), X[:rows], Y[:rows], **kw)
    return _REFERENCES[key]


def _assert_same(got, want):
    assert got["hist"].keys() == want["hist"].keys()
    for k in want["hist"]:
        np.testing.assert_allclose(got["hist"][k], want["hist"][k], rtol=1e-5, atol=1e-6,
                                   err_msg=k)
    assert got["eval"].keys() == want["eval"].keys()
    for k in want["eval"]:
        np.testing.assert_allclose(got["eval"][k], want["eval"][k], rtol=1e-5, atol=1e-6,
                                   err_msg=k)
    for a, b in zip(got["weights"], want["weights"]):  # BatchNormalization moving stats too
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for k in ("pred", "one"):
        assert got[k].shape == want[k].shape, k
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [70, 65], ids=["last6", "last1"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "sample_weight"])
def test_uneven_sizes_match_one_device(four, rows, weighted):
    kw = {"sample_weight": W[:rows]} if weighted else {}
    want = _reference(rows, weighted)
    got = _run(_in(four), X[:rows], Y[:rows], **kw)
    _assert_same(got, want)
    assert got["pred"].shape == (rows, 2) and got["one"].shape == (1, 2)


def test_without_padding_the_numbers_differ(four, monkeypatch):
    # The test above can fail: with the mask ignored (every padded row real), the numbers move.
    want = _reference()  # plain Keras, computed (or cached) before the patch
    monkeypatch.setattr(partial_batches, "_weights", lambda model, sw, mask: (
        partial_batches.jnp.ones(mask.shape), partial_batches.jnp.ones(mask.shape),
        partial_batches.jnp.float32(mask.shape[0])))
    got = _run(_in(four), X, Y)
    with pytest.raises(AssertionError):
        _assert_same(got, want)


def test_loss_reductions_and_steps_per_execution(four):
    # "sum" adds padded rows' zero-weighted losses unscaled; "sum_over_batch_size" divides by
    # the real rows only. steps_per_execution=2 runs the padded batch inside an execution.
    # ("sum" adds 32 rows' losses: a smaller step keeps float noise from growing.)
    for loss, lr in (("sum", 0.005), ("mean_with_sample_weight", 0.1)):
        make = lambda loss=loss, lr=lr: _model(  # noqa: E731
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=loss),
            steps_per_execution=2, lr=lr)
        _assert_same(_run(_in(four, make), sample_weight=W), _run(make(), sample_weight=W))


def test_multi_output_loss_trackers(four):
    # Per-output loss trackers are weighted by the batch size in Keras: real rows here.
    def make():
        keras.utils.set_random_seed(0)
        inp = keras.Input((5,))
        h = keras.layers.Dense(8, activation="relu")(inp)
        model = keras.Model(inp, {"a": keras.layers.Dense(1, name="a")(h),
                                  "b": keras.layers.Dense(1, name="b")(h)})
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss={"a": "mse", "b": "mae"},
                      metrics={"a": ["mae"], "b": ["mse"]})
        return model

    ys = {"a": X[:, :1] * 2, "b": X[:, 1:2] - X[:, 2:3]}
    want = make().fit(X, ys, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    got = _in(four, make).fit(X, ys, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    assert {"a_loss", "b_loss"} <= got.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_validation_split_and_class_weight(four):
    kw = dict(batch_size=32, epochs=2, shuffle=False, verbose=0, validation_split=0.1,
              class_weight={0: 1.0, 1: 3.0})
    want = _model().fit(X, Y, **kw).history
    got = _in(four).fit(X, Y, **kw).history  # 63 training rows, 7 validation rows
    assert "val_loss" in got
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_fit_a_jaxdist_dataset(four):
    # Its batches are the global batches, as a tf.data.Dataset's are in Keras.
    ds = jaxdist.Dataset.from_tensor_slices((X, Y, W)).batch(32)
    val = jaxdist.Dataset.from_tensor_slices((X[:9], Y[:9])).batch(4)
    ref = _model()
    want = ref.fit(X, Y, sample_weight=W, batch_size=32, epochs=2, shuffle=False, verbose=0,
                   validation_data=(X[:9], Y[:9]), validation_batch_size=4).history
    model = _in(four)
    got = model.fit(ds, epochs=2, verbose=0, validation_data=val).history
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    got_eval = model.evaluate(ds, verbose=0, return_dict=True)
    want_eval = ref.evaluate(X, Y, sample_weight=W, batch_size=32, verbose=0, return_dict=True)
    for k in want_eval:
        np.testing.assert_allclose(got_eval[k], want_eval[k], rtol=1e-5, atol=1e-6)
    pred = model.predict(jaxdist.Dataset.from_tensor_slices(X).batch(32), verbose=0)
    assert pred.shape == (70, 2)
    np.testing.assert_allclose(pred, ref.predict(X, verbose=0), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="jaxdist.Dataset, `y` should not be passed"):
        model.fit(ds, Y, verbose=0)


@pytest.mark.devices(5)
def test_central_storage_partial_batches(devices):
    strategy = jaxdist.CentralStorageStrategy(devices[1:5], devices[0])
    _assert_same(_run(_in(strategy)), _reference())


def test_what_cannot_be_masked_raises(four):
    class Custom(keras.Sequential):
        def train_step(self, state, data):
            return super().train_step(state, data)

    with four.scope():
        keras.utils.set_random_seed(0)
        custom = Custom([keras.Input((5,)), keras.layers.Dense(1)])
        custom.compile(optimizer="sgd", loss="mse")
        reg = keras.Sequential([keras.Input((5,)),
                                keras.layers.Dense(1, activity_regularizer="l2")])
        reg.compile(optimizer="sgd", loss="mse")
    y = X[:, :1]
    custom.fit(X[:64], y[:64], batch_size=32, verbose=0)  # batches that divide: fine
    with pytest.raises(ValueError, match=r"a batch of 6 rows .*overrides train_step"):
        custom.fit(X, y, batch_size=32, verbose=0)
    with pytest.raises(ValueError, match="activity_regularizer"):
        reg.evaluate(X, y, batch_size=32, verbose=0)
    assert reg.predict(X[:3], verbose=0).shape == (3, 1)  # predict does not need a mask
    with pytest.raises(ValueError, match="cannot be split over 4 replicas"):
        reg.train_on_batch(X[:3], y[:3])


def test_keras_io_digits_example_runs_unchanged(four):
    # keras.io style: the data's natural size (1797 rows), batch 64, validation_split=0.1.
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer="adam", metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    kw = dict(batch_size=64, epochs=2, validation_split=0.1, shuffle=False, verbose=0)
    want = make().fit(x, y, **kw).history
    model = _in(four, make)
    got = model.fit(x, y, **kw).history  # 1617 training rows (last batch 17), 180 validation
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert model.predict(x[-5:], verbose=0).shape == (5, 10)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_input_across_processes_matches_one_device(tmp_path):
    # 2 processes x 2 CPU devices (jaxdist.launch on 127.0.0.1), one program on both (see
    # keras_partial_mw_worker.py): arrays, a shuffled jaxdist.Dataset and a tf.data.Dataset of
    # global batches of 32 are sharded across the processes (AutoShardPolicy.DATA; the last
    # global batch of 6 rows is 3 + 3), and an AutoShardPolicy.OFF dataset whose processes read
    # their own rows (last batch 4 + 2). Each must equal one device over the same global batches.
    import importlib.util
    import json
    import subprocess
    import sys

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
    sys.path.insert(0, here)
    import keras_partial_mw_worker as w

    runs = [r for r in w.RUNS if r != "tfdata" or importlib.util.find_spec("tensorflow")]
    env = dict(os.environ, JAX_PLATFORMS="cpu", KERAS_BACKEND="jax")
    for k in ("TF_CONFIG", "JAX_NUM_CPU_DEVICES"):
        env.pop(k, None)
    env["XLA_FLAGS"] = xla_flags()
    # The job starts first; the one-device references are computed while it runs.
    job = subprocess.Popen(
        [sys.executable, "-m", "jaxdist.launch", "--workers", "2", "--devices-per-process", "2",
         "--", sys.executable, os.path.join(here, "keras_partial_mw_worker.py"),
         str(tmp_path / "out"), ",".join(runs)],
        env=env, cwd=os.path.dirname(here), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    try:
        x, y = w.data()
        plain = w.model()
        want = {"history": plain.fit(x, y, batch_size=32, epochs=2, shuffle=False,
                                     verbose=0).history,
                "eval": plain.evaluate(x, y, batch_size=32, verbose=0, return_dict=True),
                "weights": plain.get_weights()}
        shuffled = w.model()
        ds = w.dataset(x, y)
        batches = list(ds) + list(ds)  # epochs 0 and 1 (each pass reshuffles)
        want_ds = {"history": shuffled.fit((b for b in batches), steps_per_epoch=3, epochs=2,
                                           verbose=0).history}
        want_ds["eval"] = shuffled.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
        want_ds["weights"] = shuffled.get_weights()
        output, _ = job.communicate(timeout=360)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 0, output[-4000:]
    for i in range(2):
        out = json.loads((tmp_path / f"out.{i}.json").read_text())
        assert (out["processes"], out["replicas"]) == (2, 4)
        for run in runs:
            got, ref = out[run], want_ds if run == "dataset" else want
            assert got["history"]["rows"] == [70.0, 70.0], run  # each row once per epoch
            for k in ref["history"]:
                np.testing.assert_allclose(got["history"][k], ref["history"][k], rtol=1e-5,
                                           atol=1e-6, err_msg=f"{run} {k}")
            for k in ref["eval"]:
                np.testing.assert_allclose(got["eval"][k], ref["eval"][k], rtol=1e-5,
                                           atol=1e-6, err_msg=f"{run} eval {k}")
            for a, b in zip(got["weights"], ref["weights"], strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=run)


def test_doc_dataset_example_runs_as_written(devices):
    # The jaxdist.Dataset example of docs/keras.md, executed as written on 4 devices.
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "keras.md").read_text()
    section = text[text.index("## `jaxdist.Dataset` and `tf.data.Dataset` as Keras input"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    ns: dict = {}
    exec(compile(code, "docs/keras.md", "exec"), ns)
    assert ns["model"].predict(ns["x"], verbose=0).shape == (70, 2)
