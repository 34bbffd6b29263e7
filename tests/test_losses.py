"""compute_average_loss and scale_regularization_loss follow tf.nn's semantics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist


def test_compute_average_loss_outside_strategy():
    per = jnp.array([1.0, 2.0, 3.0, 6.0])
    assert float(jaxdist.compute_average_loss(per)) == 3.0
    assert float(jaxdist.compute_average_loss(per, global_batch_size=8)) == 1.5
    w = jnp.array([1.0, 0.0, 1.0, 0.5])
    assert float(jaxdist.compute_average_loss(per, sample_weight=w)) == pytest.approx(7.0 / 4)
    per2d = jnp.ones((4, 3))
    assert float(jaxdist.compute_average_loss(per2d)) == 3.0  # sums all, divides by batch


def test_compute_average_loss_errors():
    with pytest.raises(ValueError, match="at least rank 1"):
        jaxdist.compute_average_loss(jnp.float32(1.0))
    with pytest.raises(ValueError, match="global_batch_size must be non-negative, got -1"):
        jaxdist.compute_average_loss(jnp.ones(3), global_batch_size=-1)
    assert float(jaxdist.compute_average_loss(jnp.ones(3), global_batch_size=0)) == 0.0


@pytest.mark.devices(2)
def test_global_batch_size_values_tf_refuses(devices):
    # TF's current nn_impl_distribute: assert_non_negative (0 is allowed and gives 0, TF's own
    # testComputeAverageLossGlobalBatchSize_BatchSizeZero); negative values are refused.
    for bad in (-1, np.int64(-3), jnp.int32(-2), np.array(-5)):
        with pytest.raises(ValueError, match="global_batch_size must be non-negative"):
            jaxdist.compute_average_loss(jnp.ones(3), global_batch_size=bad)
    s = jaxdist.MirroredStrategy(devices[:2])
    with pytest.raises(ValueError, match="global_batch_size must be non-negative"):
        s.run(lambda: jaxdist.compute_average_loss(jnp.ones(3), global_batch_size=-4))
    # A traced batch size (an argument of run or jit) cannot raise before the step runs: a
    # negative one gives NaN, never a plausible negative loss; 0 gives 0 as TF.
    def step(gbs):
        return jaxdist.compute_average_loss(jnp.ones(3), global_batch_size=gbs)

    for gbs, want in ((-4, None), (0, 0.0), (6, 0.5)):
        for out in (s.experimental_local_results(s.run(step, args=(gbs,)))[0],
                    jax.jit(step)(jnp.int32(gbs))):
            if want is None:
                assert np.isnan(float(out)), gbs
            else:
                assert float(out) == want, gbs


@pytest.mark.devices(4)
def test_compute_average_loss_in_replicas_uses_global_batch():
    s = jaxdist.MirroredStrategy(jax.devices()[:4])
    x = np.arange(8, dtype=np.float32)
    (xd,) = list(s.experimental_distribute_dataset([x]))

    def fn(xb):
        loss = jaxdist.compute_average_loss(xb)  # divides by 2 * 4 = 8
        return jaxdist.get_replica_context().all_reduce("SUM", loss)

    assert float(s.run(fn, args=(xd,))) == pytest.approx(x.mean())


@pytest.mark.devices(4)
def test_scale_regularization_loss():
    assert float(jaxdist.scale_regularization_loss(jnp.array([2.0, 4.0]))) == 6.0
    s = jaxdist.MirroredStrategy(jax.devices()[:4])
    out = s.run(
        lambda: jaxdist.get_replica_context().all_reduce(
            "SUM", jaxdist.scale_regularization_loss(jnp.float32(8.0))
        )
    )
    assert float(out) == 8.0
    with s.scope(), pytest.raises(RuntimeError, match="cross replica context"):
        jaxdist.scale_regularization_loss(jnp.float32(8.0))
