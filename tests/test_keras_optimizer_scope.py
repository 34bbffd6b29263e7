"""An optimizer created outside ``strategy.scope()`` and passed to ``compile`` inside it
trains as one created inside (TF builds an optimizer's slots under the model's strategy)
(issue 35, point 6)."""

from __future__ import annotations

import numpy as np
import pytest

import jaxdist

keras = pytest.importorskip("keras")


def _train(strategy, optimizer_outside: bool) -> list[np.ndarray]:
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 4)).astype("float32")
    y = x @ np.arange(1.0, 5.0, dtype="float32")[:, None]
    optimizer = keras.optimizers.Adam(0.05) if optimizer_outside else None
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=optimizer or keras.optimizers.Adam(0.05), loss="mse")
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    slots = [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]
    return [*model.get_weights(), *slots]


@pytest.mark.devices(4)
@pytest.mark.parametrize("kind", ["mirrored", "central_storage"])
def test_an_optimizer_made_outside_the_scope_trains_as_one_made_inside(devices, kind):
    make = {"mirrored": jaxdist.MirroredStrategy,
            "central_storage": jaxdist.CentralStorageStrategy}[kind]
    inside = _train(make(devices[:4]), optimizer_outside=False)
    outside = _train(make(devices[:4]), optimizer_outside=True)
    assert len(inside) == len(outside)
    for a, b in zip(inside, outside):
        np.testing.assert_array_equal(a, b)
