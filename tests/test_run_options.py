"""RunOptions(donate_argnums=...): the step reuses the donated state's buffers, same results."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist


def _step(params, x):
    ctx = jaxdist.get_replica_context()
    g = ctx.all_reduce("SUM", jnp.sum(x, axis=0))
    return {"w": params["w"] - 0.1 * g}, ctx.all_reduce("SUM", jnp.sum(x))


@pytest.mark.parametrize("n", [1, 2])
def test_donated_state_is_consumed_and_results_match(devices, n):
    s = jaxdist.MirroredStrategy(jax.devices()[:n])
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    xd = next(iter(s.experimental_distribute_dataset([x])))
    with s.scope():
        kept = {"w": jnp.ones(3)}
        donated = {"w": jnp.ones(3)}
    want, _ = s.run(_step, args=(kept, xd))
    got, total = s.run(_step, args=(donated, xd), options=jaxdist.RunOptions(donate_argnums=0))
    np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(want["w"]))
    assert float(total) == float(x.sum())
    assert donated["w"].is_deleted()  # the new state was written into the old buffer
    assert not kept["w"].is_deleted()
    again, _ = s.run(_step, args=(got, xd), options=jaxdist.RunOptions(donate_argnums=(0,)))
    np.testing.assert_allclose(np.asarray(again["w"]), np.asarray(want["w"]) - 0.1 * x.sum(0))


def test_bad_donate_argnums_name_the_value():
    s = jaxdist.OneDeviceStrategy(jax.devices()[0])
    with pytest.raises(ValueError, match=r"names positions \[3\].*1 positional"):
        s.run(lambda a: a, args=(jnp.ones(2),), options=jaxdist.RunOptions(donate_argnums=3))
    with pytest.raises(ValueError, match="must be >= 0"):
        jaxdist.RunOptions(donate_argnums=-1)
    with pytest.raises(TypeError, match="jaxdist.RunOptions"):
        s.run(lambda a: a, args=(jnp.ones(2),), options={"donate_argnums": 0})
