"""Every Keras internal jaxdist uses sits in jaxdist/_src/compat/keras_internals.py and still works.

A Keras that moves one of them fails here, naming the adapter, instead of deep in a fit. No
other module of jaxdist may import ``keras.src``, name ``JAXTrainer`` or reach a private
attribute of a Keras object the adapter lists. Outside jaxdist's scopes Keras's ``JAXTrainer``
holds Keras's own functions, and a plain Keras model trains exactly as without jaxdist.
"""

import ast
import os
import pathlib
import subprocess
import sys
import threading
import warnings

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":  # pragma: no cover
    pytest.skip("keras runs on another backend", allow_module_level=True)

import jaxdist  # noqa: E402
import jaxdist.keras as jk  # noqa: E402
from jaxdist._src.compat import keras_internals as ki  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2] / "jaxdist"


def _trainer():
    from keras.src.backend.jax.trainer import JAXTrainer

    return JAXTrainer


def _keras_modules():
    """(path, tree) of every jaxdist module outside compat/ that uses Keras."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.parent.name == "compat":
            continue
        tree = ast.parse(path.read_text())
        imports_keras = any(
            (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "keras" for a in n.names))
            or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "keras")
            for n in ast.walk(tree))
        if imports_keras or "keras" in path.relative_to(ROOT).parts or path.name == "keras.py":
            out.append((path, tree))
    return out


def test_no_other_module_imports_keras_private_modules():
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path.parent.name == "compat":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names
                          if n == "keras.src" or n.startswith("keras.src.")]
    assert not offenders, offenders


def test_no_other_keras_module_reaches_a_listed_private_attribute():
    modules = _keras_modules()
    assert any(p.name == "partial_batches.py" for p, _ in modules)  # the scan sees them
    offenders = []
    for path, tree in modules:
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ki.PRIVATE_ATTRIBUTES:
                offenders.append(f"{where}:{node.lineno}: .{node.attr}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                  and node.args[1].value in ki.PRIVATE_ATTRIBUTES):
                offenders.append(f"{where}:{node.lineno}: {node.func.id} {node.args[1].value}")
            elif isinstance(node, ast.FunctionDef) and node.name in ki.PRIVATE_ATTRIBUTES:
                offenders.append(f"{where}:{node.lineno}: overrides {node.name}")
            elif isinstance(node, (ast.Name, ast.Attribute)) and (
                    getattr(node, "id", None) == "JAXTrainer"
                    or getattr(node, "attr", None) == "JAXTrainer"):
                offenders.append(f"{where}:{node.lineno}: JAXTrainer")
    assert not offenders, offenders


def test_installed_keras_is_supported():
    assert ki.check_version() is None, ki.check_version()
    assert "found keras 3.7.0" in ki.check_version("3.7.0")
    assert ki.check_version("3.8.0") is None
    assert ki.check_version("3.99.1") is None
    assert ki.check_version("4.0.0") is not None  # the next major: not yet tested here


def test_an_unsupported_keras_warns(monkeypatch):
    monkeypatch.setattr(keras, "__version__", "4.1.0")
    with pytest.warns(RuntimeWarning, match=r"supports keras >= 3\.8\.0, < 4\.0\.0; found keras "
                                            r"4\.1\.0"):
        ki.warn_if_unsupported()
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ki.warn_if_unsupported()


def test_pyproject_pins_keras_below_its_next_major():
    text = (ROOT.parent / "pyproject.toml").read_text()
    pins = [line for line in text.splitlines() if '"keras' in line]
    assert pins and all("<4" in line for line in pins), pins


def _compiled_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"],
                  weighted_metrics=["mse"])
    return model


def test_model_and_trainer_adapters():
    model = _compiled_model()
    x, y = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
    ki.symbolic_build(model, (x, y))
    assert model.built and model.optimizer.built
    assert [type(layer).__name__ for layer in ki.flatten_layers(model)][-3:] == [
        "Dense", "BatchNormalization", "Dense"]
    assert ki.call_has_training_arg(model)
    assert ki.loss_tracker(model).name == "loss"
    assert ki.loss_reductions(model) == ["sum_over_batch_size"]
    assert isinstance(ki.loss_tracker_variable_ids(model), set)
    assert not ki.overrides_trainer_method(model, "train_step")

    class Custom(keras.Sequential):
        def train_step(self, state, data):  # pragma: no cover - never run
            return super().train_step(state, data)

    assert ki.overrides_trainer_method(Custom([keras.Input((3,)), keras.layers.Dense(1)]),
                                       "train_step")
    with keras.StatelessScope(state_mapping=list(zip(model.metrics_variables,
                                                     [v.value for v in model.metrics_variables]))):
        ki.update_compile_metrics(model, y, y, np.ones((4,), "float32"), np.ones((4,), "float32"))
        logs = model.get_metrics_result()
    assert {"mae", "mse"} <= set(logs)
    with ki.losses_override(model, [np.float32(2.0)]):
        assert len(model.losses) == 1
    assert model.losses == []
    assert callable(ki.step_jit())
    assert ki.step_state(model) is None and ki.step_state_synced(model)
    for name in ("compile", "fit", "evaluate", "predict", "train_on_batch", "test_on_batch",
                 "predict_on_batch", "make_train_function", "make_test_function",
                 "make_predict_function", "_make_function"):
        assert callable(ki.stock_trainer_method(name)), name
    logs, _ = ki.update_metrics_variables(
        model, [v.value for v in model.metrics_variables], np.float32(1.0), x, y, y, None)
    assert logs["loss"] == pytest.approx(1.0)


def test_data_saving_variable_and_callback_adapters(tmp_path):
    assert isinstance(ki.data_adapter_base(), type)
    x = np.arange(10, dtype="float32")[:, None]
    adapter = ki.get_data_adapter(x, x, batch_size=4)
    assert ki.is_array_data_adapter(adapter) and adapter.num_batches == 3
    assert ki.is_array_data_adapter(ki.array_data_adapter(x, x, batch_size=4))
    assert not ki.is_tf_dataset(x)
    (tx, _), (vx, _) = ki.train_validation_split((x, x), 0.2)
    assert len(tx) == 8 and len(vx) == 2
    np.testing.assert_allclose(
        ki.class_weight_to_sample_weights(np.array([0, 1, 1]), {0: 1.0, 1: 3.0}), [1, 3, 3])
    assert [b[0].shape for b in ki.numpy_batches([(x[:2], x[:2])])] == [(2, 1)]
    assert [b[0].shape for b in ki.jax_batches([(x[:2], x[:2])])] == [(2, 1)]

    model = _compiled_model()
    again = ki.model_from_bytes(ki.model_to_bytes(model))
    for a, b in zip(model.get_weights(), again.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert ki.learning_rate_of(model.optimizer) is not None
    assert ki.explicit_layout(model.weights[0]) is None
    v = keras.Variable(np.zeros((2, 3), "float32"))
    ki.replace_variable_value(v, jax.numpy.ones((5, 3), "float32"))
    assert v.shape == (5, 3) and float(v.value.sum()) == 15.0
    inp = keras.Input((2,))
    dense = keras.layers.Dense(1)
    keras.Model(inp, dense(inp))
    assert len(ki.inbound_nodes(dense)) == 1
    assert ki.current_stateless_scope() is None
    with keras.StatelessScope(state_mapping=[(v, jax.numpy.zeros((5, 3)))]) as scope:
        assert ki.current_stateless_scope() is scope
        assert id(v) in ki.scope_values(scope)
    mc, br = ki.chief_only_file_callbacks(lambda: False)
    assert issubclass(mc, keras.callbacks.ModelCheckpoint)
    assert issubclass(br, keras.callbacks.BackupAndRestore)
    assert hasattr(keras.callbacks.ModelCheckpoint, "_save_model")
    mesh = keras.distribution.DeviceMesh((1,), ["r"], [f"{d.platform}:{d.id}"
                                                        for d in jax.devices()[:1]])
    jmesh = jax.make_mesh((1,), ("r",), devices=jax.devices()[:1])
    ki.set_backend_mesh(mesh, jmesh)
    assert mesh.backend_mesh is jmesh


# ---------------------------------------------------------------------- scoped trainer hooks
def _stock_vars():
    return {k: v for k, v in vars(_trainer()).items() if not k.startswith("__")}


_BEFORE = _stock_vars()  # JAXTrainer as Keras defines it (no jaxdist scope entered yet)


@pytest.mark.devices(2)
def test_trainer_is_keras_own_outside_every_jaxdist_scope(devices):
    assert not ki.trainer_hooks_installed()
    x = np.random.default_rng(0).normal(size=(10, 3)).astype("float32")
    y = np.random.default_rng(1).normal(size=(10, 2)).astype("float32")
    strategy = jaxdist.MirroredStrategy(devices[:2])
    with strategy.scope():
        assert ki.trainer_hooks_installed() and ki.hooks_active_here()
        assert _trainer().fit is not _BEFORE["fit"]
        seen = []
        t = threading.Thread(target=lambda: seen.append(ki.hooks_active_here()))
        t.start()
        t.join(timeout=30)
        assert seen == [False]  # the wrappers act on this thread only
        model = _compiled_model()
    assert _stock_vars() == _BEFORE
    assert not ki.trainer_hooks_installed()
    assert "fit" in ki.instance_hooks(model)  # the model keeps its strategy outside the scope
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # 10 rows: a padded partial batch
    assert _stock_vars() == _BEFORE
    with jk.scope(strategy):
        pass
    assert _stock_vars() == _BEFORE
    model.compile(optimizer="sgd", loss="mse")  # compiled again outside: a plain model
    assert ki.instance_hooks(model) == []
    assert _stock_vars() == _BEFORE


def test_wrappers_sit_on_the_class_that_defines_the_method(devices):
    """``compile`` is Keras's base ``Trainer``'s: jaxdist wraps it there, not on
    ``JAXTrainer``, so Keras's check for a custom compile (``type(model).compile !=
    Trainer.compile``, which makes ``load_model`` skip the optimizer, loss and metrics) sees
    none inside a scope."""
    from keras.src.trainers.trainer import Trainer

    stock = Trainer.__dict__["compile"]
    assert "compile" not in vars(_trainer())
    with jaxdist.MirroredStrategy(devices[:1]).scope():
        assert Trainer.__dict__["compile"] is not stock  # wrapped ...
        assert "compile" not in vars(_trainer())          # ... where Keras defines it
        for cls in (keras.Sequential, keras.Model):
            assert cls.compile is Trainer.compile          # not "overridden"
    assert Trainer.__dict__["compile"] is stock
    assert _stock_vars() == _BEFORE


def test_refuse_training_acts_on_its_thread_and_restores_keras(devices):
    from keras.src.trainers.trainer import Trainer

    stock = {n: getattr(keras.Model, n) for n in ("compile", "fit", "predict")}
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    errors = []

    def other_thread():
        model.compile(optimizer="sgd", loss="mse")  # Keras's own behaviour there

    with ki.refuse_training("Keras runs on the 'torch' backend"):
        with pytest.raises(RuntimeError, match=r"model.compile\(\) .*'torch' backend"):
            model.compile(optimizer="sgd", loss="mse")
        t = threading.Thread(target=lambda: errors.append(other_thread()))
        t.start()
        t.join(timeout=60)
        assert errors == [None]
        with pytest.raises(RuntimeError, match=r"model.predict\(\)"):
            model.predict(np.ones((2, 3), np.float32), verbose=0)
    assert {n: getattr(keras.Model, n) for n in stock} == stock
    assert Trainer.__dict__["compile"] is stock["compile"]
    model.predict(np.ones((2, 3), np.float32), verbose=0)


_PLAIN = """
import os, sys
os.environ["KERAS_BACKEND"] = "jax"
import numpy as np, keras
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"),
                          keras.layers.BatchNormalization(), keras.layers.Dense(2)])
