"""Weights of a Keras model trained under ``ParameterServerStrategy``, saved, then loaded under
a strategy of one device: no false "mix of local and distributed variables" warning (Keras
3.15 raises it whenever a loaded value's ``SingleDeviceSharding`` sits beside the one-device
mesh layout of the others; both are the same device, so nothing is incompatible)."""

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
from jaxdist._src.keras import api as jk  # noqa: E402
from jaxdist._src.keras import sharding_check  # noqa: E402

X = np.random.default_rng(0).normal(size=(32, 5)).astype("float32")
Y = X[:, :1] * 2.0


@pytest.fixture(autouse=True)
def _no_cluster(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)


def _model():
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    m.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return m


@pytest.fixture(scope="module")
def ps_weights(tmp_path_factory):
    m = _model()
    jk.attach(m, jaxdist.ParameterServerStrategy())
    m.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    path = str(tmp_path_factory.mktemp("w") / "ps.weights.h5")
    m.save_weights(path)
    return path, [np.asarray(w) for w in m.get_weights()]


def _mixed_warnings(caught):
    return [w for w in caught if "mix of local" in str(w.message)]


@pytest.mark.parametrize("make", [
    lambda: jaxdist.OneDeviceStrategy(jax.devices()[0]),
    lambda: jaxdist.MirroredStrategy(jax.devices()[:1]),
], ids=["one_device", "mirrored_1"])
def test_load_weights_on_one_device_gives_no_mixed_sharding_warning(ps_weights, make):
    path, expected = ps_weights
    with make().scope():
        m = _model()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m.load_weights(path)
            m.evaluate(X, Y, verbose=0)
            m.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    assert not _mixed_warnings(caught), [str(w.message)[:200] for w in caught]
    assert np.isfinite(m.evaluate(X, Y, verbose=0))
    m2 = _model()
    m2.load_weights(path)
    for a, b in zip(m2.get_weights(), expected):
        np.testing.assert_array_equal(a, b)


@pytest.mark.devices(2)
def test_state_on_several_devices_is_still_checked():
    """Only state that lives on one device skips Keras's check; a real mix still warns."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    mesh1 = jax.sharding.NamedSharding(jax.make_mesh((1,), ("r",), devices=jax.devices()[:1]),
                                       jax.sharding.PartitionSpec())
    mesh2 = jax.sharding.NamedSharding(jax.make_mesh((2,), ("r",), devices=jax.devices()[:2]),
                                       jax.sharding.PartitionSpec())
    assert sharding_check._one_device([one, mesh1], [mesh1], [], [one])
    assert not sharding_check._one_device([one, mesh2], [], [], [])
    from keras.src.backend.jax.trainer import JAXTrainer

    with jaxdist.MirroredStrategy(jax.devices()[:2]).scope():  # installs the check
        m = _model()
        m.trainable_variables[0]._value = jax.device_put(np.zeros((5, 8), np.float32),
                                                         jax.devices()[0])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            JAXTrainer._check_sharding_consistency(
                m, [v.value.sharding for v in m.trainable_variables], [], [], [])
    assert _mixed_warnings(caught)
