"""Trainer: results match one device under every strategy, steps_per_execution, resume, NaN."""

import jax
import numpy as np
import optax
import pytest
from devutil import cpu_devices, device_string
from flax import nnx
from reference_loops import optax_step

import jaxdist
from jaxdist._src.job import data as job_data
from jaxdist._src.job.models import CNN, MLP
from jaxdist._src.train import data as data_lib
from jaxdist._src.train.trainer import NaNLossError, Trainer

GBS = 32


@pytest.fixture(scope="module")
def dataset():
    train, val = job_data.make_synthetic(num_examples=260, num_features=12, num_classes=4,
                                         validation_split=0.25)
    return train, val


def _trainer(strategy, optimizer=None, model_seed=0, **kw):
    kw.setdefault("progress_bar", "never")
    kw.setdefault("log_every_steps", 1000)
    with strategy.scope():
        model = MLP(12, [16], 4, rngs=nnx.Rngs(model_seed))
        return Trainer(model, optimizer or optax.adam(1e-2), global_batch_size=GBS,
                       strategy=strategy, **kw)


def _leaves(trainer):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(trainer.params))]


@pytest.fixture(scope="module")
def reference(dataset):
    train, _ = dataset
    t = _trainer(jaxdist.OneDeviceStrategy(jax.devices()[0]))
    h = t.fit((train.x, train.y), steps=8)
    return _leaves(t), h


def _strategies():
    devs = jax.devices()  # 4 replicas, or as many as exist
    return {
        "mirrored": lambda: jaxdist.MirroredStrategy(devs[:4]),
        "mirrored_hierarchical": lambda: jaxdist.MirroredStrategy(
            devs[:4], jaxdist.HierarchicalCopyAllReduce()),
        "mirrored_to_one_device": lambda: jaxdist.MirroredStrategy(
            devs[:4], jaxdist.ReductionToOneDevice()),
        "central_storage": lambda: jaxdist.CentralStorageStrategy(devs[:4], devs[0]),
        "tpu_on_cpu": lambda: jaxdist.TPUStrategy(devices=cpu_devices()[:8]),
        "one_device": lambda: jaxdist.OneDeviceStrategy(devs[-1]),
    }


@pytest.mark.parametrize("name", list(_strategies()))
def test_matches_single_device(name, dataset, reference):
    train, _ = dataset
    ref_params, ref_hist = reference
    strategy = _strategies()[name]()
    t = _trainer(strategy)
    h = t.fit((train.x, train.y), steps=8)
    for a, b in zip(ref_params, _leaves(t)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert h.records[-1]["final_loss"] == pytest.approx(ref_hist.records[-1]["final_loss"],
                                                        rel=1e-5)
    if name == "central_storage":  # exactly one copy of the state, on the parameter device
        for x in jax.tree.leaves((t.params, t.opt_state)):
            assert x.sharding.device_set == {jax.devices()[0]}


@pytest.mark.devices(2)
def test_steps_per_execution_equals_single_steps(dataset):
    train, _ = dataset
    strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
    single = _trainer(strategy, log_every_steps=1)
    h1 = single.fit((train.x, train.y), steps=8)
    folded = _trainer(strategy, steps_per_execution=3, log_every_steps=1)
    h3 = folded.fit((train.x, train.y), steps=8)   # 6 steps per epoch: 3 + 3, then 1 + 1
    for a, b in zip(_leaves(single), _leaves(folded)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert single.step == folded.step == 8
    assert [r["step"] for r in h3.records if r["event"] == "train"] == [3, 6, 7, 8]
    # A remainder shorter than k runs as single steps: two compiled programs, not one per length.
    folded.fit((train.x, train.y), steps=8 + 6 + 5)
    assert strategy.extended._compiled_versions(folded._train_replica) == 2
    assert h1.history["loss"] == pytest.approx(h3.history["loss"], rel=1e-6)


@pytest.mark.devices(2)
def test_same_seed_same_loss(dataset):
    train, val = dataset
    out = []
    for _ in range(2):
        t = _trainer(jaxdist.MirroredStrategy(jax.devices()[:2]), seed=3)
        h = t.fit((train.x, train.y), epochs=2, validation_data=(val.x, val.y))
        out.append((h.history["loss"], h.history["val_loss"]))
    assert out[0] == out[1]
    t = _trainer(jaxdist.MirroredStrategy(jax.devices()[:2]), seed=4)
    h = t.fit((train.x, train.y), epochs=2)
    assert h.history["loss"] != out[0][0]  # the seed changes the data order


@pytest.mark.devices(2)
def test_resume_from_checkpoint_equals_uninterrupted(dataset, tmp_path):
    train, _ = dataset
    strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
    straight = _trainer(strategy)
    straight.fit((train.x, train.y), steps=13)
    first = _trainer(strategy, checkpoint_dir=str(tmp_path), checkpoint_every_steps=4)
    first.fit((train.x, train.y), steps=9)   # epoch 0 (6 steps) + 3 steps of epoch 1
    assert first.last_checkpoint == 9
    resumed = _trainer(strategy, model_seed=7, checkpoint_dir=str(tmp_path),
                       checkpoint_every_steps=4, keep_checkpoints=2)
    resumed.fit((train.x, train.y), steps=13)
    assert (resumed.epoch, resumed.step_in_epoch) == (2, 1)
    for a, b in zip(_leaves(straight), _leaves(resumed)):
        np.testing.assert_array_equal(a, b)
    assert resumed._checkpointer.all_steps() == [12, 13]


@pytest.mark.devices(4)
def test_evaluate_and_predict_cover_every_example(dataset):
    train, val = dataset  # 65 validation examples: 3 batches of 32, the last one padded
    t = _trainer(jaxdist.MirroredStrategy(jax.devices()[:4]))
    t.fit((train.x, train.y), steps=6)
    ev = t.evaluate((val.x, val.y))
    logits = t.predict(val.x)
    assert logits.shape == (len(val), 4)
    acc = float(np.mean(np.argmax(logits, -1) == val.y))
    assert ev["accuracy"] == pytest.approx(acc)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, val.y)
    assert ev["loss"] == pytest.approx(float(np.mean(ce)), rel=1e-5)


@pytest.mark.devices(2)
def test_nan_loss_halts_and_keeps_last_good_checkpoint(dataset, tmp_path):
    train, _ = dataset
    x = train.x.copy()
    x[5 * GBS:] = np.nan   # batches 0-4 are fine, step 6 sees NaN
    t = _trainer(jaxdist.MirroredStrategy(jax.devices()[:2]), shuffle=False,
                 checkpoint_dir=str(tmp_path), checkpoint_every_steps=2)
    with pytest.raises(NaNLossError, match="at step 6") as info:
        t.fit((x, train.y), steps=8)
    assert info.value.last_checkpoint == 4
    assert t._checkpointer.all_steps() == [2, 4]
    state, meta = t._checkpointer.restore(4)
    assert meta["step"] == 4
    assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(state))


