"""Keras models saved and loaded inside and outside jaxdist scopes keep their compile state.

``keras.models.load_model`` (a ``.keras`` zip), ``model.load_weights`` and the make-or-restore
pattern of TF's multi-worker tutorial and keras-io's distributed-training guide
(``load_model(latest_checkpoint)`` inside ``strategy.scope()``, then ``fit``) restore the
optimizer (its variables: Adam's moments and iteration count), the loss and the metrics exactly
as plain Keras does, whichever strategy (or none) saved and loads (a model trained under
``MirroredStrategy`` loaded in the same scope, under Mirrored over other devices,
``OneDeviceStrategy``, ``CentralStorageStrategy`` and no strategy). Every number is compared with
plain Keras doing the same on one device with no strategy (to 1e-5: the replicas' reduction
order). Needs 4 devices (8 forced CPU devices by default, see conftest.py).
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import warnings  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":  # pragma: no cover
    pytest.skip("keras runs on another backend", allow_module_level=True)

import jaxdist  # noqa: E402

pytestmark = pytest.mark.devices(4)

X = np.random.default_rng(0).normal(size=(32, 5)).astype("float32")
Y = (X @ np.arange(1, 6, dtype="float32")[:, None] / 5).astype("float32")
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(autouse=True)
def _no_cluster(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)


def _functional():
    inputs = keras.Input((5,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(h))


def _sequential():
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(1)])


BUILD = {"functional": _functional, "sequential": _sequential}


def _compiled(kind):
    keras.utils.set_random_seed(0)
    m = BUILD[kind]()
    m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return m


def _fit(m, epochs=1):
    return m.fit(X, Y, batch_size=8, epochs=epochs, shuffle=False, verbose=0).history


def _state(m):
    """What a restore must bring back: weights, optimizer variables, compile config."""
    return {"weights": [np.asarray(w) for w in m.get_weights()],
            "optimizer": [np.asarray(v) for v in m.optimizer.variables],
            "optimizer_names": [(v.name.rsplit("_", 1)[-1], tuple(v.shape))
                                for v in m.optimizer.variables],
            "loss": m.loss, "compile": _compile_config(m)}


def _compile_config(m):
    """The compile config, but the optimizer's generated name (``adam``, ``adam_1``, ...)."""
    config = dict(m.get_compile_config())
    optimizer = dict(config["optimizer"])
    optimizer["config"] = {k: v for k, v in optimizer["config"].items() if k != "name"}
    config["optimizer"] = optimizer
    return config


def _close(got, want, exact=False):
    assert got["optimizer_names"] == want["optimizer_names"]
    assert got["loss"] == want["loss"]
    assert got["compile"] == want["compile"]
    for key in ("weights", "optimizer"):
        assert len(got[key]) == len(want[key])
        for a, b in zip(got[key], want[key]):
            if exact:
                np.testing.assert_array_equal(a, b)
            else:
                np.testing.assert_allclose(a, b, **TOL)


def _after_one_more_epoch(m):
    """One more epoch of ``fit`` and an ``evaluate``: the restored state in use."""
    hist = _fit(m)
    return {**_state(m), "history": hist, "evaluate": m.evaluate(X, Y, verbose=0)}


def _assert_same_run(got, want, exact=False):
    _close(got, want, exact)
    for k, v in want["history"].items():
        np.testing.assert_allclose(got["history"][k], v, **TOL)
    np.testing.assert_allclose(got["evaluate"], want["evaluate"], **TOL)


def _load_quietly(path):
    """``keras.models.load_model`` that fails on Keras's "compile() was not called" warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*compile.*was not called.*")
        return keras.models.load_model(path)


LOADERS = {
    "same_scope": lambda saver: saver,
    "other_strategy": lambda saver: jaxdist.MirroredStrategy(jax.devices()[:4]),
    "one_device": lambda saver: jaxdist.OneDeviceStrategy(jax.devices()[1]),
    "central_storage": lambda saver: jaxdist.CentralStorageStrategy(jax.devices()[:2]),
    "no_strategy": lambda saver: None,
}


def _scope(strategy):
    import contextlib

    return strategy.scope() if strategy is not None else contextlib.nullcontext()


@pytest.fixture(scope="module", params=sorted(BUILD))
def saved(request, tmp_path_factory):
    """A model trained 2 epochs under MirroredStrategy (2 devices) and saved as ``.keras``
    and ``.weights.h5``, and plain Keras's same training (no strategy) saved the same way."""
    kind = request.param
    tmp = tmp_path_factory.mktemp(kind)
    strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
    with strategy.scope():
        m = _compiled(kind)
        _fit(m, epochs=2)
    m.save(tmp / "mirrored.keras")
    m.save_weights(tmp / "mirrored.weights.h5")
    plain = _compiled(kind)
    _fit(plain, epochs=2)
    plain.save(tmp / "plain.keras")
    return {"kind": kind, "tmp": tmp, "strategy": strategy, "trained": _state(m),
            "plain": _state(plain)}


