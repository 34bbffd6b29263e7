"""The parameter service in-process: ps-side optimizers, versions/staleness, rows, checkpoints."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from jaxdist._src.ps import optimizers as O
from jaxdist._src.ps.checkpoints import write_checkpoint_pointer
from jaxdist._src.ps.errors import PSInvalidArgumentError, PSNotFoundError
from jaxdist._src.ps.service import ParameterService


def _shards_vs_whole(spec, ref_tx, split, steps, seed):
    """Trains two row shards of one leaf on a ps and the whole leaf with ``ref_tx``."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(6, 3)).astype(np.float32)
    svc = ParameterService("ps:0")
    svc.create({"a": w[:split], "b": w[split:]},
               {k: {"optimizer": spec.to_json()} for k in "ab"})
    ref, state = jnp.asarray(w), ref_tx.init(jnp.asarray(w))
    for step in range(steps):
        g = rng.normal(size=w.shape).astype(np.float32)
        svc.push({"a": g[:split], "b": g[split:]}, {"a": step, "b": step})
        upd, state = ref_tx.update(jnp.asarray(g), state, ref)
        ref = optax.apply_updates(ref, upd)
    got = svc.pull(["a", "b"])
    np.testing.assert_allclose(np.concatenate([got["a"][0], got["b"][0]]), ref, rtol=1e-5,
                               atol=1e-6)
    assert got["a"][1] == steps


@pytest.mark.parametrize("spec", [O.sgd(0.1), O.momentum(0.1, 0.9), O.adam(0.01),
                                  O.adagrad(0.1), O.rmsprop(0.01), O.adamw(0.01), O.clip(0.5)],
                         ids=lambda s: s.name)
def test_elementwise_optimizer_per_shard_matches_whole(spec):
    """Applying the optimizer to two row shards equals applying optax to the whole leaf."""
    _shards_vs_whole(spec, spec.build(), split=4, steps=5, seed=0)


@pytest.mark.parametrize("spec,ref_tx", [
    (O.adam(O.warmup_cosine_decay_schedule(0.0, 0.05, warmup_steps=2, decay_steps=5)),
     optax.adam(optax.warmup_cosine_decay_schedule(0.0, 0.05, 2, 5))),
    (O.momentum(O.exponential_decay(0.1, 1, 0.5, staircase=True), 0.9),
     optax.sgd(optax.exponential_decay(0.1, 1, 0.5, staircase=True), momentum=0.9)),
    (O.sgd(O.linear_schedule(0.2, 0.0, 4)), optax.sgd(optax.linear_schedule(0.2, 0.0, 4))),
], ids=["warmup_cosine_adam", "exponential_momentum", "linear_sgd"])
def test_learning_rate_schedules_run_on_the_ps(spec, ref_tx):
    """The ps evaluates the schedule on each shard's update count, as optax does."""
    spec = O.OptimizerSpec.from_json(spec.to_json())  # as it reaches the ps
    _shards_vs_whole(spec, ref_tx, split=2, steps=6, seed=1)


def test_a_schedule_that_drops_to_zero_stops_the_updates():
    spec = O.sgd(O.piecewise_constant_schedule(0.1, {2: 0.0}))
    svc = ParameterService("ps:0")
    svc.create({"w": np.zeros(3, np.float32)}, {"w": {"optimizer": spec.to_json()}})
    values = []
    for step in range(4):
        svc.push({"w": np.ones(3, np.float32)}, {"w": step})
        values.append(svc.pull(["w"])["w"][0].copy())
    np.testing.assert_allclose(values[0], -0.1)
    np.testing.assert_allclose(values[1], -0.2)
    np.testing.assert_allclose(values[3], -0.2)  # learning rate 0 from update 2 on


def test_schedule_specs_are_checked_and_travel_as_json():
    spec = O.chain(O.clip_by_global_norm(1.0), O.adamw(O.cosine_decay_schedule(1e-3, 100)))
    assert O.OptimizerSpec.from_json(spec.to_json()) == spec
    assert spec.ps_part().kwargs["learning_rate"](100) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="function the ps cannot rebuild"):
        O.adam(optax.cosine_decay_schedule(1e-3, 100))
    with pytest.raises(ValueError, match="'cosine_decay_schedule' cannot be built"):
        O.cosine_decay_schedule(1e-3, decay_steps=-5)
    with pytest.raises(ValueError, match="schedule 'onecycle' is not one a ps can rebuild"):
        O.ScheduleSpec("onecycle", {})


