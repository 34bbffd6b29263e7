"""flax NNX objects through ``strategy.run``: updated in place, one device's numbers on N.

The global view (an ``nnx.jit`` step, flax's own train step) must give exactly what the same
step gives on one device over the same global batches, including a partial last batch, dropout,
BatchNorm statistics and metrics. The replica view (a plain function, TF's semantics) reduces
per-replica state by the documented SyncOnRead rule, or refuses loudly.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from devutil import first_devices
from flax import nnx

import jaxdist
from jaxdist import NnxStateError

ROWS, BATCH = 70, 16  # a last batch of 6 rows: it does not divide over 4 replicas


def _need(n):
    have = jax.local_device_count()
    if have < n:
        pytest.skip(f"needs {n} local devices, {have} available")


class Net(nnx.Module):
    def __init__(self, *, rngs, batch_norm=True, dropout=0.1):
        # No bias before BatchNorm: its gradient is zero up to rounding, which Adam would
        # amplify to full steps, making the comparison a test of rounding order.
        self.l1 = nnx.Linear(8, 16, use_bias=not batch_norm, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs) if batch_norm else None
        self.do = nnx.Dropout(dropout, rngs=rngs)
        self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        h = self.l1(x)
        if self.bn is not None:
            h = self.bn(h)
        return self.l2(self.do(nnx.relu(h)))


def _loss_fn(model, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, logits


# flax's MNIST tutorial step, as written there.
@nnx.jit
def flax_train_step(model, optimizer, metrics, batch):
    grad_fn = nnx.value_and_grad(_loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


@nnx.jit
def flax_eval_step(model, metrics, batch):
    loss, logits = _loss_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])


def _dataset(rows=ROWS):
    rng = np.random.RandomState(0)
    x = rng.randn(rows, 8).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int32) + (x[:, 2] > 1).astype(np.int32)
    return jaxdist.Dataset.from_tensor_slices({"image": x, "label": y}).batch(BATCH)


def _objects(tx):
    model = Net(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    metrics = nnx.MultiMetric(
        accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss")
    )
    return model, optimizer, metrics


def _snapshot(model, optimizer, metrics):
    return {
        "state": jax.tree.map(
            np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat)))
        ),
        "step": int(optimizer.step[...]),
        "metrics": {k: float(v) for k, v in metrics.compute().items()},
    }


def _one_device(tx, epochs=2, rows=ROWS):
    model, optimizer, metrics = _objects(tx)
    model.train()
    for _ in range(epochs):
        for batch in _dataset(rows):
            flax_train_step(model, optimizer, metrics, batch)
    train = _snapshot(model, optimizer, metrics)
    metrics.reset()
    model.eval()
    for batch in _dataset(rows):
        flax_eval_step(model, metrics, batch)
    return train, {k: float(v) for k, v in metrics.compute().items()}


@functools.cache
def _adamw_reference():
    """``_one_device`` with the tests' adamw, computed once: the tests only read it."""
    return _one_device(optax.adamw(1e-2, 0.9))


def _distributed(strategy, tx, epochs=2):
    with strategy.scope():
        model, optimizer, metrics = _objects(tx)
    model.train()
    dist = strategy.experimental_distribute_dataset(_dataset())
    for _ in range(epochs):
        for batch in dist:
            strategy.run(flax_train_step, args=(model, optimizer, metrics, batch))
    train = _snapshot(model, optimizer, metrics)
    metrics.reset()
    model.eval()
    for batch in dist:
        strategy.run(flax_eval_step, args=(model, metrics, batch))
    return train, {k: float(v) for k, v in metrics.compute().items()}


def _assert_same(got, want):
    (g_train, g_eval), (w_train, w_eval) = got, want
    assert g_train["step"] == w_train["step"]
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        g_train["state"], w_train["state"],
    )
    for k in w_train["metrics"]:
        np.testing.assert_allclose(g_train["metrics"][k], w_train["metrics"][k], rtol=1e-5)
        np.testing.assert_allclose(g_eval[k], w_eval[k], rtol=1e-5)


