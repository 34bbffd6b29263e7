"""Steps in flight are bounded: 500 collective steps dispatched without waiting finish."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdist
from jaxdist._src.strategies.inflight import StepThrottle


@pytest.mark.devices(8)
def test_500_steps_without_waiting_on_8_devices():
    s = jaxdist.MirroredStrategy()
    assert s.num_replicas_in_sync == 8
    tx = optax.sgd(0.01)
    with s.scope():
        params = {"w": jnp.zeros((16, 4)), "b": jnp.zeros(4)}
        opt_state = tx.init(params)
    rng = np.random.RandomState(0)
    x, y = rng.randn(64, 16).astype(np.float32), rng.randn(64, 4).astype(np.float32)
    xd, yd = next(iter(s.experimental_distribute_dataset([(x, y)])))

    def step(params, opt_state, xb, yb):
        ctx = jaxdist.get_replica_context()

        def loss_fn(p):
            return jaxdist.compute_average_loss(jnp.sum((xb @ p["w"] + p["b"] - yb) ** 2, -1))

        loss, grads = jax.value_and_grad(loss_fn)(ctx.local(params))
        grads = ctx.all_reduce("SUM", grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ctx.all_reduce("SUM", loss)

    start = time.monotonic()
    losses = []
    for _ in range(500):  # the loop never waits; the strategy bounds steps in flight
        params, opt_state, loss = s.run(step, args=(params, opt_state, xd, yd))
        losses.append(loss)
    jax.block_until_ready(losses)
    assert time.monotonic() - start < 120
    assert float(losses[-1]) < float(losses[0])


def test_throttle_bounds_pending():
    t = StepThrottle(2)
    waited = []

    class Fake:
        pass

    for i in range(5):
        t.before_dispatch()
        assert len(t._pending) < 2
        t.after_dispatch([jnp.float32(i)])
        waited.append(len(t._pending))
    assert max(waited) == 2
    t.wait_all()
    assert not t._pending
    with pytest.raises(ValueError, match="max_in_flight must be >= 1, got 0"):
        StepThrottle(0)


@pytest.mark.devices(2)
def test_max_steps_in_flight_is_configurable():
    s = jaxdist.MirroredStrategy(jax.devices()[:2])
    assert s.extended.experimental_max_steps_in_flight == 2
    s.extended.experimental_max_steps_in_flight = 4
    assert s.extended._throttle.max_in_flight == 4


def test_watched_steps_bound_in_flight_and_hand_back_errors():
    from jaxdist._src.strategies.watched_steps import StepNotFinished, WatchedSteps

    overruns = []
    steps = WatchedSteps(2, 5.0, on_overrun=lambda elapsed: overruns.append(elapsed) or True)
    for i in range(6):
        steps.before_dispatch()
        assert len(steps._pending) < 2
        steps.after_dispatch({"loss": jnp.float32(i)})
    steps.wait_all()
    assert not steps._pending and not overruns

    class Failing:
        """An output whose wait fails, as a collective with a dead peer does."""

        def is_deleted(self):
            return False

        def block_until_ready(self):
            raise RuntimeError("gloo: connection reset by peer")

    from jaxdist._src.strategies import watched_steps

    step = watched_steps._Step([Failing()])
    with steps._lock:
        steps._pending.append(step)
    steps._queue.put(step)
    with pytest.raises(RuntimeError, match="connection reset"):
        steps.wait_all()

    never = watched_steps._Step([])  # never handed to the waiter: it cannot finish
    short = WatchedSteps(1, 0.2, on_overrun=lambda elapsed: True)
    short._pending.append(never)
    with pytest.raises(StepNotFinished, match="did not finish within 0.2 s"):
        short.before_dispatch()


def test_watched_steps_skip_outputs_donated_to_a_later_step():
    from jaxdist._src.strategies.watched_steps import WatchedSteps

    f = jax.jit(lambda p: p + 1, donate_argnums=0)
    steps = WatchedSteps(2, 5.0, on_overrun=lambda elapsed: True)
    p = jnp.zeros(1000)
    for _ in range(20):  # each output is donated to the next step, maybe before it is waited on
        steps.before_dispatch()
        p = f(p)
        steps.after_dispatch(p)
    steps.wait_all()
    assert float(p[0]) == 20



def test_wait_skips_an_output_whose_wait_says_it_was_donated():
    """JAX 0.11 can refuse to wait on a buffer donated to a later step before is_deleted()
    says so ("BlockHostUntilReady() called on deleted or donated buffer"): the throttle skips
    it (the later step consumes it); any other failure still raises."""
    from jaxdist._src.strategies import inflight

    class Donated:
        def is_deleted(self):
            return False

        def block_until_ready(self):
            raise RuntimeError("INVALID_ARGUMENT: BlockHostUntilReady() called on deleted or "
                               "donated buffer")

    class Lost(Donated):
        def block_until_ready(self):
            raise RuntimeError("the device was lost")

    inflight._wait_each([Donated(), Donated()])
    with pytest.raises(RuntimeError, match="device was lost"):
        inflight._wait_each([Donated(), Lost()])