def test_optimizer_split_rules():
    spec = O.chain(O.clip_by_global_norm(1.0), O.adam(1e-3))
    worker, ps = spec.split()
    assert worker.name == "clip_by_global_norm" and ps.name == "adam"
    with pytest.raises(ValueError, match="'clip_by_global_norm' follows 'sgd'"):
        O.chain(O.sgd(0.1), O.clip_by_global_norm(1.0))
    with pytest.raises(ValueError, match="raw optax GradientTransformation"):
        O.as_spec(optax.adam(1e-3))
    with pytest.raises(ValueError, match="'lamb' cannot run on a parameter server"):
        O.OptimizerSpec("lamb", {"learning_rate": 0.1})
    assert O.OptimizerSpec.from_json(spec.to_json()) == spec


def test_staleness_and_versions_recorded():
    svc = ParameterService("ps:0")
    svc.create({"w": np.zeros(2, np.float32)}, {"w": {"optimizer": O.sgd(1.0).to_json()}})
    assert svc.push({"w": np.ones(2, np.float32)}, {"w": 0})["w"] == {"version": 1,
                                                                       "staleness": 0}
    # two workers computed from version 1; the second push is one version stale
    svc.push({"w": np.ones(2, np.float32)}, {"w": 1}, worker=0)
    r = svc.push({"w": np.ones(2, np.float32)}, {"w": 1}, worker=1)
    assert r["w"] == {"version": 3, "staleness": 1}
    stats = svc.status()["variables"]["w"]
    assert stats["staleness_max"] == 1 and stats["pushes"] == 3
    np.testing.assert_array_equal(svc.pull(["w"])["w"][0], [-3, -3])


def test_errors_name_the_variable():
    svc = ParameterService("ps:3")
    svc.create({"w": np.zeros((2, 2), np.float32)}, {})
    with pytest.raises(PSNotFoundError, match="ps:3 holds no variable 'nope'"):
        svc.pull(["nope"])
    with pytest.raises(PSInvalidArgumentError, match=r"gradient for 'w' has shape \(3,\)"):
        svc.push({"w": np.zeros(3, np.float32)}, {})
    with pytest.raises(PSInvalidArgumentError, match="exists with shape"):
        svc.create({"w": np.zeros((3,), np.float32)}, {})
    with pytest.raises(PSInvalidArgumentError, match="row id 5 out of range"):
        svc.pull_rows("w", np.array([5]))


def test_push_rows_sums_duplicates_rowwise_adagrad():
    table = np.random.default_rng(0).normal(size=(10, 3)).astype(np.float32)
    spec = O.adagrad(0.5)
    svc = ParameterService("ps:0")
    svc.create({"t": table}, {"t": {"optimizer": spec.to_json(), "kind": "rows"}})
    ids = np.array([2, 7, 2, 2])
    g = np.arange(12, dtype=np.float32).reshape(4, 3)
    svc.push_rows("t", ids, g, version=0)
    dense_g = np.zeros_like(table)
    np.add.at(dense_g, ids, g)
    tx = spec.build()
    upd, _ = tx.update(jnp.asarray(dense_g), tx.init(jnp.asarray(table)), jnp.asarray(table))
    ref = np.asarray(optax.apply_updates(jnp.asarray(table), upd))
    got = svc.pull(["t"])["t"][0]
    for r in range(10):
        np.testing.assert_allclose(got[r], ref[r], rtol=1e-6, err_msg=f"row {r}")


def test_checkpoint_round_trip(tmp_path):
    svc = ParameterService("ps:1")
    svc.create({"w": np.ones(3, np.float32), "h": np.ones(2, ml_dtypes.bfloat16)},
               {"w": {"optimizer": O.adam(0.1).to_json()}})
    svc.push({"w": np.ones(3, np.float32)}, {"w": 0})
    svc.set_marker("ready/m")
    svc.save(str(tmp_path), step=7)
    write_checkpoint_pointer(str(tmp_path), 7)
    before = svc.pull(["w", "h"])
    svc.push({"w": np.ones(3, np.float32)}, {"w": 1})
    restored = ParameterService("ps:1", checkpoint_dir=str(tmp_path))
    assert restored.restored_step == 7 and "ready/m" in restored.status()["markers"]
    after = restored.pull(["w", "h"])
    for k in ("w", "h"):
        assert after[k][1] == before[k][1]
        assert after[k][0].tobytes() == before[k][0].tobytes()
    # optimizer state came back too: the next update equals the original service's
    a = restored.push({"w": np.ones(3, np.float32)}, {"w": 1})
    np.testing.assert_allclose(restored.pull(["w"])["w"][0], svc.pull(["w"])["w"][0])
    assert a["w"]["version"] == 2
    assert not list(tmp_path.glob("ps-1/*.tmp-*"))


