"""The tf.distribute guide's custom training loop, on JAX, under every single-host strategy.

20 steps of the same global batches must give the same weights as a plain single-device JAX
loop (tolerance 1e-5).
"""

import jax
import numpy as np
import optax
import pytest
from devutil import cpu_devices, device_string
from flax import nnx
from reference_loops import optax_step

import jaxdist

GLOBAL_BATCH = 32
STEPS = 20


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def _data():
    rng = np.random.RandomState(0)
    x = rng.randn(GLOBAL_BATCH * STEPS, 8).astype(np.float32)
    y = rng.randint(0, 4, GLOBAL_BATCH * STEPS).astype(np.int32)
    return jaxdist.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)


TX = optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(0.1, momentum=0.9))


def _reference():
    model = MLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    opt_state = TX.init(params)

    step = optax_step(graphdef, TX)

    losses = []
    for x, y in _data():
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(float(loss))
    return params, losses


def _distributed(strategy, tf_style=True):
    with strategy.scope():
        model = MLP(nnx.Rngs(0))
        graphdef, params = nnx.split(model, nnx.Param)
        opt_state = TX.init(params)

    def train_step(params, opt_state, x, y):
        ctx = jaxdist.get_replica_context()

        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(x)
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
            return jaxdist.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)

        if tf_style:  # per-replica gradients, reduced with the strategy's cross-device op
            loss, grads = jax.value_and_grad(loss_fn)(ctx.local(params))
            grads = ctx.all_reduce(jaxdist.ReduceOp.SUM, grads)
        else:  # JAX-native: gradients of replicated state are already summed
            loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for x, y in strategy.experimental_distribute_dataset(_data()):
        params, opt_state, per_replica_loss = strategy.run(
            train_step, args=(params, opt_state, x, y)
        )
        losses.append(float(strategy.reduce("SUM", per_replica_loss, axis=None)))
    return params, losses


STRATEGIES = {
    "one_device": lambda: jaxdist.OneDeviceStrategy(device_string(0)),
    "mirrored_nccl": lambda: jaxdist.MirroredStrategy(),
    "mirrored_nccl_packs": lambda: jaxdist.MirroredStrategy(
        cross_device_ops=jaxdist.NcclAllReduce(num_packs=2)
    ),
    "mirrored_hierarchical": lambda: jaxdist.MirroredStrategy(
        cross_device_ops=jaxdist.HierarchicalCopyAllReduce()
    ),
    "mirrored_one_device": lambda: jaxdist.MirroredStrategy(
        cross_device_ops=jaxdist.ReductionToOneDevice()
    ),
    "mirrored_4": lambda: jaxdist.MirroredStrategy([device_string(i) for i in range(4)]),
    "central_storage": lambda: jaxdist.CentralStorageStrategy(),
    "tpu_on_cpu": lambda: jaxdist.TPUStrategy(devices=cpu_devices()),
}


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_guide_loop_matches_single_device(reference, name):
    ref_params, ref_losses = reference
    params, losses = _distributed(STRATEGIES[name]())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("name", ["mirrored_nccl", "central_storage"])
def test_jax_native_gradients_match_single_device(reference, name):
    ref_params, _ = reference
    params, _ = _distributed(STRATEGIES[name](), tf_style=False)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
