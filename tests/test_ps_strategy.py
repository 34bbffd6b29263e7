"""ParameterServerStrategy without a cluster: variables on the host CPU, compat.v1 surface."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdist
from jaxdist.ps import optimizers as O


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 4)).astype(np.float32)
    return x, x @ np.array([1.0, -2.0, 3.0, 0.5], np.float32) + 1.0


@pytest.mark.devices(2)
def test_local_training_converges_and_compat_surface(devices):
    strategy = jaxdist.ParameterServerStrategy(compute_devices=devices[:2])
    assert strategy.cluster_resolver is None
    assert strategy.num_replicas_in_sync == len(devices[:2])
    assert strategy.extended.parameter_devices == ("/job:localhost/replica:0/task:0/device:CPU:0",)
    assert strategy.extended.experimental_should_init and strategy.extended.should_checkpoint
    x, y = _data()
    with strategy.scope():
        params = strategy.create_variables(lambda: {"w": jnp.zeros(4), "b": jnp.zeros(())},
                                           O.chain(O.clip_by_global_norm(5.0), O.adam(0.1)))

    def grad_fn(p, xb, yb):
        def loss(p):
            return jaxdist.compute_average_loss((xb @ p["w"] + p["b"] - yb) ** 2,
                                                global_batch_size=32)
        return jax.value_and_grad(loss)(p)

    it = strategy.make_input_fn_iterator(
        lambda ctx: jaxdist.Dataset.from_tensor_slices((x, y)).batch(32).repeat(40))
    it.initialize()
    losses = []
    for _ in range(120):
        xb, yb = it.get_next()
        loss, grads = strategy.run(grad_fn, args=(params, xb, yb))
        params.apply_gradients(grads)
        losses.append(float(strategy.reduce("SUM", loss, axis=None)))
    assert losses[-1] < 1e-2 * losses[0]
    final = params.pull()
    np.testing.assert_allclose(final["w"], [1, -2, 3, 0.5], atol=0.05)
    ds = strategy.experimental_make_numpy_dataset(x)
    assert len(list(ds.batch(32))) == 4
    assert list(strategy.experimental_distribute_dataset(ds.batch(32)))


@pytest.mark.devices(2)
def test_per_replica_gradients_are_summed(devices):
    strategy = jaxdist.ParameterServerStrategy(compute_devices=devices[:2])
    with strategy.scope():
        params = strategy.create_variables({"w": np.zeros(2, np.float32)}, O.sgd(1.0))
    xs = strategy.experimental_distribute_values_from_function(
        lambda ctx: jnp.full((2,), ctx.replica_id_in_sync_group + 1.0))

    def grad_fn(p, xv):
        ctx = jaxdist.get_replica_context()
        return jax.grad(lambda q: jnp.sum(q["w"] * xv))(ctx.local(p))

    grads = strategy.run(grad_fn, args=(params, xs))
    params.apply_gradients(grads)
    n = strategy.num_replicas_in_sync  # 2, or 1 where only one device exists
    np.testing.assert_allclose(params.pull()["w"], [-n * (n + 1) / 2] * 2)


def test_bad_inputs_raise_clear_errors(devices):
    strategy = jaxdist.ParameterServerStrategy(compute_devices=devices[:1])
    with pytest.raises(ValueError, match="raw optax GradientTransformation"):
        strategy.create_variables({"w": np.zeros(2)}, optax.sgd(0.1))
    params = strategy.create_variables({"w": np.zeros(2, np.float32)}, O.sgd(0.1), name="p")
    with pytest.raises(ValueError, match="'p' already exist"):
        strategy.create_variables({"w": np.zeros(2, np.float32)}, name="p")
    with pytest.raises(ValueError, match=r"gradient for 'p/w' has shape \(3,\)"):
        params.apply_gradients({"w": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        jaxdist.ParameterServerStrategy(max_staleness=-1)


def test_local_embedding_matches_dense_reference(devices):
    strategy = jaxdist.ParameterServerStrategy(compute_devices=devices[:1])
    table = strategy.create_embedding("emb", 50, 4, optimizer=O.sgd(0.5), num_shards=3)
    ref = table.read_value().copy()
    look = table.lookup(np.array([[3, 3], [49, 0]]))
    assert look.rows.shape == (3, 4) and look.embeddings().shape == (2, 2, 4)
    g = jax.grad(lambda r: jnp.sum(r[look.inverse] ** 2))(jnp.asarray(look.rows))
    table.apply_gradients(look, g)
    dense_g = np.zeros_like(ref)
    np.add.at(dense_g, np.array([3, 3, 49, 0]), 2 * ref[[3, 3, 49, 0]])
    np.testing.assert_allclose(table.read_value(), ref - 0.5 * dense_g, rtol=1e-6)


def test_extended_offers_what_the_trainer_needs(tmp_path):
    """mark_done / wait_for_workers / checkpoints through ``extended`` (no RPC names in train)."""
    strategy = jaxdist.ParameterServerStrategy()
    ext = strategy.extended
    with strategy.scope():
        variables = strategy.create_variables({"w": np.zeros(2, np.float32)}, O.sgd(0.1))
    assert ext.cluster_coordinator is None and ext.timeout == 60.0
    assert ext.latest_checkpoint_step(str(tmp_path)) is None
    ext.mark_done(0)
    assert ext.wait_for_workers(1) == []
    assert ext.wait_for_workers(3, timeout=0.2, poll_s=0.05) == [1, 2]   # 1 and 2 never finish
    ext.save(str(tmp_path), 7)
    assert ext.latest_checkpoint_step(str(tmp_path)) == 7
    ext.mark_checkpoint_final(str(tmp_path), 7)
    assert ext.latest_checkpoint_step(str(tmp_path)) == 7
    assert variables.pull()["w"].shape == (2,)
