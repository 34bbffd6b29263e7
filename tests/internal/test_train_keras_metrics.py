"""Trainer metrics: Keras names, exact reduction across replicas (partial last batch included),
AUC's streaming approximation, the learning rate in the logs, config validation."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist
from jaxdist._src.job.config import ConfigError, load_config
from jaxdist._src.job.models import MLP
from jaxdist._src.train import keras_metrics as M
from jaxdist._src.train.trainer import Trainer

GBS = 16


def _data(n, classes, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 6)).astype(np.float32)
    y = (np.abs(x[:, 0] * 2 + x[:, 1]).astype(np.int32) % classes).astype(np.int32)
    return x, y


def _trainer(strategy, classes, metrics):
    with strategy.scope():
        model = MLP(6, [8], classes, rngs=nnx.Rngs(1))
        return Trainer(model, optax.inject_hyperparams(optax.adam)(learning_rate=0.01),
                       global_batch_size=GBS, strategy=strategy, metrics=metrics,
                       progress_bar="never", log_every_steps=1000)


def _keras_auc(scores, labels, num_thresholds=200):
    eps = 1e-7
    th = np.array([-eps] + [(i + 1) / (num_thresholds - 1)
                            for i in range(num_thresholds - 2)] + [1 + eps])
    above = scores[:, None] > th[None, :]
    pos, neg = labels == 1, labels == 0
    tp, fp = (above & pos[:, None]).sum(0), (above & neg[:, None]).sum(0)
    tpr, fpr = tp / pos.sum(), fp / neg.sum()
    return float(np.sum((fpr[:-1] - fpr[1:]) * (tpr[:-1] + tpr[1:]) / 2))


def _exact_auc(scores, labels):
    pos, neg = scores[labels == 1], scores[labels == 0]
    return float(((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :])
                  .sum()) / (len(pos) * len(neg)))


@pytest.mark.devices(8)
def test_eight_replicas_with_a_partial_last_batch_equal_one_device():
    x, y = _data(101, 4)  # 6 full global batches of 16 and a partial one of 5
    metrics = ["accuracy", M.SparseTopKCategoricalAccuracy(k=2)]
    one = _trainer(jaxdist.OneDeviceStrategy(jax.devices()[0]), 4, metrics)
    eight = _trainer(jaxdist.MirroredStrategy(jax.devices()[:8]), 4, metrics)
    a, b = one.evaluate((x, y)), eight.evaluate((x, y))
    assert set(a) == {"loss", "accuracy", "sparse_top_k_categorical_accuracy"}
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-6), k
    logits = one.predict(x)
    top2 = np.argsort(-logits, axis=1)[:, :2]
    assert a["sparse_top_k_categorical_accuracy"] == pytest.approx(
        np.mean((top2 == y[:, None]).any(1)), abs=1e-7)
    assert a["accuracy"] == pytest.approx(np.mean(logits.argmax(1) == y), abs=1e-7)


@pytest.mark.devices(8)
def test_auc_streams_as_keras_and_reduces_across_replicas():
    x, y = _data(101, 2, seed=3)
    one = _trainer(jaxdist.OneDeviceStrategy(jax.devices()[0]), 2, ["auc"])
    eight = _trainer(jaxdist.MirroredStrategy(jax.devices()[:8]), 2, ["auc"])
    a, b = one.evaluate((x, y)), eight.evaluate((x, y))
    assert b["auc"] == pytest.approx(a["auc"], rel=1e-6)
    scores = np.asarray(jax.nn.softmax(one.predict(x), -1))[:, 1]
    assert a["auc"] == pytest.approx(_keras_auc(scores, y), abs=1e-6)
    assert a["auc"] == pytest.approx(_exact_auc(scores, y), abs=0.02)
    assert "accuracy" not in a  # only the metrics asked for


@pytest.mark.devices(4)
def test_train_metrics_and_learning_rate_match_across_strategies():
    x, y = _data(128, 4)
    metrics = ["accuracy", {"name": "sparse_top_k_categorical_accuracy", "k": 2}]
    hs = []
    for strategy in (jaxdist.OneDeviceStrategy(jax.devices()[0]),
                     jaxdist.MirroredStrategy(jax.devices()[:4])):
        t = _trainer(strategy, 4, metrics)
        hs.append(t.fit((x, y), epochs=2, validation_data=(x[:40], y[:40]), verbose=0))
    a, b = (h.history for h in hs)
    assert set(a) == {"loss", "accuracy", "sparse_top_k_categorical_accuracy", "learning_rate",
                      "val_loss", "val_accuracy", "val_sparse_top_k_categorical_accuracy"}
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, err_msg=k)
    assert a["learning_rate"] == pytest.approx([0.01, 0.01])
    train_records = [r for r in hs[0].records if r["event"] == "train"]
    assert train_records and all(r["learning_rate"] == pytest.approx(0.01)
                                 for r in train_records)


def test_metric_objects_and_functions():
    assert isinstance(M.get("acc"), M.SparseCategoricalAccuracy)
    assert M.get({"name": "sparse_top_k_categorical_accuracy", "k": 3}).k == 3
    wrapped = M.get(lambda logits, y: logits[:, 0])
    assert isinstance(wrapped, M.MeanMetricWrapper)
    mask = np.array([1.0, 1.0, 0.0], np.float32)
    logits = np.array([[2.0, 0.0], [4.0, 1.0], [100.0, 0.0]], np.float32)
    sums = jax.device_get(wrapped.update(logits, np.zeros(3), mask))
    assert wrapped.result(sums) == pytest.approx(3.0)  # the padded row does not count
    binary = M.BinaryAccuracy()
    sums = binary.update(np.array([[0.5], [-1.0], [2.0]]), np.array([1, 1, 0]), mask)
    assert binary.result(jax.device_get(sums)) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="'f1' is not known"):
        M.get("f1")
    with pytest.raises(ValueError, match="k=0"):
        M.SparseTopKCategoricalAccuracy(k=0)
    with pytest.raises(ValueError, match="AUC needs binary scores"):
        M.AUC().update(np.zeros((2, 3)), np.zeros(2), np.ones(2))


@pytest.mark.parametrize("metrics, message", [
    (["f1"], "train.metrics[0]: metric 'f1' is not known"),
    ([{"name": "auc", "num_thresholds": 1}], "train.metrics[0]: num_thresholds=1"),
    ([{"k": 3}], "has no 'name'"),
    ([3], "train.metrics[0]: 3 is not valid"),
])
def test_config_metrics_are_validated(metrics, message):
    with pytest.raises(ConfigError) as e:
        load_config(raw={"train": {"metrics": metrics}})
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.devices(2)
def test_weighted_metrics_are_weighted_and_metrics_are_not_as_in_keras():
    """``metrics`` ignore the sample weights, ``weighted_metrics`` use them (Keras' names:
    a repeated name gets ``weighted_``); a weight of 2 counts a row twice."""
    import jax
    import optax
    from flax import nnx

    import jaxdist
    from jaxdist._src.job.models import MLP
    from jaxdist._src.train.keras_metrics import AUC

    rng = np.random.default_rng(1)
    x = rng.normal(size=(48, 5)).astype(np.float32)
    y = (x[:, 0] + rng.normal(size=48) > 0).astype(np.int32)
    w = rng.integers(0, 3, size=48).astype(np.float32)          # 0, 1 or 2 per row
    strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
    with strategy.scope():
        t = jaxdist.Trainer(MLP(5, [8], 2, rngs=nnx.Rngs(0)), optax.sgd(0.1),
                            global_batch_size=16, strategy=strategy, progress_bar="never",
                            metrics=["accuracy", AUC()],
                            weighted_metrics=["accuracy", AUC(), AUC(name="auc_w")])
    got = t.evaluate((x, y, w))
    assert set(got) == {"loss", "accuracy", "auc", "weighted_accuracy", "weighted_auc",
                        "auc_w"}
    plain = t.evaluate((x, y))
    assert got["accuracy"] == pytest.approx(plain["accuracy"])
    assert got["auc"] == pytest.approx(plain["auc"])
    # weights as repeated rows: the weighted metrics equal the unweighted ones on them
    rep = np.repeat(np.arange(48), w.astype(int))
    repeated = t.evaluate((x[rep], y[rep]))
    assert got["weighted_accuracy"] == pytest.approx(repeated["accuracy"], rel=1e-6)
    assert got["weighted_auc"] == pytest.approx(repeated["auc"], rel=1e-6)
    assert got["auc_w"] == pytest.approx(got["weighted_auc"])
    # and in training: the logged weighted metrics use the sample weights
    h = t.fit((x, y), sample_weight=w, epochs=1, verbose=0)
    assert {"weighted_accuracy", "weighted_auc", "accuracy", "auc"} <= set(h.history)
