"""Trainer with nnx Dropout / BatchNorm under the strategies, bf16 precision, checkpoint shapes."""

import jax
import numpy as np
import optax
import pytest
from devutil import first_devices
from flax import nnx

import jaxdist
from jaxdist._src.train.checkpoint import CheckpointMismatchError
from jaxdist._src.train.trainer import Trainer

GBS = 16


class Net(nnx.Module):
    def __init__(self, dropout=0.0, bn=False, width=8, *, rngs):
        self.l1 = nnx.Linear(4, width, rngs=rngs)
        self.bn = nnx.BatchNorm(width, momentum=0.5, rngs=rngs) if bn else None
        self.do = nnx.Dropout(dropout, rngs=rngs) if dropout else None
        self.l2 = nnx.Linear(width, 3, rngs=rngs)

    def __call__(self, x):
        h = self.l1(x)
        if self.bn is not None:
            h = self.bn(h)
        h = nnx.relu(h)
        if self.do is not None:
            h = self.do(h)
        return self.l2(h)


def make_data():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 4)) * [1, 2, 3, 4] + [0, 1, -1, 2]).astype(np.float32)
    y = rng.integers(0, 3, 64).astype(np.int32)
    return x, y


@pytest.fixture(scope="module")
def data():
    return make_data()


def _fit(strategy, data, steps=2, seed=0, **kw):
    x, y = data
    model_kw = {k: kw.pop(k) for k in ("dropout", "bn", "width") if k in kw}
    t = Trainer(Net(**model_kw, rngs=nnx.Rngs(seed)), optax.sgd(0.1), global_batch_size=GBS,
                strategy=strategy, progress_bar="never", shuffle=False, **kw)
    h = t.fit((x, y), steps=steps)
    return t, h


def _params(t):
    return [np.asarray(a) for a in jax.tree.leaves(jax.device_get(t.params))]


def _rest(t):
    return [np.asarray(a) for a in jax.tree.leaves(jax.device_get(t.rest))]


def _mirrored(n=2):
    """n replicas, or as many as exist (a test whose numbers need n says so with a marker)."""
    return jaxdist.MirroredStrategy(jax.devices()[:n])


def test_dropout_is_deterministic_given_the_seed_and_off_in_evaluate(data):
    a, ha = _fit(_mirrored(), data, dropout=0.5)
    b, hb = _fit(_mirrored(), data, dropout=0.5)
    for u, v in zip(_params(a), _params(b)):
        np.testing.assert_array_equal(u, v)
    assert ha.records[-1]["final_loss"] == hb.records[-1]["final_loss"]
    c, _ = _fit(_mirrored(), data, dropout=0.5, seed=1)   # another seed: other masks
    # evaluate and predict: dropout off (deterministic, equal to the model without dropout)
    x, y = data
    p1, p2 = a.predict(x), a.predict(x)
    np.testing.assert_array_equal(p1, p2)
    ref = a.model
    ref.do.deterministic = True
    np.testing.assert_allclose(p1, np.asarray(ref(x)), rtol=1e-5, atol=1e-6)
    assert c.evaluate((x, y))["loss"] != a.evaluate((x, y))["loss"]


def test_dropout_masks_differ_across_replicas_and_steps(data):
    from jaxdist._src.train.model_state import ModelState

    ms = ModelState.split(Net(dropout=0.5, rngs=nnx.Rngs(0)))
    x = np.ones((8, 4), np.float32)
    out = {}
    for step in (0, 1):
        for replica in (0, 1):
            out[step, replica] = np.asarray(ms.apply(ms.params, ms.rest, x, training=True,
                                                     step=step, replica_id=replica)[0])
    assert not np.allclose(out[0, 0], out[0, 1])   # per replica
    assert not np.allclose(out[0, 0], out[1, 0])   # per step
    again = ms.apply(ms.params, ms.rest, x, training=True, step=0, replica_id=1)[0]
    np.testing.assert_array_equal(out[0, 1], np.asarray(again))


