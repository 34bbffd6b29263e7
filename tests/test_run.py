"""strategy.run semantics: splitting, replicated state, output types, caching, jit, grad."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from devutil import first_devices
from flax import nnx

import jaxdist
from jaxdist import PerReplica


@pytest.fixture
def strategy():
    return jaxdist.MirroredStrategy(first_devices(4))  # the tests' numbers are for 4 replicas


def _dist(strategy, rows=8, cols=3):
    x = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    return x, next(iter(strategy.experimental_distribute_dataset([x])))


def test_per_replica_inputs_are_split_state_passed_whole(strategy):
    x, xd = _dist(strategy)
    with strategy.scope():
        w = jnp.arange(3.0)

    def fn(w, xb):
        assert xb.shape == (2, 3), xb.shape  # one quarter of the global batch
        assert w.shape == (3,)
        return xb @ w

    out = strategy.run(fn, args=(w, xd))
    assert isinstance(out, PerReplica)
    parts = strategy.experimental_local_results(out)
    np.testing.assert_allclose(np.concatenate([np.asarray(p) for p in parts]), x @ np.arange(3.0))


def test_identical_output_is_one_replicated_array(strategy):
    _, xd = _dist(strategy)
    with strategy.scope():
        w = jnp.ones((3,))

    def fn(w, xb):
        total = jaxdist.get_replica_context().all_reduce("SUM", jnp.sum(xb))
        return w + total, w  # both identical on every replica

    new_w, same_w = strategy.run(fn, args=(w, xd))
    for out in (new_w, same_w):
        assert isinstance(out, jax.Array) and not isinstance(out, PerReplica)
        assert out.shape == (3,), "never N stacked copies of mirrored state"
        assert out.sharding.is_fully_replicated
        assert out.sharding.device_set == set(strategy.extended.worker_devices)
    np.testing.assert_allclose(new_w, 1 + np.arange(24.0).sum())


def test_varying_output_is_per_replica_with_replica_ids(strategy):
    out = strategy.run(lambda: jaxdist.get_replica_context().replica_id_in_sync_group)
    assert isinstance(out, PerReplica) and out.num_replicas == 4
    assert [int(v) for v in out.values] == [0, 1, 2, 3]


def test_nested_outputs_and_kwargs(strategy):
    _, xd = _dist(strategy)

    def fn(xb, scale=1.0):
        rctx = jaxdist.get_replica_context()
        return {"local": xb * scale, "mean": rctx.all_reduce("MEAN", xb.mean()), "n": 3}

    out = strategy.run(fn, args=(xd,), kwargs={"scale": 2.0})
    assert isinstance(out["local"], PerReplica)
    assert isinstance(out["mean"], jax.Array) and out["mean"].shape == ()
    assert int(out["n"]) == 3
    np.testing.assert_allclose(out["mean"], np.arange(24.0).mean(), rtol=1e-6)


def test_grad_inside_run_matches_single_device(strategy):
    rng = np.random.RandomState(0)
    x = rng.randn(16, 5).astype(np.float32)
    y = rng.randint(0, 3, 16)
    params = {"w": rng.randn(5, 3).astype(np.float32), "b": np.zeros(3, np.float32)}

    def loss_fn(p, xb, yb):
        per = optax.softmax_cross_entropy_with_integer_labels(xb @ p["w"] + p["b"], yb)
        return jaxdist.compute_average_loss(per, global_batch_size=16)

    ref = jax.grad(loss_fn)(params, x, y)
    xd, yd = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    placed = strategy.place(params)

    # JAX-native: gradients of replicated state are already summed over replicas.
    g = strategy.run(lambda p, xb, yb: jax.grad(loss_fn)(p, xb, yb), args=(placed, xd, yd))

    # TF-style: per-replica gradients reduced with the cross-device op.
    def tf_style(p, xb, yb):
        ctx = jaxdist.get_replica_context()
        return ctx.all_reduce("SUM", jax.grad(loss_fn)(ctx.local(p), xb, yb))

    g2 = strategy.run(tf_style, args=(placed, xd, yd))
    for got in (g, g2):
        for k in ref:
            assert isinstance(got[k], jax.Array) and not isinstance(got[k], PerReplica)
            np.testing.assert_allclose(got[k], ref[k], atol=1e-6)


def test_second_call_same_shapes_does_not_recompile(strategy):
    traces = []

    def fn(w, xb):
        traces.append(1)
        return jaxdist.get_replica_context().all_reduce("SUM", xb.sum()) + w

    _, xd = _dist(strategy)
    w = strategy.place(jnp.float32(1.0))
    with jax.log_compiles(True):
        strategy.run(fn, args=(w, xd))
        n_traces = len(traces)
        size_before = _compiled_versions(strategy, fn)
        strategy.run(fn, args=(w, xd))
        strategy.run(fn, args=(w + 1, xd))
    assert len(traces) == n_traces, "the second call with the same shapes retraced fn"
    assert _compiled_versions(strategy, fn) == size_before == 1
    # A new shape compiles once more.
    _, xd2 = _dist(strategy, rows=16)
    strategy.run(fn, args=(w, xd2))
    assert _compiled_versions(strategy, fn) == 2


def _compiled_versions(strategy, fn) -> int:
    return strategy.extended._compiled_versions(fn)


def test_run_inside_user_jit(strategy):
    _, xd = _dist(strategy)
    w = strategy.place(jnp.ones((3,)))

    @jax.jit
    def outer(w, xd):
        out = strategy.run(
            lambda w, xb: (w * jaxdist.get_replica_context().all_reduce("SUM", xb.sum()), xb),
            args=(w, xd),
        )
        return out

    new_w, xb = outer(w, xd)
    assert isinstance(new_w, jax.Array) and new_w.shape == (3,)
    assert isinstance(xb, PerReplica)
    np.testing.assert_allclose(new_w, np.full(3, np.arange(24.0).sum()))


def test_nnx_module_and_optax_state_created_under_scope_are_replicated(strategy):
    with strategy.scope():
        model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        params = nnx.state(model, nnx.Param)
        opt_state = optax.adam(1e-3).init(params)
    for leaf in jax.tree.leaves((params, opt_state)):
        assert leaf.sharding.is_fully_replicated
        assert leaf.sharding.device_set == set(strategy.extended.worker_devices)
        assert len(leaf.addressable_shards) == 4


def test_place_state_made_elsewhere(strategy):
    tree = {"a": np.ones((2, 2), np.float32), "b": jnp.zeros(3)}
    placed = strategy.place(tree)
    for leaf in jax.tree.leaves(placed):
        assert leaf.sharding.is_fully_replicated
        assert leaf.sharding.device_set == set(strategy.extended.worker_devices)


@pytest.mark.devices(5)
def test_run_moves_state_from_another_device(strategy):
    w = jax.device_put(jnp.ones(3), jax.devices()[4])  # outside the strategy's devices
    out = strategy.run(lambda w: w * 2, args=(w,))
    np.testing.assert_allclose(out, 2 * np.ones(3))


class _Unhashable:
    __hash__ = None


def test_errors(strategy):
    with pytest.raises(TypeError, match="callable"):
        strategy.run(42)
    bad = PerReplica(jnp.zeros((3, 2)))
    with pytest.raises(ValueError, match="3 replicas"):
        strategy.run(lambda x: x, args=(bad,))
    with pytest.raises(TypeError, match="neither an array nor hashable"):
        strategy.run(lambda x: x, args=({"k": _Unhashable()},))
    with pytest.raises(TypeError, match="args must be a tuple"):
        strategy.run(lambda x: x, args=jnp.ones(2))


def test_python_scalars_are_traced_not_static(strategy):
    traces = []

    def fn(lr):
        traces.append(1)
        return lr * 2

    for lr in (0.1, 0.2, 0.3):
        out = strategy.run(fn, args=(lr,))
    assert len(traces) <= 2  # probe + real trace, once
    np.testing.assert_allclose(out, 0.6, rtol=1e-6)


def test_new_function_objects_capturing_new_arrays_each_step_warn_once(strategy):
    """A function made anew each step that captures another array each time compiles each
    time (the array is compiled into the step): one warning names the fix."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(10):
            offset = jnp.float32(i)
            out = strategy.run(lambda x, offset=offset: x + offset, args=(jnp.float32(i),))
            assert float(out) == 2 * i  # never another step's offset
    msgs = [str(w.message) for w in caught if "different function objects" in str(w.message)]
    assert len(msgs) == 1 and "Pass those values as arguments" in msgs[0]


