"""Keras 3 ``model.fit`` under synchronous jaxdist strategies (``jaxdist.keras.scope``).

Each test trains the same tiny model on one device and under a strategy over the same global
batches, and compares losses, metrics and weights.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":  # pragma: no cover
    pytest.skip("keras runs on another backend", allow_module_level=True)

import jaxdist  # noqa: E402
import jaxdist.keras as jk  # noqa: E402

X = np.random.default_rng(0).normal(size=(32, 5)).astype("float32")
Y = (X @ np.arange(1, 6, dtype="float32")[:, None] / 5).astype("float32")


def _model(steps_per_execution: int = 1):
    keras.utils.set_random_seed(0)
    m = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )
    m.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss="mse",
        metrics=["mae"],
        steps_per_execution=steps_per_execution,
    )
    return m


def _fit(model, **kw):
    return model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0, **kw).history


@pytest.fixture(scope="module")
def reference():
    m = _model()
    hist = _fit(m)
    return hist, [np.asarray(w) for w in m.get_weights()]


def _assert_same(hist, weights, reference):
    ref_hist, ref_w = reference
    for k in ref_hist:
        np.testing.assert_allclose(hist[k], ref_hist[k], rtol=1e-5, atol=1e-6)
    for a, b in zip(weights, ref_w):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda d: jaxdist.MirroredStrategy(d[:4]),
        lambda d: jaxdist.MirroredStrategy(d[:2]),
        lambda d: jaxdist.OneDeviceStrategy(d[-1]),
        lambda d: jaxdist.TPUStrategy(devices=d[:4]),
        lambda d: jaxdist.MirroredStrategy(
            d[:4], cross_device_ops=jaxdist.HierarchicalCopyAllReduce()
        ),
        lambda d: jaxdist.MultiWorkerMirroredStrategy(),  # one process: every local device
    ],
    ids=["mirrored4", "mirrored2", "one_device", "tpu_on_cpu", "hierarchical", "multi_worker1"],
)
def test_fit_matches_one_device(devices, reference, make):
    strategy = make(devices)
    with jk.scope(strategy):
        model = _model()
        hist = _fit(model)
        kernel = model.weights[0].value
    assert kernel.sharding.device_set == set(strategy.extended.worker_devices)
    assert kernel.sharding.is_fully_replicated
    _assert_same(hist, model.get_weights(), reference)
    assert hist["loss"][1] < hist["loss"][0]


@pytest.mark.devices(4)
def test_batches_are_split_over_replicas(devices):
    strategy = jaxdist.MirroredStrategy(devices[:4])
    with jk.scope(strategy):
        dist = keras.distribution.distribution()
        layout = dist.get_data_layout((8, 5)).backend_layout
        assert layout.shard_shape((8, 5)) == (2, 5)
        with pytest.raises(ValueError, match="divisible by 4"):
            dist.get_data_layout((6, 5))


@pytest.mark.devices(4)
def test_evaluate_and_predict_match(devices, reference):
    ref = _model()
    _fit(ref)
    want_eval = ref.evaluate(X, Y, batch_size=8, verbose=0)
    want_pred = ref.predict(X, batch_size=8, verbose=0)
    with jk.scope(jaxdist.MirroredStrategy(devices[:4])):
        model = _model()
        _fit(model)
        got_eval = model.evaluate(X, Y, batch_size=8, verbose=0)
        got_pred = model.predict(X, batch_size=8, verbose=0)
    np.testing.assert_allclose(got_eval, want_eval, rtol=1e-5)
    np.testing.assert_allclose(got_pred, want_pred, rtol=1e-5, atol=1e-6)


@pytest.mark.devices(2)
def test_callbacks_metrics_and_steps_per_execution(devices, reference):
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((batch, float(logs["loss"])))

        def on_epoch_end(self, epoch, logs=None):
            # Reading weights mid-fit syncs Keras's JAX state; training must continue from it.
            seen.append(("epoch", epoch, float(self.model.weights[0].numpy().sum())))

    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=1e9)
    with jk.scope(jaxdist.MirroredStrategy(devices[:2])):
        model = _model(steps_per_execution=2)
        hist = _fit(model, callbacks=[Record()])
        _assert_same(hist, model.get_weights(), reference)
        stopped = _model()
        stopped_hist = stopped.fit(
            X, Y, batch_size=8, epochs=5, shuffle=False, verbose=0, callbacks=[stop]
        ).history
    # 4 batches per epoch, 2 per execution: the callback sees batches 1 and 3.
    assert [b for b, *_ in seen if b != "epoch"] == [1, 3, 1, 3]
    assert [s[1] for s in seen if s[0] == "epoch"] == [0, 1]
    assert len(stopped_hist["loss"]) == 2  # EarlyStopping stopped it after the 2nd epoch


def test_non_strategies_are_rejected():
    with pytest.raises(TypeError, match="expected a jaxdist strategy"):
        jk.scope(object()).__enter__()
    assert keras.distribution.distribution() is None


def test_wrong_backend_message(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "tensorflow")
    with pytest.raises(RuntimeError, match="KERAS_BACKEND=jax"):
        jk.require_keras()


@pytest.mark.devices(2)
def test_distribution_scope_is_noop_without_keras(devices, monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "keras")
    with jk.distribution_scope(jaxdist.MirroredStrategy(devices[:2])) as dist:
        assert dist is None


@pytest.mark.devices(4)
def test_fit_outside_the_scope_gives_the_same_numbers(devices, reference):
    # TF's guide builds and compiles in the scope and calls fit outside it.
    strategy = jaxdist.MirroredStrategy(devices[:4])
    with jk.scope(strategy):
        model = _model()
    seen = []

    class Where(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append((jaxdist.get_strategy(), keras.distribution.distribution()))

    hist = _fit(model, callbacks=[Where()])
    _assert_same(hist, model.get_weights(), reference)
    assert model.weights[0].value.sharding.device_set == set(devices[:4])
    # ... and, as in TF, that fit is distributed: the model's strategy is entered again
    assert seen and all(s is strategy and d.strategy is strategy for s, d in seen), seen
    assert keras.distribution.distribution() is None and not jaxdist.has_strategy()


@pytest.mark.devices(2)
def test_distribution_scope_is_the_strategy_scope_hook(devices, reference):
    # What Strategy.scope() would enter after jax.set_mesh (one line; see jaxdist.keras).
    strategy = jaxdist.MirroredStrategy(devices[:2])
    with strategy.scope(), jk.distribution_scope(strategy) as dist:
        assert dist.strategy is strategy
        model = _model()
        hist = _fit(model)
    _assert_same(hist, model.get_weights(), reference)
    assert keras.distribution.distribution() is None


@pytest.mark.devices(4)
def test_plain_strategy_scope_is_enough(devices, reference):
    # The TF guide's sample: no jaxdist.keras in sight, only strategy.scope().
    strategy = jaxdist.MirroredStrategy(devices[:4])
    with strategy.scope():
        assert keras.distribution.distribution().strategy is strategy
        model = _model()
        hist = _fit(model)
    assert keras.distribution.distribution() is None
    assert model.weights[0].value.sharding.device_set == set(devices[:4])
    _assert_same(hist, model.get_weights(), reference)


@pytest.mark.devices(2)
def test_scope_hook_skips_other_backends(devices, monkeypatch):
    strategy = jaxdist.MirroredStrategy(devices[:2])
    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")
    with strategy.scope():
        assert keras.distribution.distribution() is None


@pytest.mark.parametrize("spe", [1, 2], ids=["spe1", "spe2"])
@pytest.mark.devices(5)
def test_central_storage_matches_one_device(devices, reference, spe):
    compute = devices[1:5] or devices[:1]  # apart from the parameter device where possible
    strategy = jaxdist.CentralStorageStrategy(compute, devices[0])
    moved = []

    class Where(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            moved.append({d for v in self.model.variables for d in v.value.sharding.device_set})

    with strategy.scope():
        model = _model(steps_per_execution=spe)
        hist = _fit(model, callbacks=[Where()])
        got_eval = model.evaluate(X, Y, batch_size=8, verbose=0, return_dict=True)
        pred = model.predict(X, batch_size=8, verbose=0)
    # Every variable (weights, optimizer slots, metric state) lives on the parameter device.
    assert moved == [{devices[0]}, {devices[0]}]
    assert {d for v in model.variables for d in v.value.sharding.device_set} == {devices[0]}
    _assert_same(hist, model.get_weights(), reference)
    ref = _model()
    ref.set_weights(model.get_weights())
    want = ref.evaluate(X, Y, batch_size=8, verbose=0, return_dict=True)
    np.testing.assert_allclose(got_eval["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_allclose(pred, ref.predict(X, batch_size=8, verbose=0), rtol=1e-5, atol=1e-6)


@pytest.mark.devices(3)
def test_central_storage_step_runs_on_the_compute_devices(devices):
    compute = devices[1:3] or devices[:1]  # apart from the parameter device where possible
    strategy = jaxdist.CentralStorageStrategy(compute, devices[0])
    seen = {}
    with strategy.scope():
        model = _model()
        model.optimizer.build(model.trainable_variables)
        model.make_train_function()
        step = model.train_function
        state = model._get_jax_state(
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
        )
        layout = keras.distribution.distribution().get_data_layout((8, 5)).backend_layout
        batch = (jax.device_put(X[:8], layout), jax.device_put(Y[:8], layout))
        seen["batch"] = batch[0].sharding.device_set
        _, new_state = step(state, iter([batch]))
    assert seen["batch"] == set(compute)
    assert {a.sharding.device_set == {devices[0]} for a in jax.tree.leaves(new_state)} == {True}
    # A model outside any central-storage scope keeps Keras's own step.
    plain = _model()
    plain.make_train_function()
    from jaxdist._src.keras import central_storage

    assert central_storage._central_step_strategy(plain.train_function) is None



@pytest.mark.devices(2)
def test_tensorboard_without_tensorflow(devices, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with pytest.raises(ValueError, match="update_freq"):
        jk.TensorBoard(tmp_path, update_freq=0)
    with jaxdist.MirroredStrategy(devices[:2]).scope():
        model = _model()
        hist = model.fit(
            X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0, validation_data=(X, Y),
            callbacks=[jk.TensorBoard(tmp_path, update_freq=2)],
        ).history
    train = EventAccumulator(str(tmp_path / "train")).Reload()
    val = EventAccumulator(str(tmp_path / "validation")).Reload()
    got = [e.value for e in train.Scalars("epoch_loss")]
    np.testing.assert_allclose(got, hist["loss"], rtol=1e-6)
    np.testing.assert_allclose([e.value for e in val.Scalars("epoch_loss")], hist["val_loss"],
                               rtol=1e-6)
    assert [e.step for e in train.Scalars("batch_loss")] == [2, 4, 6, 8]


def test_keras_file_callbacks_are_refused_in_a_multi_process_job(devices, monkeypatch, tmp_path):
    # Keras's own ModelCheckpoint / BackupAndRestore know nothing about processes: every process
    # would write the same files. The jaxdist.keras versions write from the chief only.
    from jaxdist._src.keras import model_strategy

    with jaxdist.MirroredStrategy(devices[:1]).scope():  # a model of a strategy (fit outside)
        model = _model()
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    for cb, name in [(keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras")),
                      "ModelCheckpoint"),
                     (keras.callbacks.BackupAndRestore(str(tmp_path / "b")), "BackupAndRestore")]:
        with pytest.raises(ValueError, match=rf"keras.callbacks.{name} in a job of 2 processes"
                                             rf".*jaxdist.keras.{name}"):
            model.fit(np.zeros((8, 5), "float32"), np.zeros((8, 1), "float32"), epochs=1,
                      verbose=0, callbacks=[cb])
    model_strategy.check_multi_process_callbacks([jk.ModelCheckpoint(str(tmp_path / "m.keras")),
                                   jk.BackupAndRestore(str(tmp_path / "b"))])  # accepted


@pytest.mark.devices(4)
def test_keras_steps_in_flight_are_bounded(devices):
    # Keras's fit loop dispatches steps without waiting; with more forced CPU devices than cores
    # that let XLA's CPU rendezvous abort the process (200 steps on 4 devices did, every time).
    # Under a jaxdist strategy each step function keeps at most two calls in flight.
    strategy = jaxdist.MirroredStrategy(devices[:4])
    with strategy.scope():
        model = _model()
    x = np.random.default_rng(0).normal(size=(8 * 120, 5)).astype("float32")
    model.fit(x, x[:, :1], batch_size=8, epochs=1, shuffle=False, verbose=0)
    from jaxdist._src.keras import model_strategy

    assert model_strategy._is_bounded(model.train_function)
    model.evaluate(x[:64], x[:64, :1], batch_size=8, verbose=0)
    assert model_strategy._is_bounded(model.test_function)
