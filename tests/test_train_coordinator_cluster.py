"""The Trainer with a ClusterCoordinator on a real cluster (1 ps + 1 worker on 127.0.0.1, this
process is the chief): an nnx Dropout model trains with the documented key schedule (so a run is
reproducible from its seed), every metric is logged, and the learning rate and ``set_weights``
reach the ps task over gRPC."""

import jax
import numpy as np
import pytest
from coordinator_util import ChiefResolver, by_value, coordinator_for, start_cluster
from flax import nnx

import jaxdist
from jaxdist.ps import optimizers as O
from jaxdist.train.metrics import SparseTopKCategoricalAccuracy

pytestmark = pytest.mark.slow
by_value(__name__)


class DropoutNet(nnx.Module):
    def __init__(self, *, rngs):
        self.l1 = nnx.Linear(5, 16, rngs=rngs)
        self.do = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.do(nnx.relu(self.l1(x))))


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5)).astype(np.float32)
    y = (x[:, 0] - x[:, 1] > 0).astype(np.int32)
    return x, y


def _trainer(strategy, seed=0, **kwargs):
    with strategy.scope():
        return jaxdist.Trainer(DropoutNet(rngs=nnx.Rngs(seed)), O.sgd(0.2), global_batch_size=16,
                               strategy=strategy, log_dir=None, progress_bar="never", **kwargs,
                               metrics=["accuracy", "auc",
                                        SparseTopKCategoricalAccuracy(k=1, name="top1")])


def _in_process(seed, **kwargs):
    """Between-graph on one in-process worker with one device: the same steps, data order
    and Dropout keys (global step, worker 0, replica 0) as the coordinator's single worker."""
    t = _trainer(jaxdist.ParameterServerStrategy(compute_devices=jax.devices()[:1],
                                                 timeout=30.0), seed, **kwargs)
    t.fit(_data(), epochs=2, verbose=0)
    return t.get_weights()["params"]


@pytest.mark.devices(2)
def test_coordinator_trains_a_dropout_model_reproducibly_with_metrics_lr_and_weights():
    c = start_cluster(workers=1, ps=1)
    try:
        # The chief validates on its own 2 devices while the worker has 1 (the Trainer
        # splits evaluation batches over the chief's mesh, not num_replicas_in_sync).
        strategy = jaxdist.ParameterServerStrategy(ChiefResolver(c.cluster, c.token),
                                                   compute_devices=jax.devices()[:2],
                                                   timeout=30.0)
        coordinator = coordinator_for(strategy)
        try:
            trainer = _trainer(strategy)
            x, y = _data()
            history = trainer.fit((x, y), epochs=2, validation_data=(x[:32], y[:32]),
                                  verbose=0)
            params = trainer.get_weights()["params"]
            for key in ("loss", "accuracy", "auc", "top1", "val_auc", "val_top1"):
                assert len(history.history[key]) == 2, (key, history.history)
            assert history.history["learning_rate"] == pytest.approx([0.2, 0.2])
            # the learning rate and the weights, over the ps task's gRPC service
            trainer.learning_rate = 0.05
            assert trainer.learning_rate == pytest.approx(0.05)
            zeros = jax.tree.map(np.zeros_like, params)
            trainer.set_weights({"params": zeros, "rest": trainer.rest})
            jax.tree.map(np.testing.assert_array_equal, trainer.get_weights()["params"], zeros)
        finally:
            coordinator.shutdown()
    finally:
        c.stop()
    # Dropout was on, with the documented keys: the run equals the in-process one of the same
    # seed, and not one of another seed.
    same, other = _in_process(0), _in_process(1)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
                 params, same)
    assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(params),
                                                     jax.tree.leaves(other)))


def test_coordinator_trains_on_a_grain_map_dataset_as_on_the_same_arrays():
    """A grain MapDataset travels to the worker with the per-worker dataset: with one worker it
    reads the dataset's batches in order, so the run equals array training without shuffling;
    a generator is refused with the inputs that work."""
    import grain

    from jaxdist.train import DataError

    x, y = _data()
    ds = grain.MapDataset.source([(x[i], y[i]) for i in range(len(y))]).batch(16)
    c = start_cluster(workers=1, ps=1)
    try:
        strategy = jaxdist.ParameterServerStrategy(ChiefResolver(c.cluster, c.token),
                                                   compute_devices=jax.devices()[:1],
                                                   timeout=30.0)
        coordinator = coordinator_for(strategy)
        try:
            trainer = _trainer(strategy, shuffle=False)
            with pytest.raises(DataError, match="arrays or a grain.MapDataset"):
                trainer.fit(((x[:16], y[:16]) for _ in range(4)), steps=2, verbose=0)
            history = trainer.fit(ds, epochs=2, verbose=0)
            params = trainer.get_weights()["params"]
        finally:
            coordinator.shutdown()
    finally:
        c.stop()
    assert len(history.history["loss"]) == 2 and trainer.step == 2 * 4
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
                 params, _in_process(0, shuffle=False))
