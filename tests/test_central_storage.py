"""CentralStorageStrategy: one copy of the state on the parameter device, compute replicated."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from devutil import cpu_devices, device_string

import jaxdist


def _step_fn(tx):
    def loss_fn(p, xb, yb):
        return jaxdist.compute_average_loss((xb @ p["w"] + p["b"] - yb) ** 2, global_batch_size=16)

    def step(params, opt_state, xb, yb):
        grads = jax.grad(loss_fn)(params, xb, yb)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


@pytest.mark.devices(7)
def test_state_created_in_scope_lives_once_on_parameter_device():
    s = jaxdist.CentralStorageStrategy(jax.devices()[:4], parameter_device=device_string(6))
    assert s.extended.parameter_devices == (jax.devices()[6],)
    assert s.num_replicas_in_sync == 4
    with s.scope():
        w = jnp.zeros((3, 2))
    assert w.devices() == {jax.devices()[6]}
    assert len(w.addressable_shards) == 1


def test_default_parameter_device_is_host_cpu():
    host = cpu_devices(1)[0]
    s = jaxdist.CentralStorageStrategy()
    assert s.extended.parameter_devices == (host,)
    last = len(jax.devices()) - 1
    single = jaxdist.CentralStorageStrategy([device_string(last)])
    assert single.extended.parameter_devices == (jax.devices()[last],)


@pytest.mark.devices(8)
def test_exactly_one_copy_between_steps_and_same_result():
    rng = np.random.RandomState(0)
    x = rng.randn(16, 3).astype(np.float32)
    y = rng.randn(16, 1).astype(np.float32)
    tx = optax.sgd(0.1)
    step = _step_fn(tx)
    s = jaxdist.CentralStorageStrategy(jax.devices()[:4], parameter_device=device_string(7))
    with s.scope():
        params = {"w": jnp.full((3, 1), 0.5), "b": jnp.zeros((1,))}
        opt_state = tx.init(params)
    ref_dev = jax.devices()[6]  # the reference runs outside the strategy's devices
    ref_p = jax.device_put(
        {"w": np.full((3, 1), 0.5, np.float32), "b": np.zeros((1,), np.float32)}, ref_dev
    )
    ref_o = jax.device_put(tx.init(ref_p), ref_dev)
    x_ref, y_ref = jax.device_put((x, y), ref_dev)
    ds = s.experimental_distribute_dataset([(x, y)] * 3)
    for xb, yb in ds:
        params, opt_state = s.run(step, args=(params, opt_state, xb, yb))
        ref_p, ref_o = jax.jit(step)(ref_p, ref_o, x_ref, y_ref)
        gc.collect()
        for leaf in jax.tree.leaves(params):
            assert leaf.devices() == {jax.devices()[7]}, leaf.sharding
            assert len(leaf.addressable_shards) == 1
        # No other live buffer of the parameters' shape exists on the compute devices.
        compute = set(s.extended.worker_devices)
        stray = [a for a in jax.live_arrays() if a.shape == (3, 1) and a.devices() & compute]
        assert not stray, f"parameter copies left on compute devices: {stray}"
    for k in ref_p:
        np.testing.assert_allclose(params[k], ref_p[k], atol=1e-6)


@pytest.mark.devices(6)
def test_gradients_reduced_onto_parameter_device_and_update_applied_there():
    rng = np.random.RandomState(1)
    x = rng.randn(16, 3).astype(np.float32)
    y = rng.randn(16, 1).astype(np.float32)
    s = jaxdist.CentralStorageStrategy(jax.devices()[:4], parameter_device=device_string(5))
    with s.scope():
        params = {"w": jnp.ones((3, 1)), "b": jnp.zeros((1,))}

    def per_replica_grads(p, xb, yb):
        ctx = jaxdist.get_replica_context()
        loss = lambda q: jaxdist.compute_average_loss((xb @ q["w"] + q["b"] - yb) ** 2)  # noqa: E731
        return jax.grad(loss)(ctx.local(p))

    xb, yb = next(iter(s.experimental_distribute_dataset([(x, y)])))
    grads = s.run(per_replica_grads, args=(params, xb, yb))
    assert isinstance(grads["w"], jaxdist.PerReplica)
    reduced = s.extended.reduce_to("SUM", grads)
    assert reduced["w"].devices() == {jax.devices()[5]}
    new = s.extended.update(
        params, lambda p, g: jax.tree.map(lambda a, b: a - 0.1 * b, p, g), args=(reduced,)
    )
    assert new["w"].devices() == {jax.devices()[5]}
    ref = jax.grad(lambda q: jnp.mean((x @ q["w"] + q["b"] - y) ** 2))(
        {"w": jnp.ones((3, 1)), "b": jnp.zeros((1,))}
    )
    np.testing.assert_allclose(new["w"], 1 - 0.1 * np.asarray(ref["w"]), atol=1e-6)