model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
rng = np.random.default_rng(0)
x = rng.normal(size=(10, 3)).astype("float32"); y = rng.normal(size=(10, 2)).astype("float32")
model.fit(x, y, batch_size=4, epochs=2, verbose=0)
np.savez(sys.argv[1], *model.get_weights())
"""


def _plain_fit():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(10, 3)).astype("float32")
    y = rng.normal(size=(10, 2)).astype("float32")
    model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    return model.get_weights()


@pytest.mark.devices(2)
def test_a_plain_model_after_jaxdist_keras_trains_as_in_a_process_without_jaxdist(devices,
                                                                                 tmp_path):
    out = tmp_path / "plain.npz"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # The process without jaxdist runs while this one trains (they share nothing).
    plain = subprocess.Popen([sys.executable, "-c", _PLAIN, str(out)], env=env)
    try:
        with jk.scope(jaxdist.MirroredStrategy(devices[:2])):  # jaxdist.keras used first
            model = _compiled_model()
            model.fit(np.ones((6, 3), "float32"), np.ones((6, 2), "float32"), batch_size=4,
                      verbose=0)
        got = _plain_fit()
        assert plain.wait(timeout=300) == 0
    finally:
        if plain.poll() is None:
            plain.kill()
            plain.wait()
    want = np.load(out)
    for i, w in enumerate(got):
        np.testing.assert_array_equal(w, want[f"arr_{i}"], err_msg=f"weight {i}")
