"""The job configs' models (``jaxdist._src.job.models``): ``from_config`` initialises in one
compiled program and gives the same parameters, bit for bit, as building the model op by op."""

import jax
import numpy as np
import pytest
from flax import nnx

import jaxdist
from jaxdist._src.job import models

SECTIONS = {
    "mlp": ({"name": "mlp", "hidden_sizes": [32, 16]}, (8, 8)),
    "cnn": ({"name": "cnn", "features": [4, 8]}, (8, 8, 1)),
}


def _op_by_op(section, shape, num_classes, seed):
    rngs = nnx.Rngs(seed)
    if section["name"] == "mlp":
        return models.MLP(int(np.prod(shape)), section["hidden_sizes"], num_classes, rngs=rngs)
    return models.CNN(shape, section["features"], num_classes, rngs=rngs)


def _leaves(model):
    return jax.tree.leaves(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("name", sorted(SECTIONS))
@pytest.mark.parametrize("seed", [0, 7])
def test_from_config_gives_the_op_by_op_parameters(name, seed):
    section, shape = SECTIONS[name]
    got = models.from_config(section, shape, 10, seed)
    want = _op_by_op(section, shape, 10, seed)
    assert type(got) is type(want)
    for g, w in zip(_leaves(got), _leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    x = np.random.default_rng(0).normal(size=(2, *shape)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(got(x)), np.asarray(want(x)))


def test_inside_a_scope_the_parameters_are_placed_as_op_by_op(devices):
    strategy = jaxdist.MirroredStrategy(devices)
    section, shape = SECTIONS["mlp"]
    with strategy.scope():
        got = models.from_config(section, shape, 10, 0)
        want = _op_by_op(section, shape, 10, 0)
    for g, w in zip(_leaves(got), _leaves(want), strict=True):
        assert g.sharding == w.sharding
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