def test_step_fn_defined_inside_train_step_compiles_once(strategy):
    """TF's custom-loop habit: ``step_fn`` defined inside ``train_step``, a new function object
    at every call, capturing the same objects and numbers: 30 calls trace and compile once."""
    import warnings

    _, xd = _dist(strategy)
    with strategy.scope():
        w = jnp.arange(3.0)
    traces = []
    config = {"scale": 0.5}  # the same object every call

    def train_step(w, xd, lr):
        def step_fn(w, xb):
            traces.append(1)
            loss = jnp.sum((xb @ w) * config["scale"])
            total = jaxdist.get_replica_context().all_reduce("SUM", loss)
            return w - lr * total / 100.0
        return strategy.run(step_fn, args=(w, xd))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        expected = np.asarray(w)
        x = np.arange(24, dtype=np.float32).reshape(8, 3)
        for step in range(30):
            w = train_step(w, xd, 0.01)  # a float made by the same literal: equal value
            expected = expected - 0.01 * np.sum(x @ expected * 0.5) / 100.0
            if step == 0:
                traced = len(traces)
    assert len(traces) == traced, "a step_fn with the same code and captures was traced again"
    assert not [w_ for w_ in caught if "different function objects" in str(w_.message)]
    np.testing.assert_allclose(w, expected, rtol=1e-5)


