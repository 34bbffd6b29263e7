"""Keras 3 ``model.fit`` under ``ParameterServerStrategy`` (``jaxdist.keras.attach``).

Local (no cluster: the variables on a LocalClient ps): each Keras optimizer's translation
gives Keras's own numbers; rejected optimizers and callbacks. Real clusters (slow): 1 ps / 1
worker between-graph equals single-device Keras; 2 workers train asynchronously.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import numpy as np  # noqa: E402
import pytest  # noqa: E402

keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":  # pragma: no cover
    pytest.skip("keras runs on another backend", allow_module_level=True)

from devutil import xla_flags  # noqa: E402

import jaxdist  # noqa: E402
import jaxdist.keras as jk  # noqa: E402
from jaxdist._src.keras.ps_optimizers import keras_optimizer_spec  # noqa: E402

X = np.random.default_rng(0).normal(size=(32, 5)).astype("float32")
Y = (X @ np.arange(1, 6, dtype="float32")[:, None] / 5).astype("float32")


@pytest.fixture(autouse=True)
def _no_cluster(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)


def _model(optimizer, steps_per_execution=1, metrics=("mae",)):
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                          keras.layers.Dense(1)])
    m.compile(optimizer=optimizer, loss="mse", metrics=list(metrics),
              steps_per_execution=steps_per_execution)
    return m


def _fit(m, **kw):
    return m.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0, **kw).history


OPTIMIZERS = {
    "sgd": (lambda: keras.optimizers.SGD(0.1), 1e-6),
    "nesterov": (lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True), 1e-6),
    "rmsprop_centered": (lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
                         1e-6),
    "adagrad": (lambda: keras.optimizers.Adagrad(0.1), 1e-6),
    # epsilon before / after the bias correction (documented): a 1e-5-level difference
    "adam": (lambda: keras.optimizers.Adam(0.01), 1e-4),
    "adamw_clipvalue": (lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1, clipvalue=0.5),
                        1e-4),
    "sgd_exponential_decay": (lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5)), 1e-6),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_local_fit_matches_keras(name):
    make, tol = OPTIMIZERS[name]
    ref = _model(make())
    h_ref = _fit(ref)
    m = _model(make())
    training = jk.attach(m, jaxdist.ParameterServerStrategy())
    h = _fit(m)
    assert training.steps == 8
    np.testing.assert_allclose(h["loss"], h_ref["loss"], rtol=tol)
    np.testing.assert_allclose(h["mae"], h_ref["mae"], rtol=tol)
    for a, b in zip(m.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
    # the model's weights are the ps's (pulled at the end of fit)
    for a, b in zip(m.trainable_variables, training.variables.pull()):
        np.testing.assert_array_equal(np.asarray(a.value), b)


def test_a_worker_splits_its_batch_over_its_compute_devices():
    import jax

    n = len(jax.local_devices())  # batches of 8 rows: 1, 2, 4 or 8 devices
    if 8 % n:
        pytest.skip(f"batches of 8 rows cannot be split over {n} devices")
    strategy = jaxdist.ParameterServerStrategy()
    assert len(strategy.extended.worker_devices) == n
    m = _model(keras.optimizers.SGD(0.1))
    training = jk.attach(m, strategy)
    h = _fit(m)
    ref = _model(keras.optimizers.SGD(0.1))
    np.testing.assert_allclose(h["loss"], _fit(ref)["loss"], rtol=1e-5)
    if n > 1:  # the step splits the batch over a mesh of all n devices, and n + 1 rows do not split
        assert len(training._compute._split.mesh.devices.flat) == n
        m = _model(keras.optimizers.SGD(0.1))
        jk.attach(m, jaxdist.ParameterServerStrategy())
        with pytest.raises(ValueError, match=f"a batch of {n + 1} rows cannot be split over "
                                             f"this worker's {n} compute devices"):
            m.fit(X[:2 * (n + 1)], Y[:2 * (n + 1)], batch_size=n + 1, verbose=0)


def test_steps_per_execution_validation_and_evaluate():
    ref = _model(keras.optimizers.SGD(0.1), steps_per_execution=3)
    h_ref = _fit(ref, validation_data=(X[:16], Y[:16]))
    m = _model(keras.optimizers.SGD(0.1), steps_per_execution=3)
    jk.attach(m, jaxdist.ParameterServerStrategy())
    h = _fit(m, validation_data=(X[:16], Y[:16]))
    for k in ("loss", "mae", "val_loss", "val_mae"):
        np.testing.assert_allclose(h[k], h_ref[k], rtol=1e-6)
    np.testing.assert_allclose(m.evaluate(X, Y, verbose=0), ref.evaluate(X, Y, verbose=0),
                               rtol=1e-6)


def test_batchnorm_statistics_stay_on_the_worker():
    def make():
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8),
                              keras.layers.BatchNormalization(), keras.layers.Dense(1)])
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return m

    ref, m = make(), make()
    h_ref = _fit(ref)
    training = jk.attach(m, jaxdist.ParameterServerStrategy())
    h = _fit(m)
    np.testing.assert_allclose(h["loss"], h_ref["loss"], rtol=1e-6)
    assert len(training.variables.pull()) == len(m.trainable_variables) == 6
    for a, b in zip(m.non_trainable_variables, ref.non_trainable_variables):
        np.testing.assert_allclose(np.asarray(a.value), np.asarray(b.value), rtol=1e-5,
                                   atol=1e-8)  # batch statistics summed over the devices


def test_model_checkpoint_pulls_the_ps_weights(tmp_path):
    m = _model(keras.optimizers.SGD(0.1))
    training = jk.attach(m, jaxdist.ParameterServerStrategy())
    path = str(tmp_path / "w.weights.h5")
    _fit(m, callbacks=[keras.callbacks.ModelCheckpoint(path, save_weights_only=True,
                                                       save_freq=1)])
    saved = _model(keras.optimizers.SGD(0.1))
    saved.load_weights(path)
    for a, b in zip(saved.get_weights(), training.variables.pull()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("make, match", [
    (lambda: keras.optimizers.Adam(amsgrad=True), "Adam with amsgrad=True"),
    (lambda: keras.optimizers.SGD(0.1, clipnorm=1.0), "per-variable clipnorm"),
    (lambda: keras.optimizers.SGD(0.1, weight_decay=0.01), "weight_decay=0.01"),
    (lambda: keras.optimizers.Nadam(), "Nadam has no parameter-server equivalent"),
    (lambda: keras.optimizers.Adam(keras.optimizers.schedules.CosineDecay(0.1, 10)),
     "learning-rate schedule CosineDecay"),
    (lambda: keras.optimizers.SGD(0.1, use_ema=True), "use_ema=True"),
])
def test_optimizers_without_ps_equivalent_are_rejected(make, match):
    with pytest.raises(ValueError, match=match):
        keras_optimizer_spec(make())
    m = _model(make())
    with pytest.raises(ValueError, match=match):
        jk.attach(m, jaxdist.ParameterServerStrategy())


def test_global_clipnorm_runs_on_the_worker():
    spec = keras_optimizer_spec(keras.optimizers.SGD(0.1, global_clipnorm=1.0))
    assert spec.worker_part().name == "clip_by_global_norm"
    assert spec.ps_part().name == "sgd"


@pytest.mark.parametrize("callback, match", [
    (lambda: keras.callbacks.ReduceLROnPlateau(), "ReduceLROnPlateau does not work"),
    (lambda: keras.callbacks.LearningRateScheduler(lambda e, lr: lr), "LearningRateScheduler"),
    (lambda: keras.callbacks.BackupAndRestore("/tmp/unused"), "strategy.extended.save"),
    (lambda: keras.callbacks.EarlyStopping(restore_best_weights=True), "restore_best_weights"),
])
def test_callbacks_needing_local_state_are_rejected(callback, match):
    m = _model(keras.optimizers.SGD(0.1))
    jk.attach(m, jaxdist.ParameterServerStrategy())
    with pytest.raises(ValueError, match=match):
        _fit(m, callbacks=[callback()])
    with pytest.raises(ValueError, match=match):  # passed by position too
        m.fit(X, Y, 8, 1, 0, [callback()])
    _fit(m, callbacks=[keras.callbacks.EarlyStopping(monitor="loss", patience=1)])


def test_attach_errors():
    m = _model(keras.optimizers.SGD(0.1))
    with pytest.raises(TypeError, match="needs a ParameterServerStrategy"):
        jk.attach(m, jaxdist.OneDeviceStrategy(jax.devices()[0]))
    raw = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="after model.compile"):
        jk.attach(raw, jaxdist.ParameterServerStrategy())
    jk.attach(m, jaxdist.ParameterServerStrategy())
    m.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    with pytest.raises(ValueError, match="compiled again with another optimizer"):
        _fit(m)



def _lazy_model(optimizer):
    """The model of TF's tutorial: no Input, not called yet (Keras builds it from a batch)."""
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    m.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    return m