@pytest.mark.devices(4)
def test_sync_batch_norm_equals_one_device_on_the_global_batch(data):
    one, h1 = _fit(jaxdist.OneDeviceStrategy(jax.devices()[0]), data, bn=True)
    sync, h2 = _fit(_mirrored(4), data, bn=True, batch_norm="sync")
    for u, v in zip(_params(one) + _rest(one), _params(sync) + _rest(sync)):
        np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-5)
    assert h1.records[-1]["final_loss"] == pytest.approx(h2.records[-1]["final_loss"], rel=1e-4)
    # per-replica statistics: another step (each replica normalizes its own 4 rows)
    per, _ = _fit(_mirrored(4), data, bn=True, batch_norm="per_replica")
    assert not all(np.allclose(u, v, rtol=1e-4, atol=1e-5)
                   for u, v in zip(_params(one), _params(per)))


@pytest.mark.devices(2)
def test_per_replica_batch_norm_normalizes_each_replicas_rows(data):
    x, y = data
    one, _ = _fit(jaxdist.OneDeviceStrategy(jax.devices()[0]), data, steps=1, bn=True,
                  batch_norm="per_replica")
    per, _ = _fit(_mirrored(2), data, steps=1, bn=True, batch_norm="per_replica")
    # Expected: the average of two one-device steps' gradients on each half of the batch.
    from jaxdist._src.train.model_state import ModelState

    ms = ModelState.split(Net(bn=True, rngs=nnx.Rngs(0)))

    def loss(p, xb, yb):
        logits, _ = ms.apply(p, ms.rest, xb, training=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).sum() / GBS

    g = jax.tree.map(lambda a, b: a + b,
                     jax.grad(loss)(ms.params, x[:8], y[:8]),
                     jax.grad(loss)(ms.params, x[8:16], y[8:16]))
    expected = jax.tree.map(lambda p, d: p - 0.1 * d, ms.params, g)
    for u, v in zip(jax.tree.leaves(expected), _params(per)):
        np.testing.assert_allclose(np.asarray(u), v, rtol=1e-4, atol=1e-5)
    assert not all(np.allclose(u, v) for u, v in zip(_params(one), _params(per)))
    # after one step the running mean is the mean of the replicas' means: the global mean
    np.testing.assert_allclose(jax.device_get(per.rest)["bn"]["mean"][...],
                               jax.device_get(one.rest)["bn"]["mean"][...], rtol=1e-4,
                               atol=1e-5)


def test_batch_norm_statistics_are_checkpointed_and_used_in_evaluate(data, tmp_path):
    x, y = data
    a, _ = _fit(_mirrored(2), data, steps=3, bn=True, checkpoint_dir=str(tmp_path),
                checkpoint_every_steps=3)
    stats = _rest(a)
    assert any(np.abs(s).sum() > 0 for s in stats)
    b = Trainer(Net(bn=True, rngs=nnx.Rngs(5)), optax.sgd(0.1), global_batch_size=GBS,
                strategy=_mirrored(2), progress_bar="never", checkpoint_dir=str(tmp_path),
                shuffle=False, allow_finished=True)
    b.fit((x, y), steps=3)   # nothing left to do (allowed): restores step 3
    for u, v in zip(stats, _rest(b)):
        np.testing.assert_array_equal(u, v)
    assert b.evaluate((x, y)) == pytest.approx(a.evaluate((x, y)))
    # evaluate uses the running statistics: changing them changes the loss
    b.train_state = b.train_state.replace(rest=jax.tree.map(lambda s: s * 0 + 5.0, b.rest))
    assert b.evaluate((x, y))["loss"] != pytest.approx(a.evaluate((x, y))["loss"])


def test_checkpoint_of_another_model_is_one_clear_error(data, tmp_path):
    _fit(jaxdist.OneDeviceStrategy(jax.devices()[0]), data, steps=1, width=16,
         checkpoint_dir=str(tmp_path))
    with pytest.raises(CheckpointMismatchError) as e:
        _fit(jaxdist.OneDeviceStrategy(jax.devices()[0]), data, steps=2, width=8,
             checkpoint_dir=str(tmp_path))
    msg = str(e.value)
    assert len(msg.splitlines()) == 1
    assert f"the checkpoint in {tmp_path} was written for another model" in msg
    assert "(16,) there and (8,) here" in msg or "(4, 16) there and (4, 8) here" in msg
    assert "use another checkpoint.dir or checkpoint.resume=false" in msg