def test_update_function_made_anew_compiles_once(strategy):
    """extended.update with a lambda written in the loop (TF's habit) traces once; another
    captured number is another function."""
    with strategy.scope():
        w = jnp.ones(3)
    traces = []

    def make(lr):
        def apply(v, g):
            traces.append(1)
            return v - lr * g
        return apply

    for _ in range(5):
        w = strategy.extended.update(w, make(0.5), args=(jnp.ones(3),))
    assert len(traces) == 1
    np.testing.assert_allclose(w, np.full(3, 1 - 5 * 0.5))
    w = strategy.extended.update(w, make(0.25), args=(jnp.ones(3),))
    assert len(traces) == 2
    np.testing.assert_allclose(w, np.full(3, -1.5 - 0.25))


def test_step_fn_capturing_other_values_is_not_reused(strategy):
    """A wrong cache hit would be a silent wrong result: a nested step_fn that captures another
    number, array, object or default each call gives that call's numbers."""
    x, xd = _dist(strategy)
    sums = x.reshape(4, 2, 3).sum(axis=(1, 2))  # each replica's rows

    def make(kind, v):
        if kind == "float":
            return lambda xb: jnp.sum(xb) * v
        if kind == "array":
            arr = jnp.full((3,), v)
            return lambda xb: jnp.sum(xb * arr)
        if kind == "object":
            box = {"v": v}
            return lambda xb: jnp.sum(xb) * box["v"]

        def with_default(xb, v=v):
            return jnp.sum(xb) * v
        return with_default

    for kind in ("float", "array", "object", "default"):
        for v in (1.0, 2.0, 3.0, 2.0):
            out = strategy.experimental_local_results(strategy.run(make(kind, v), args=(xd,)))
            np.testing.assert_allclose(np.asarray(out), sums * v, err_msg=kind)
    # Equal as numbers, different as floats: 0.0 and -0.0 are two steps.
    signs = [np.signbit(np.asarray(strategy.experimental_local_results(
        strategy.run(make("float", z), args=(xd,)))[0])) for z in (0.0, -0.0)]
    assert signs == [False, True]


@pytest.mark.devices(2)
def test_steady_state_run_skips_the_checks_and_falls_back_when_a_leaf_changes(monkeypatch):
    """A repeated call with the same structure, placement and statics is one cached compiled
    call (no flatten with per-leaf callbacks, no re-validation); anything different takes the
    full path, which places and checks it."""
    if jax.local_device_count() < 2:
        pytest.skip(f"needs 2 local devices, {jax.local_device_count()} available")
    strategy = jaxdist.MirroredStrategy(jax.local_devices()[:2])
    ext = strategy.extended
    with strategy.scope():
        w = jnp.ones((3,))
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: jnp.full((2, 3), float(ctx.replica_id_in_sync_group + 1)))

    def step(w, x, scale, mode):
        out = jaxdist.get_replica_context().all_reduce("SUM", (x * w).sum()) * scale
        return out if mode == "plain" else -out

    full = []
    original = type(ext)._run_flat
    monkeypatch.setattr(type(ext), "_run_flat",
                        lambda self, *a, **k: full.append(1) or original(self, *a, **k))
    assert float(strategy.run(step, args=(w, x, 2.0, "plain"))) == 36.0
    assert float(strategy.run(step, args=(w, x, 3.0, "plain"))) == 54.0  # a new number: fast
    assert len(full) == 1
    # A numpy array where a placed array was: the full path places it; same result.
    assert float(strategy.run(step, args=(np.ones(3, np.float32), x, 2.0, "plain"))) == 36.0
    # Another static value: the full path compiles the other branch.
    assert float(strategy.run(step, args=(w, x, 2.0, "negated"))) == -36.0
    # An int where a float was: the full path (a new signature).
    assert float(strategy.run(step, args=(w, x, 2, "plain"))) == 36.0
    assert len(full) == 4
    assert float(strategy.run(step, args=(w, x, 5, "plain"))) == 90.0  # the latest signature
    assert len(full) == 4