def test_a_lazily_built_model_is_built_at_its_first_fit_and_matches_keras():
    """As TF's fit: attach accepts a model without an Input; its first fit builds it from the
    first batch, then its variables go to the ps; the numbers are Keras's own."""
    ref = _lazy_model(keras.optimizers.Adagrad(0.1))
    h_ref = _fit(ref)
    m = _lazy_model(keras.optimizers.Adagrad(0.1))
    training = jk.attach(m, jaxdist.ParameterServerStrategy())
    assert not m.built and training.variables is None
    with pytest.raises(RuntimeError, match="is not built yet, so nothing is on the ps"):
        training.pull_weights()
    h = _fit(m)
    assert m.built and training.steps == 8
    np.testing.assert_allclose(h["loss"], h_ref["loss"], rtol=1e-6)
    for a, b, c in zip(m.trainable_variables, training.variables.pull(), ref.get_weights()):
        np.testing.assert_array_equal(np.asarray(a.value), b)   # the ps's values
        np.testing.assert_allclose(b, c, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("first", ["evaluate", "predict"])
def test_a_lazily_built_model_used_first_by_evaluate_or_predict_goes_to_the_ps(first):
    m = _lazy_model(keras.optimizers.SGD(0.1))
    training = jk.attach(m, jaxdist.ParameterServerStrategy())
    if first == "evaluate":
        m.evaluate(X, Y, verbose=0)
    else:
        assert m.predict(X[:4], verbose=0).shape == (4, 1)
    assert training.variables is not None
    before = [np.array(x) for x in training.variables.pull()]
    _fit(m)                                     # trains the very variables created then
    after = training.variables.pull()
    assert all(not np.array_equal(a, b) for a, b in zip(before, after))
    for a, b in zip(m.trainable_variables, after):
        np.testing.assert_array_equal(np.asarray(a.value), b)


# ---------------------------------------------------------------------- sparse embeddings
IDS = np.random.default_rng(1).integers(0, 50, size=(32, 3)).astype("int32")
YE = np.random.default_rng(2).normal(size=(32, 1)).astype("float32")


def _emb_model(optimizer):
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(50, 4,
                                                                                   name="emb"),
                          keras.layers.Flatten(name="flat"), keras.layers.Dense(1)])
    m.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    return m


