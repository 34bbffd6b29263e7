"""The custom training loop of docs/custom_loop.md (its model and data included), copied from
the page as written, on 4 replicas (as many as exist where there are fewer).

The data ends with a partial batch of 29 rows (64 + 29 rows, GLOBAL_BATCH = 64): TF splits it
16 / 13 / 0 / 0 over 4 replicas and ``compute_average_loss`` divides by the global batch size;
the weights must match a plain single-device loop doing the same.
"""

import pathlib
import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist

PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "custom_loop.md"


class MyModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def _doc_loop() -> str:
    text = PAGE.read_text()
    section = text[text.index("# The custom training loop"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _reference(x, y, global_batch):
    graphdef, params = nnx.split(MyModel(nnx.Rngs(0)), nnx.Param)
    tx = optax.sgd(0.1, momentum=0.9)
    opt_state = tx.init(params)
    order = np.asarray(list(jaxdist.Dataset.from_tensor_slices(np.arange(len(x)))
                            .shuffle(10_000, seed=0)))
    @jax.jit
    def step(params, opt_state, xb, yb):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).sum()

        grads = jax.tree.map(lambda g: g / global_batch, jax.grad(loss_fn)(params))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for start in range(0, len(x), global_batch):
        idx = order[start:start + global_batch]
        params, opt_state = step(params, opt_state, x[idx], y[idx])
    return params


@pytest.mark.devices(4)
def test_doc_custom_loop_runs_on_4_replicas_with_a_partial_last_batch():
    code = _doc_loop()
    assert "jaxdist.MirroredStrategy()" in code
    code = code.replace("jaxdist.MirroredStrategy()", "jaxdist.MirroredStrategy(jax.devices()[:4])")
    ns = {}
    exec(compile(code, str(PAGE), "exec"), ns)
    assert ns["strategy"].num_replicas_in_sync == len(jax.devices()[:4])
    x, y = ns["x_train"], ns["y_train"]
    assert len(x) == 64 + 29
    want = _reference(x, y, ns["GLOBAL_BATCH"])
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5),
        ns["params"], want,
    )
    assert np.isfinite(float(ns["loss"]))