STRATEGIES = {
    "mirrored4": lambda: jaxdist.MirroredStrategy(first_devices(4)),
    "mirrored1": lambda: jaxdist.MirroredStrategy(jax.local_devices()[:1]),
    "one_device": lambda: jaxdist.OneDeviceStrategy(jax.local_devices()[0]),
    "central_storage": lambda: jaxdist.CentralStorageStrategy(first_devices(4)),
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_flax_train_step_matches_one_device(name):
    """flax's own nnx.jit step through strategy.run: the weights, the optimizer step, the
    BatchNorm statistics, dropout and every metric are one device's, partial last batch
    included (70 rows in batches of 16 on 4 replicas)."""
    _need(4 if name in ("mirrored4", "central_storage") else 1)
    tx = optax.adamw(1e-2, 0.9)
    _assert_same(_distributed(STRATEGIES[name](), tx), _adamw_reference())


def test_flax_step_with_sgd_is_not_scaled_by_replica_count():
    """With plain SGD a gradient N times too large would show at once."""
    _need(4)
    tx = optax.sgd(0.5)
    _assert_same(_distributed(STRATEGIES["mirrored4"](), tx), _one_device(tx))


@pytest.mark.devices(2)
def test_mutation_inside_run_is_visible_outside():
    """Never a silent no-op: a plain step that mutates NNX objects changes the caller's."""
    _need(2)
    strategy = jaxdist.MirroredStrategy(jax.local_devices()[:2])

    class Counter(nnx.Module):
        def __init__(self):
            self.calls = nnx.Variable(jnp.zeros((), jnp.int32))
            self.w = nnx.Param(jnp.ones((3,)))

    with strategy.scope():
        counter = Counter()

    def step(c, scale):
        c.calls[...] = c.calls[...] + 1
        c.w[...] = c.w[...] * scale

    for _ in range(3):
        strategy.run(step, args=(counter, 2.0))
    assert int(counter.calls[...]) == 3
    np.testing.assert_allclose(np.asarray(counter.w[...]), np.full(3, 8.0))
    assert len(strategy.extended._run_cache) == 1  # compiled once, not once per call


@pytest.mark.devices(2)
def test_step_defined_inside_the_loop_compiles_once():
    """A step function made anew each call (TF's step_fn inside train_step) over NNX objects
    shares one compiled step when its code and captures are the same."""
    _need(2)
    strategy = jaxdist.MirroredStrategy(jax.local_devices()[:2])
    with strategy.scope():
        layer = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    traces = []

    def train_step(m, x):
        def step(m, x):
            traces.append(1)
            m.kernel[...] = m.kernel[...] * 0.5
            return jnp.sum(m(x))
        return strategy.run(step, args=(m, x))

    for i in range(5):
        train_step(layer, jnp.ones((2, 3)))
        if i == 0:
            first = len(traces)
    assert len(traces) == first
    assert len(strategy.extended._run_cache) == 1


@pytest.mark.devices(2)
def test_shared_references_survive():
    """A module held by two objects is one module after the step, as under nnx.jit."""
    _need(2)
    strategy = jaxdist.MirroredStrategy(jax.local_devices()[:2])

    class Holder(nnx.Module):
        def __init__(self, layer):
            self.layer = layer

    with strategy.scope():
        shared = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        a, b = Holder(shared), Holder(shared)

    def step(a, b):
        a.layer.bias[...] = a.layer.bias[...] + 1.0

    strategy.run(step, args=(a, b))
    assert a.layer is b.layer is shared
    np.testing.assert_allclose(np.asarray(b.layer.bias[...]), np.ones(2))


def _tf_style_step(global_batch):
    def step(model, optimizer, metrics, x, y):
        def loss_fn(model):
            logits = model(x)
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
            return jaxdist.compute_average_loss(per_example, global_batch_size=global_batch), logits

        (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        metrics.update(loss=loss, logits=logits, labels=y)
        return loss

    return step


def _tf_style_run(strategy, batch_norm, rows=64):
    with strategy.scope():
        model = Net(rngs=nnx.Rngs(0), batch_norm=batch_norm, dropout=0.0)
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy())
    rng = np.random.RandomState(1)
    x = rng.randn(rows, 8).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    ds = jaxdist.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    step = _tf_style_step(BATCH)
    losses = []
    for bx, by in strategy.experimental_distribute_dataset(ds):
        per_replica = strategy.run(step, args=(model, optimizer, metrics, bx, by))
        losses.append(float(strategy.reduce("SUM", per_replica, axis=None)))
    return model, metrics, losses


@pytest.mark.devices(4)
def test_replica_view_tf_style_step_matches_one_device():
    """TF's custom-loop pattern with an NNX model (compute_average_loss, per-replica step):
    weights, the summed loss and the summed metric state are one device's."""
    _need(4)
    m4, met4, l4 = _tf_style_run(jaxdist.MirroredStrategy(jax.local_devices()[:4]), False)
    m1, met1, l1 = _tf_style_run(jaxdist.OneDeviceStrategy(jax.local_devices()[0]), False)
    np.testing.assert_allclose(l4, l1, rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(m4.l1.kernel[...]), np.asarray(m1.l1.kernel[...]), rtol=1e-5, atol=1e-6
    )
    # Accuracy's state (total, count) is SyncOnRead SUM: 64 rows counted once each.
    assert int(met4.accuracy.count[...]) == int(met1.accuracy.count[...]) == 64
    np.testing.assert_allclose(
        float(met4.compute()["accuracy"]), float(met1.compute()["accuracy"]), rtol=1e-6
    )


@pytest.mark.devices(4)
def test_replica_view_batch_statistics_are_averaged():
    """BatchNorm's moving mean after one per-replica step is the mean of the replicas'
    (equal shards: one device's moving mean); the variance is TF's per-replica one."""
    _need(4)
    m4, _, _ = _tf_style_run(jaxdist.MirroredStrategy(jax.local_devices()[:4]), True, rows=16)
    m1, _, _ = _tf_style_run(jaxdist.OneDeviceStrategy(jax.local_devices()[0]), True, rows=16)
    np.testing.assert_allclose(
        np.asarray(m4.bn.mean[...]), np.asarray(m1.bn.mean[...]), rtol=1e-5, atol=1e-7
    )
    assert m4.bn.mean[...].sharding.is_fully_replicated


@pytest.mark.devices(2)
def test_replica_view_refuses_diverging_parameters():
    _need(2)
    strategy = jaxdist.MirroredStrategy(jax.local_devices()[:2])
    with strategy.scope():
        layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: jnp.full((2,), float(ctx.replica_id_in_sync_group))
    )

    def step(layer, x):
        layer.bias[...] = layer.bias[...] + x  # a per-replica value, never reduced

    with pytest.raises(NnxStateError, match=r"Param .*bias.* differs across the replicas"):
        strategy.run(step, args=(layer, x))