class _Counter:
    """Counts what the client asks of the ps: rows by method, whole-variable pulls."""

    def __init__(self, client):
        self.rows = {"PullRows": 0, "PushRows": 0}
        self.pulled_keys: list[str] = []
        self._call = client.call
        client.call = self

    def __call__(self, task, method, meta=None, arrays=None, timeout=None):
        if method in self.rows:
            self.rows[method] += sum(len(a) for k, a in (arrays or {}).items()
                                     if k.startswith("ids/"))
        if method == "Pull":
            self.pulled_keys += list((meta or {}).get("keys", []))
        return self._call(task, method, meta, arrays, timeout=timeout)


@pytest.mark.parametrize("make", [lambda: keras.optimizers.SGD(0.5),
                                  lambda: keras.optimizers.Adagrad(0.5)])
def test_sparse_embedding_pulls_only_the_batch_rows_and_matches_keras(make):
    ref = _emb_model(make())
    h_ref = ref.fit(IDS, YE, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    m = _emb_model(make())
    strategy = jaxdist.ParameterServerStrategy()
    training = jk.attach(m, strategy, sparse_embeddings=["emb"])
    assert tuple(m.get_layer("emb").embeddings.shape) == (1, 4)   # the table left the worker
    counter = _Counter(strategy.extended.ps_client)
    h = m.fit(IDS, YE, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    np.testing.assert_allclose(h["loss"], h_ref["loss"], rtol=1e-5)
    unique_per_batch = sum(len(np.unique(IDS[i:i + 8])) for i in range(0, 32, 8))
    assert counter.rows == {"PullRows": 2 * unique_per_batch, "PushRows": 2 * unique_per_batch}
    assert not [k for k in counter.pulled_keys if "emb" in k]  # never the whole table
    assert training.tables[0].rows_pulled == 2 * unique_per_batch < 8 * 24
    np.testing.assert_allclose(m.evaluate(IDS, YE, verbose=0), ref.evaluate(IDS, YE, verbose=0),
                               rtol=1e-5)
    np.testing.assert_allclose(m.predict(IDS, verbose=0), ref.predict(IDS, verbose=0),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="pull_weights\\(full_tables=True\\)"):
        m.save_weights("/tmp/unused.weights.h5")
    training.pull_weights(full_tables=True)
    for a, b in zip(m.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_sparse_embedding_refusals():
    m = _emb_model(keras.optimizers.Adam(0.01))
    with pytest.raises(ValueError, match="lazy"):
        jk.attach(m, jaxdist.ParameterServerStrategy(), sparse_embeddings=["emb"])
    m = _emb_model(keras.optimizers.Adam(0.01))  # explicit lazy Adam: accepted
    jk.attach(m, jaxdist.ParameterServerStrategy(), sparse_embeddings=["emb"],
              embedding_optimizer=jaxdist._src.ps.optimizers.adam(0.01))
    m.fit(IDS, YE, batch_size=8, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="expected a plain keras.layers.Embedding"):
        jk.attach(_emb_model(keras.optimizers.SGD(0.1)), jaxdist.ParameterServerStrategy(),
                  sparse_embeddings=["flat"])
    inp = keras.Input((3,))
    deep = keras.layers.Embedding(50, 4, name="deep")(keras.ops.cast(inp, "int32"))
    f = keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(deep)))
    f.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="does not take a model input directly"):
        jk.attach(f, jaxdist.ParameterServerStrategy(), sparse_embeddings=["deep"])


