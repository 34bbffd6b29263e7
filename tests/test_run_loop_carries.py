"""Loops whose carry starts from a constant and becomes per-replica, through strategy.run.

``lax.scan`` / ``fori_loop`` / ``while_loop`` carries started from ``jnp.zeros`` (flax's
``nn.RNN`` and ``nnx.RNN`` start their cells' carries so) are identical on every replica before
the loop and per-replica after one step. shard_map's type check refuses such a carry unless the
user casts it (``jax.lax.pcast(..., to="varying")``); pmap does not type it. jaxdist types it
as per-replica from the start, so the user writes nothing new and gets one device's numbers:
bit for bit for the element-wise loops here; to 1e-6 where a matmul over a batch of another
size may round differently (the flax cells), and 1e-5 for gradients summed over replicas.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from devutil import first_devices
from flax import nnx

import jaxdist
from jaxdist import PerReplica

pytestmark = pytest.mark.devices(4)

N, B, T, F, H = 4, 32, 5, 3, 8  # replicas, global batch, steps, features, hidden units


@pytest.fixture(scope="module")
def strategy():
    return jaxdist.MirroredStrategy(first_devices(N))


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(B, T, F)).astype(np.float32), rng.normal(size=(B,)).astype(np.float32)


def _split(strategy, x):
    per = x.shape[0] // N
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: x[ctx.replica_id_in_sync_group * per:(ctx.replica_id_in_sync_group + 1) * per])


def _rows(strategy, out):
    assert isinstance(out, PerReplica), type(out)
    return np.concatenate([np.asarray(v) for v in strategy.experimental_local_results(out)])


def _scan_sum(x):
    def body(c, xt):  # x: [rows, T, F]; the carry starts replica-invariant
        c = jnp.tanh(c + xt)
        return c, c
    c, ys = jax.lax.scan(body, jnp.zeros(x.shape[::2]), jnp.swapaxes(x, 0, 1))
    return c, jnp.swapaxes(ys, 0, 1)


def _fori(x):
    return jax.lax.fori_loop(0, T, lambda t, c: c * 0.5 + x[:, t], jnp.zeros(x.shape[::2]))


def _fori_unrolled_as_while(x):  # a traced bound: fori_loop becomes a while_loop
    upper = jnp.asarray(T) + 0 * jnp.sum(x, dtype=jnp.int32)
    return jax.lax.fori_loop(0, upper, lambda t, c: c * 0.5 + x[:, t], jnp.zeros(x.shape[::2]))


def _while(x):
    def body(state):
        t, c = state
        return t + 1, c * 0.5 + x[:, t]
    return jax.lax.while_loop(lambda s: s[0] < T, body, (0, jnp.zeros(x.shape[::2])))[1]


@pytest.mark.parametrize("fn", [_scan_sum, _fori, _fori_unrolled_as_while, _while],
                         ids=["scan", "fori_loop", "fori_loop_traced_bound", "while_loop"])
def test_lax_loops_from_a_constant_carry_equal_one_device(strategy, data, fn):
    x, _ = data
    out = strategy.run(fn, args=(_split(strategy, x),))
    want = jax.jit(fn)(x)
    for got, w in zip(jax.tree.leaves(out, is_leaf=lambda v: isinstance(v, PerReplica)),
                      jax.tree.leaves(want)):
        np.testing.assert_array_equal(_rows(strategy, got), np.asarray(w))  # bit for bit


def test_an_invariant_carry_stays_one_replicated_array(strategy, data):
    """Only what the body makes per-replica changes type: a counter carried beside a
    per-replica sum comes back as one replicated array, the sum as a PerReplica."""
    x, _ = data

    def fn(x):
        def body(state, xt):
            n, c = state
            return (n + 1.0, c + xt), ()
        (n, c), _ = jax.lax.scan(body, (jnp.zeros(()), jnp.zeros(x.shape[::2])),
                                 jnp.swapaxes(x, 0, 1))
        return n, c

    n, c = strategy.run(fn, args=(_split(strategy, x),))
    assert not isinstance(n, PerReplica) and float(n) == T
    np.testing.assert_allclose(_rows(strategy, c), x.sum(axis=1), rtol=1e-6)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_flax_linen_rnn_forward_and_gradient_equal_one_device(strategy, data, cell):
    x, y = data
    make = {"lstm": nn.LSTMCell, "gru": nn.GRUCell}[cell]

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.RNN(make(H))(x)  # the cell's carry starts from zeros
            return nn.Dense(1)(h[:, -1])[:, 0]

    model = Model()
    params = model.init(jax.random.key(0), x[:2])

    def loss_fn(p, xb, yb):
        per_example = (model.apply(p, xb) - yb) ** 2
        return jaxdist.compute_average_loss(per_example, global_batch_size=B)

    def step(p, xb, yb):
        return model.apply(p, xb), jax.grad(loss_fn)(p, xb, yb)

    with strategy.scope():
        placed = strategy.place(params)
    preds, grads = strategy.run(step, args=(placed, _split(strategy, x), _split(strategy, y)))
    want_preds, want_grads = jax.jit(step)(params, x, y)
    np.testing.assert_allclose(_rows(strategy, preds), want_preds, rtol=1e-6, atol=1e-6)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        assert not isinstance(g, PerReplica)  # summed over replicas by jax.grad, as always
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_flax_nnx_rnn_equals_one_device(strategy, data):
    x, _ = data
    model = nnx.RNN(nnx.LSTMCell(F, H, rngs=nnx.Rngs(0)))

    def fn(m, xb):
        return m(xb)

    out = strategy.run(fn, args=(model, _split(strategy, x)))
    want = fn(model, x)
    np.testing.assert_allclose(_rows(strategy, out), np.asarray(want), rtol=1e-6, atol=1e-6)


def _delay_line(x):  # c becomes per-replica only once b is, b only once a is
    def body(carry, xt):
        a, b, c = carry
        return (jnp.tanh(a + xt), a * 2.0, b + 1.0), c
    z = jnp.zeros(x.shape[0])
    (a, b, c), ys = jax.lax.scan(body, (z, z, z), jnp.swapaxes(x[..., 0], 0, 1))
    return a, b, c, jnp.swapaxes(ys, 0, 1)


def _while_delay_line(x):
    def body(state):
        t, a, b = state
        return t + 1, a * 0.5 + x[:, t, 0], a
    z = jnp.zeros(x.shape[0])
    return jax.lax.while_loop(lambda s: s[0] < T, body, (0, z, z))[1:]


def _cond_in_fori(x):  # the carry varies in one branch of a lax.cond only
    def body(t, c):
        return jax.lax.cond(t % 2 == 1, lambda: c + x[:, t], lambda: c * 0.5)
    return jax.lax.fori_loop(0, T, body, jnp.zeros(x.shape[::2]))


def _switch_delay_line(x):
    def body(t, carry):
        a, b = carry
        return jax.lax.switch(t % 3, [lambda: (a + x[:, t], a), lambda: (a, b * 0.5),
                                      lambda: (a * 0.5, b)])
    z = jnp.zeros(x.shape[::2])
    return jax.lax.fori_loop(0, T, body, (z, z))


def _nested_delay_lines(x):
    def outer(carry, xt):
        a, b = carry

        def inner(c, _):
            e, f = c
            return (e + xt, e), None
        (_, f), _ = jax.lax.scan(inner, (jnp.zeros_like(a), jnp.zeros_like(a)), None, length=2)
        return (a + f, a), None
    z = jnp.zeros(x.shape[::2])
    return jax.lax.scan(outer, (z, z), jnp.swapaxes(x, 0, 1))[0]


@pytest.mark.parametrize("fn", [_delay_line, _while_delay_line, _cond_in_fori,
                                _switch_delay_line, _nested_delay_lines],
                         ids=["scan_delay_line", "while_delay_line", "cond_branch",
                              "switch_delay_line", "nested_scans"])
def test_carries_made_per_replica_through_another_carry_or_one_branch_equal_one_device(
        strategy, data, fn):
    """JAX traces a loop body twice at most; a carry that becomes per-replica only through
    another carry, or in one branch of a ``cond``, needs more: jaxdist traces until nothing
    changes, and joins the branches' types, and the numbers are one device's bit for bit."""
    x, _ = data
    out = strategy.run(fn, args=(_split(strategy, x),))
    want = jax.jit(fn)(x)
    got = jax.tree.leaves(out, is_leaf=lambda v: isinstance(v, PerReplica))
    assert len(got) == len(jax.tree.leaves(want))
    for g, w in zip(got, jax.tree.leaves(want)):
        np.testing.assert_array_equal(_rows(strategy, g), np.asarray(w))


def test_a_counter_beside_a_delay_line_stays_one_replicated_array(strategy, data):
    x, _ = data

    def fn(x):
        def body(state, xt):
            n, a, b = state
            return (n + 1.0, a + xt, a), ()
        z = jnp.zeros(x.shape[::2])
        return jax.lax.scan(body, (jnp.zeros(()), z, z), jnp.swapaxes(x, 0, 1))[0]

    n, a, b = strategy.run(fn, args=(_split(strategy, x),))
    assert not isinstance(n, PerReplica) and float(n) == T
    np.testing.assert_allclose(_rows(strategy, b), x[:, :-1].sum(axis=1), rtol=1e-6)


def test_branches_that_differ_in_more_than_the_replica_axis_get_jaxs_error(strategy, data):
    x, _ = data

    def fn(x):
        return jax.lax.cond(jnp.sum(x) > 0, lambda: x[:, 0], lambda: x[:, 0, :2])

    with pytest.raises(TypeError, match="branches must have equal output types"):
        strategy.run(fn, args=(_split(strategy, x),))