def test_bad_data_shape_is_one_clear_error(dataset):
    train, _ = dataset
    t = _trainer(jaxdist.OneDeviceStrategy(jax.devices()[0]))
    with pytest.raises(data_lib.DataError, match=r"shape \(7,\)"):
        t.fit((train.x[:, :7], train.y), steps=1)
    with pytest.raises(data_lib.DataError, match="rows"):
        t.fit((train.x, train.y[:10]), steps=1)
    with pytest.raises(data_lib.DataError, match="out of range"):
        t.fit((train.x, train.y + 10), steps=1)


@pytest.mark.devices(4)
def test_batch_must_divide_across_replicas():
    with pytest.raises(ValueError, match="multiple of 4"):
        _trainer_bad = Trainer(MLP(3, [], 2, rngs=nnx.Rngs(0)), optax.sgd(0.1),
                               global_batch_size=30,
                               strategy=jaxdist.MirroredStrategy(jax.devices()[:4]))
        del _trainer_bad


@pytest.mark.devices(2)
def test_cnn_trains_under_scope_strategy():
    train, val = job_data.load_digits()
    strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
    with strategy.scope():
        model = CNN((8, 8, 1), [8], 10, rngs=nnx.Rngs(0))
        t = Trainer(model, optax.adam(1e-2), global_batch_size=64, progress_bar="never",
                    log_every_steps=1000)
    assert t.strategy is strategy
    t.fit((train.x, train.y), steps=40)
    assert t.evaluate((val.x, val.y))["accuracy"] > 0.8


def test_same_seed_and_config_same_final_loss_through_run_job():
    from jaxdist._src.job.config import load_config
    from jaxdist._src.job.job import run_job

    overrides = ["data.name=synthetic", "data.num_examples=600", "data.num_features=8",
                 "model.hidden_sizes=[16]", "train.steps=12", "logging.dir=null",
                 "logging.progress_bar=never", "train.global_batch_size=32", "seed=5"]
    devices = [device_string(i) for i in range(min(2, len(jax.devices())))]
    cfg = load_config(raw={"strategy": {"name": "mirrored", "devices": devices}},
                      overrides=overrides)
    ends = [run_job(cfg).records[-1] for _ in range(2)]
    assert ends[0]["final_loss"] == ends[1]["final_loss"]
    assert ends[0]["val_loss"] == ends[1]["val_loss"]


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.devices(2)
def test_input_blocks_train_on_each_batch_once_in_order(dataset, k):
    """Steps fed from input blocks (several steps per host-to-device transfer, the chunk picked
    on the device, the last block of an epoch padded) equal a hand-written optax loop over the
    same batches in the same order, across epochs and a partial last epoch."""
    train, _ = dataset
    spe = len(train) // GBS                 # 6 steps an epoch: blocks of 8 at k=1 (padded)
    steps = 2 * spe + 2
    strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
    t = _trainer(strategy, steps_per_execution=k, shuffle=False)
    assert t._block_sizes(train, spe) == ({1: 8} if k == 1 else {4: 1, 1: 4})
    history = t.fit((train.x, train.y), steps=steps)

    graphdef, params = nnx.split(MLP(12, [16], 4, rngs=nnx.Rngs(0)), nnx.Param)
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)

    step = optax_step(graphdef, tx)

    losses = []
    for i in range(steps):
        s = i % spe
        params, opt_state, loss = step(params, opt_state, train.x[s * GBS:(s + 1) * GBS],
                                       train.y[s * GBS:(s + 1) * GBS])
        losses.append(float(loss))
    for a, b in zip(jax.tree.leaves(params), _leaves(t)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert history.history["loss"] == pytest.approx(          # the two completed epochs
        [np.mean(losses[:spe]), np.mean(losses[spe:2 * spe])], rel=1e-5)
    assert history.records[-1]["final_loss"] == pytest.approx(np.mean(losses), rel=1e-5)