def test_bfloat16_matches_float32_within_tolerance(data):
    f32, h32 = _fit(_mirrored(2), data, steps=3, bn=True)
    bf16, h16 = _fit(_mirrored(2), data, steps=3, bn=True, precision="bfloat16")
    for u, v in zip(_params(f32), _params(bf16)):
        assert v.dtype == np.float32                      # parameters stay float32
        np.testing.assert_allclose(u, v, rtol=0.05, atol=0.02)
    assert not all(np.array_equal(u, v) for u, v in zip(_params(f32), _params(bf16)))
    assert h16.records[-1]["final_loss"] == pytest.approx(h32.records[-1]["final_loss"],
                                                    rel=0.02)
    opt_leaves = jax.tree.leaves(bf16.opt_state)
    assert all(np.asarray(o).dtype != np.dtype("bfloat16") for o in opt_leaves)
    with pytest.raises(ValueError, match="precision='float16'"):
        Trainer(Net(rngs=nnx.Rngs(0)), optax.sgd(0.1), global_batch_size=GBS,
                precision="float16")


def test_batch_norm_option_is_checked():
    with pytest.raises(ValueError, match="batch_norm='local'"):
        Trainer(Net(rngs=nnx.Rngs(0)), optax.sgd(0.1), global_batch_size=GBS,
                batch_norm="local")


def _ps_strategy():
    return jaxdist.ParameterServerStrategy(compute_devices=first_devices(2), timeout=30.0)


def test_parameter_servers_train_dropout_and_reject_batch_norm(data, monkeypatch):
    from jaxdist._src.ps import optimizers as O

    monkeypatch.delenv("TF_CONFIG", raising=False)
    x, y = data
    runs = []
    for _ in range(2):
        strategy = _ps_strategy()
        with strategy.scope():
            t = Trainer(Net(dropout=0.5, rngs=nnx.Rngs(0)), O.sgd(0.1), global_batch_size=GBS,
                        strategy=strategy, progress_bar="never", shuffle=False)
        t.fit((x, y), steps=3)
        runs.append((_params(t), t.evaluate((x, y))["loss"]))
    for u, v in zip(runs[0][0], runs[1][0]):   # one worker: deterministic given the seed
        np.testing.assert_allclose(u, v, rtol=1e-6)
    assert runs[0][1] == pytest.approx(runs[1][1])
    # the same steps as MirroredStrategy over the worker's 2 devices (same dropout keys)
    ref, _ = _fit(_mirrored(2), data, steps=3, dropout=0.5)
    for u, v in zip(_params(ref), runs[0][0]):
        np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-5)
    strategy = _ps_strategy()
    with pytest.raises(ValueError, match=r"batch_norm='per_replica' .* is not supported"):
        with strategy.scope():
            Trainer(Net(bn=True, rngs=nnx.Rngs(0)), O.sgd(0.1), global_batch_size=GBS,
                    strategy=strategy, batch_norm="per_replica")


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.devices(4)  # the one-process reference
def test_multi_worker_dropout_and_sync_batch_norm_equal_one_mirrored_process(data, tmp_path):
    """2 processes x 2 devices give the same steps as one process with 4 devices: the same
    dropout keys per global replica and step, batch statistics over the global batch."""
    import os
    import sys

    from jaxdist.testing import LocalCluster

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "state.npz"
    script = os.path.join(root, "tests", "internal", "mw_model_state_worker.py")
    with LocalCluster(workers=2, devices_per_process=2, cwd=root,
                      env={"PYTHONPATH": root}) as c:
        c.start([sys.executable, script, str(out)])
        # the one-process reference, computed while the workers run
        ref, _ = _fit(_mirrored(4), data, steps=3, dropout=0.5, bn=True)
        mine = _params(ref) + _rest(ref)
        ref_loss = ref.evaluate(data)["loss"]
        codes = c.join(timeout=150)
        assert codes == {"worker:0": 0, "worker:1": 0}, c.describe()
    got = np.load(out)
    for i, a in enumerate(mine):
        np.testing.assert_allclose(got[f"arr_{i}"], a, rtol=1e-4, atol=1e-5)
    assert float(got["loss"]) == pytest.approx(ref_loss, rel=1e-4)