@pytest.mark.devices(4)
def test_replica_view_refuses_metrics_on_a_partial_batch():
    """Padding rows would count in the metric: refused, with the nnx.jit fix in the message."""
    _need(4)
    with pytest.raises(NnxStateError, match=r"partial last batch.*@nnx\.jit"):
        _tf_style_run(jaxdist.MirroredStrategy(jax.local_devices()[:4]), False, rows=70)


@pytest.mark.devices(2)
def test_structure_change_is_an_error():
    _need(2)
    strategy = jaxdist.MirroredStrategy(jax.local_devices()[:2])
    with strategy.scope():
        layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def step(layer):
        layer.extra = nnx.Variable(jnp.zeros(()))

    with pytest.raises(NnxStateError, match="changed the structure"):
        strategy.run(step, args=(layer,))


@pytest.mark.devices(2)
def test_donated_nnx_state():
    _need(2)
    strategy = jaxdist.MirroredStrategy(jax.local_devices()[:2])
    with strategy.scope():
        layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    old_bias = layer.bias[...]

    @nnx.jit
    def step(layer):
        layer.bias[...] = layer.bias[...] + 1.0

    for _ in range(2):
        strategy.run(step, args=(layer,), options=jaxdist.RunOptions(donate_argnums=(0,)))
    np.testing.assert_allclose(np.asarray(layer.bias[...]), np.full(2, 2.0))
    assert old_bias.is_deleted()


def test_doc_nnx_block_runs_as_written(capsys):
    """The flax NNX block of docs/nnx.md, extracted and run verbatim."""
    import pathlib
    import re

    page = (pathlib.Path(__file__).parent.parent / "docs" / "nnx.md").read_text()
    section = page.split("# flax NNX steps through `strategy.run`", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "docs/nnx.md:flax-nnx", "exec"), {"__name__": "doc_nnx"})
    printed = capsys.readouterr().out
    assert printed.startswith("16 ")
    assert "accuracy" in printed


@pytest.mark.slow
def test_flax_train_step_across_two_processes_matches_one_device(tmp_path):
    """MultiWorkerMirroredStrategy, 2 processes x 2 devices on 127.0.0.1: the nnx.jit step
    runs over the global batch of both processes (72 rows: a last batch of 8, 2 per replica;
    a last batch that does not divide is refused across processes by the input pipeline)."""
    import os
    import sys

    from jaxdist.testing import LocalCluster

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "state.npz"
    with LocalCluster(workers=2, devices_per_process=2, cwd=root,
                      env={"PYTHONPATH": root}) as c:
        c.start([sys.executable, os.path.join(root, "tests", "mw_nnx_worker.py"), str(out)])
        # The one-device reference, computed here while the workers start and train.
        (want, _) = _one_device(optax.adamw(1e-2, 0.9), epochs=1, rows=72)
        codes = c.join(timeout=150)
        assert codes == {"worker:0": 0, "worker:1": 0}, c.describe()
    got = np.load(out)
    assert int(got["step"]) == want["step"] == 5
    for i, a in enumerate(jax.tree.leaves(want["state"])):
        np.testing.assert_allclose(got[f"arr_{i}"], a, rtol=1e-5, atol=1e-6)
    for k in ("accuracy", "loss"):
        np.testing.assert_allclose(float(got[k]), want["metrics"][k], rtol=1e-5)