# ---------------------------------------------------------------------- real clusters
def _worker_results(num_workers, epochs, optimizer, devices=1):
    from ps_cluster_util import make_cluster, run_workers, start_ps, stop

    cluster = make_cluster(1, num_workers)
    ps = start_ps(cluster, 0)
    env = {"KERAS_BACKEND": "jax", "JAX_NUM_CPU_DEVICES": str(devices),
           "XLA_FLAGS": xla_flags(devices)}
    try:
        return run_workers(cluster, "keras_ps_worker.py", [str(epochs), optimizer],
                           timeout=240.0, extra_env=env)
    finally:
        assert stop(ps) == 0


@pytest.mark.slow
def test_between_graph_one_worker_matches_single_device_keras():
    import keras_ps_worker as w

    (out,) = _worker_results(1, 2, "adam", devices=2)  # each batch split over 2 devices
    ref = w.model("adam")
    h = ref.fit(w.X, w.Y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    assert out["steps"] == 16 and out["devices"] == 2
    np.testing.assert_allclose(out["loss"], h["loss"], rtol=1e-4)
    for a, b in zip(out["weights"], ref.get_weights()):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_between_graph_two_workers_train_asynchronously():
    outs = _worker_results(2, 4, "sgd")
    assert sorted(o["worker"] for o in outs) == [0, 1]
    for o in outs:
        assert o["steps"] == 16  # 32 rows each, batches of 8, 4 epochs
        assert o["loss"][-1] < 0.5 * o["loss"][0], o["loss"]


def test_a_model_compiled_in_the_scope_but_not_attached_refuses_to_fit_locally():
    # TF's guide: build and compile inside ParameterServerStrategy().scope(), then fit. Without
    # attach, fit would train a local copy and leave the ps unchanged: it must fail loudly.
    strategy = jaxdist.ParameterServerStrategy()
    with strategy.scope():
        m = _model(keras.optimizers.SGD(0.1))
    with pytest.raises(RuntimeError, match=r"not attached.*jaxdist\.keras\.attach"):
        _fit(m)
    with strategy.scope():  # fit inside the scope is refused as well
        with pytest.raises(RuntimeError, match="jaxdist.keras.attach"):
            _fit(_model(keras.optimizers.SGD(0.1)))
    # attached, the same model trains on the ps; a model compiled outside trains locally
    training = jk.attach(m, strategy)
    assert len(_fit(m)["loss"]) == 2 and training.steps == 8
    local = _model(keras.optimizers.SGD(0.1))
    assert len(_fit(local)["loss"]) == 2