def test_training_under_a_strategy_saves_what_plain_keras_saves(saved):
    assert int(np.asarray(saved["plain"]["optimizer"][0])) == 8  # Adam's iterations: 2 x 4
    _close(saved["trained"], saved["plain"])


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_load_model_restores_the_compile_state(saved, loader):
    """``load_model`` of the Mirrored-trained ``.keras`` zip under the same scope, another
    strategy or none: optimizer variables, loss and metrics as saved, and the next epoch as
    plain Keras's next epoch from its own save."""
    strategy = LOADERS[loader](saved["strategy"])
    with _scope(strategy):
        m = _load_quietly(saved["tmp"] / "mirrored.keras")
    assert m.optimizer is not None and m.compiled
    _close(_state(m), saved["trained"], exact=True)  # the file's values, bit for bit
    with _scope(strategy):
        got = _after_one_more_epoch(m)
    assert got["compile"]["metrics"] == ["mae"]
    want = _after_one_more_epoch(_load_quietly(saved["tmp"] / "plain.keras"))
    _assert_same_run(got, want)


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_load_weights_restores_the_optimizer_variables(saved, loader):
    """``model.load_weights`` into a freshly compiled model (built, optimizer built) restores
    the saved optimizer variables too, as it does in plain Keras."""
    strategy = LOADERS[loader](saved["strategy"])
    with _scope(strategy):
        m = _compiled(saved["kind"])
        m.optimizer.build(m.trainable_variables)
        m.load_weights(saved["tmp"] / "mirrored.weights.h5")
    plain = _compiled(saved["kind"])
    plain.optimizer.build(plain.trainable_variables)
    plain.load_weights(saved["tmp"] / "mirrored.weights.h5")
    _close(_state(m), _state(plain), exact=True)
    _close(_state(m), saved["trained"], exact=True)
    with _scope(strategy):
        got = _after_one_more_epoch(m)
    _assert_same_run(got, _after_one_more_epoch(plain))


def test_a_model_loaded_in_a_scope_keeps_its_strategy_outside_it(saved):
    """As a model compiled in a scope: loaded (and so compiled) in the scope, its ``fit``
    outside the scope is data-parallel over the strategy's replicas."""
    with saved["strategy"].scope():
        m = _load_quietly(saved["tmp"] / "mirrored.keras")
    got = _after_one_more_epoch(m)  # outside the scope
    assert len(m.trainable_variables[0].value.sharding.device_set) == 2
    _assert_same_run(got, _after_one_more_epoch(_load_quietly(saved["tmp"] / "plain.keras")))


def _make_or_restore(checkpoint_dir, kind):
    """keras-io's ``make_or_restore_model`` (distributed training guide) / TF's tutorial."""
    checkpoints = [os.path.join(checkpoint_dir, name) for name in os.listdir(checkpoint_dir)]
    if checkpoints:
        latest_checkpoint = max(checkpoints, key=os.path.getctime)
        return keras.models.load_model(latest_checkpoint)
    return _compiled(kind)


def _make_or_restore_run(checkpoint_dir, kind, strategy, epochs):
    with _scope(strategy):
        model = _make_or_restore(checkpoint_dir, kind)
    callbacks = [keras.callbacks.ModelCheckpoint(
        filepath=os.path.join(checkpoint_dir, "ckpt-{epoch}.keras"))]
    initial = len(os.listdir(checkpoint_dir))
    model.fit(X, Y, batch_size=8, epochs=initial + epochs, initial_epoch=initial,
              shuffle=False, verbose=0, callbacks=callbacks)
    return _state(model)


@pytest.mark.parametrize("kind", sorted(BUILD))
def test_make_or_restore_continues_training_as_if_uninterrupted(tmp_path, kind):
    """Fit 2 epochs (checkpointing each), restart: ``load_model(latest)`` inside the scope,
    fit 1 more. The result is plain Keras's 3 uninterrupted epochs (Adam's state restored:
    without it the third epoch would differ)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _make_or_restore_run(ckpt, kind, jaxdist.MirroredStrategy(jax.devices()[:2]), epochs=2)
    got = _make_or_restore_run(ckpt, kind, jaxdist.MirroredStrategy(jax.devices()[:2]), epochs=1)
    assert sorted(os.listdir(ckpt)) == ["ckpt-1.keras", "ckpt-2.keras", "ckpt-3.keras"]
    plain = _compiled(kind)
    _fit(plain, epochs=3)
    _close(got, _state(plain))
