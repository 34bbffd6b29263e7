"""``Trainer.evaluate`` / ``predict`` take Keras' ``batch_size`` for one call: the results do not
depend on it, and the trainer's own batch size stays what it was."""

import jax
import numpy as np
import optax
import pytest
from devutil import first_devices
from flax import nnx

import jaxdist
from jaxdist.train.callbacks import LambdaCallback


def _data(n=50, features=6, classes=3):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, features)).astype(np.float32)
    return x, rng.integers(0, classes, n).astype(np.int32)


def _trainer(strategy):
    with strategy.scope():
        model = nnx.Linear(6, 3, rngs=nnx.Rngs(0))
        return jaxdist.Trainer(model, optax.sgd(0.1), strategy=strategy, global_batch_size=8,
                               progress_bar="never")


@pytest.mark.devices(2)
@pytest.mark.parametrize("batch_size", [None, 7, 16, 50, 64])
def test_evaluate_and_predict_give_the_same_results_whatever_the_batch_size(batch_size):
    x, y = _data()
    trainer = _trainer(jaxdist.MirroredStrategy(first_devices(2)))
    trainer.fit((x, y), steps=3)
    reference = _trainer(jaxdist.OneDeviceStrategy(jax.devices()[0]))
    reference.fit((x, y), steps=3)
    want = reference.evaluate((x, y))
    batches = []
    count = LambdaCallback(on_test_batch_begin=lambda i, logs=None: batches.append(i))
    got = trainer.evaluate((x, y), batch_size=batch_size, callbacks=[count])
    assert len(batches) == -(-50 // (batch_size or 8))  # batches of batch_size rows
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["accuracy"] == pytest.approx(want["accuracy"])
    np.testing.assert_allclose(trainer.predict(x, batch_size=batch_size),
                               reference.predict(x), rtol=1e-5, atol=1e-6)
    assert trainer.global_batch_size == 8  # for this call only


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_a_bad_batch_size_is_named(bad):
    x, y = _data()
    trainer = _trainer(jaxdist.OneDeviceStrategy(jax.devices()[0]))
    with pytest.raises(ValueError, match=r"evaluate\(batch_size=\.\.\.\) must be a positive "
                                         r"integer, got " + repr(bad).replace(".", r"\.")):
        trainer.evaluate((x, y), batch_size=bad)
    with pytest.raises(ValueError, match=r"predict\(batch_size=\.\.\.\)"):
        trainer.predict(x, batch_size=bad)