def test_ssp_clock_bounds_the_gap():
    svc = ParameterService("ps:0")
    assert svc.clock(0, 1, 2, 1, 0.0)["ok"]          # worker 1 at 0: gap 1 <= 1
    assert not svc.clock(0, 2, 2, 1, 0.05)["ok"]     # gap 2 > 1: waits, times out
    svc.clock(1, 1, 2, 1, 0.0)
    assert svc.clock(0, 2, 2, 1, 0.0)["ok"]
    svc.clock(1, float("inf"), 2, None, 0.0)         # worker 1 done
    assert svc.clock(0, 50, 2, 1, 0.0)["ok"]
    jax.block_until_ready(jnp.zeros(()))


def test_save_keeps_the_newest_checkpoints_and_the_last_complete_one(tmp_path):
    import os

    svc = ParameterService("ps:1")
    svc.create({"w": np.zeros(2, np.float32)}, {})
    task_dir = tmp_path / "ps-1"
    for step in (100, 200, 300):
        svc.save(str(tmp_path), step, keep=2)
        write_checkpoint_pointer(str(tmp_path), step)   # every ps saved: the chief marks it
    assert sorted(os.listdir(task_dir)) == ["ckpt-200", "ckpt-300", "latest"]
    # A save another ps never completed: the pointer still names 300, which must survive.
    (task_dir / "ckpt-350.tmp-deadbeef").mkdir()          # an interrupted earlier save
    svc.save(str(tmp_path), 400, keep=1)
    assert sorted(os.listdir(task_dir)) == ["ckpt-300", "ckpt-400", "latest"]
    svc.push({"w": np.ones(2, np.float32)}, {"w": 0})
    fresh = ParameterService("ps:1", checkpoint_dir=str(tmp_path))   # restores the pointer's
    assert fresh.restored_step == 300
    write_checkpoint_pointer(str(tmp_path), 400)
    svc.save(str(tmp_path), 500, keep=1)
    assert sorted(os.listdir(task_dir)) == ["ckpt-400", "ckpt-500", "latest"]
    svc.save(str(tmp_path), 600)                                     # keep=None: keeps all
    assert sorted(os.listdir(task_dir))[:3] == ["ckpt-400", "ckpt-500", "ckpt-600"]
    with pytest.raises(PSInvalidArgumentError, match="keep must be >= 1"):
        svc.save(str(tmp_path), 700, keep=0)


def test_many_learning_rate_changes_keep_the_compiled_update_cache_bounded():
    # Each new rate is a new optimizer spec; a job that changes it often must not grow the ps
    # without end. An evicted spec compiles again on its next use with the same numbers.
    from jaxdist._src.ps import service as S

    svc = ParameterService("ps:0")
    svc.create({"v": np.ones((4,), np.float32)}, {"v": {"optimizer": O.sgd(0.1).to_json()}})
    for i in range(S._TX_CACHE_SIZE + 10):
        svc.learning_rate("", 0.001 * (i + 1))
        svc.push({"v": np.ones((4,), np.float32)}, {"v": 0})
        assert len(S._TX_CACHE) <= S._TX_CACHE_SIZE
    total = sum(0.001 * (i + 1) for i in range(S._TX_CACHE_SIZE + 10))
    np.testing.assert_allclose(svc.pull(["v"])["v"][0], 1.0 - total, rtol=1e-5)
    first = json.dumps(O.sgd(0.001).to_json(), sort_keys=True)
    assert first not in S._TX_CACHE  # the least recently used went first


@pytest.mark.parametrize("dtype", [np.float64, np.int64])
def test_optimizer_variable_jax_would_narrow_is_refused(dtype):
    # Without jax_enable_x64 the jitted update ran in 32 bits and the float64 variable came
    # back as float32 after the first push (its 1e-10 updates lost): now refused at creation.
    if jax.config.jax_enable_x64:
        pytest.skip("with x64 the ps holds 64-bit optimizer variables")
    svc = ParameterService("ps:0")
    with pytest.raises(PSInvalidArgumentError, match=r"'w'.*JAX_ENABLE_X64=1"):
        svc.create({"w": np.ones(3, dtype)}, {"w": {"optimizer": O.sgd(0.1).to_json()}})
    # float32 with an optimizer and float64 without one (host add, exact) still work
    svc.create({"f": np.ones(3, np.float32)}, {"f": {"optimizer": O.sgd(0.1).to_json()}})
    svc.create({"d": np.ones(3, np.float64)}, {"d": {}})
    svc.push({"d": np.full(3, 1e-10)}, {"d": 0})
    value = svc.pull(["d"])["d"][0]
    assert value.dtype == np.float64 and value[0] == 1 + 1e-10
