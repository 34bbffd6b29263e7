"""``jaxdist.Checkpoint``, ``CheckpointManager`` and ``PreemptionCheckpointHandler`` in one
process (CPU; the custom-loop test needs 4 devices).

SIGTERM is sent to the test process itself (``os.kill(os.getpid(), SIGTERM)``) with an
``exit_fn`` that records instead of exiting; the fixture gives SIGTERM its default action back
(``preemption.uninstall``) after every test.
"""

from __future__ import annotations

import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from devutil import first_devices
from flax import nnx

import jaxdist
from jaxdist._src.distributed import preemption
from jaxdist._src.train.checkpoint import CheckpointMismatchError
from jaxdist._src.train.tracked_checkpoint import CheckpointError


@pytest.fixture(autouse=True)
def _fresh_watcher():
    preemption.uninstall()
    yield
    preemption.uninstall()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


class Stop(Exception):
    """What the tests' exit_fn raises instead of exiting the process."""


def recording_config(**kw) -> tuple[jaxdist.TerminationConfig, list[str]]:
    calls: list[str] = []

    def exit_fn():
        calls.append("exit")
        raise Stop()

    return jaxdist.TerminationConfig(exit_fn=exit_fn, grace_period=20, **kw), calls


def sigterm_at(at: int):
    """A step function that sends this process SIGTERM while running step ``at``."""
    def step(w, i):
        if i == at:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)  # the listener agrees within POLL_SECONDS
        return w + 1.0
    return step


# ---------------------------------------------------------------------- Checkpoint
class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.do = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.do(nnx.relu(self.l1(x))))


def _objects(seed: int):
    model = Net(nnx.Rngs(seed, dropout=seed + 1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    metric = nnx.metrics.Average()
    return model, optimizer, metric


def _leaves(*objs):
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype,
                                                                       jax.dtypes.prng_key)
                       else x)
            for o in objs for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(o)))]


def test_nnx_objects_are_restored_in_place_pytrees_and_scalars_into_attributes(tmp_path):
    model, optimizer, metric = _objects(0)
    rngs = nnx.Rngs(3)
    rngs()  # advance the count: restored too
    metric.update(values=jnp.array([1.0, 3.0]))
    holder = nnx.Variable(jnp.arange(3.0))
    ckpt = jaxdist.Checkpoint(model=model, optimizer=optimizer, metric=metric, rngs=rngs,
                              holder=holder, params={"w": jnp.ones(2)}, epoch=7, name="run")
    manager = jaxdist.CheckpointManager(ckpt, tmp_path / "ck", max_to_keep=2)
    paths = [manager.save() for _ in range(3)]
    assert [os.path.basename(p) for p in paths] == ["1", "2", "3"]
    assert manager.checkpoints == paths[1:]          # max_to_keep=2
    assert manager.latest_checkpoint == paths[-1] and ckpt.save_counter == 3

    model2, optimizer2, metric2 = _objects(5)
    rngs2, holder2 = nnx.Rngs(9), nnx.Variable(jnp.zeros(3))
    ckpt2 = jaxdist.Checkpoint(model=model2, optimizer=optimizer2, metric=metric2, rngs=rngs2,
                               holder=holder2, params={"w": jnp.zeros(2)}, epoch=0, name="x")
    manager2 = jaxdist.CheckpointManager(ckpt2, tmp_path / "ck", max_to_keep=2)
    assert manager2.restore_or_initialize() == paths[-1]
    assert ckpt2.model is model2 and ckpt2.optimizer is optimizer2   # in place
    for a, b in zip(_leaves(model, optimizer, metric, rngs), _leaves(model2, optimizer2,
                                                                       metric2, rngs2)):
        np.testing.assert_array_equal(a, b)
    assert float(metric2.compute()) == 2.0
    np.testing.assert_array_equal(holder2.get_value(), np.arange(3.0))
    np.testing.assert_array_equal(ckpt2.params["w"], np.ones(2))
    assert (ckpt2.epoch, ckpt2.name, ckpt2.save_counter) == (7, "run", 3)
    assert os.path.basename(manager2.save()) == "4"   # numbering goes on after a restore


def test_restore_or_initialize_without_a_checkpoint_keeps_the_initial_values(tmp_path):
    ckpt = jaxdist.Checkpoint(w=jnp.full(2, 5.0))
    assert jaxdist.CheckpointManager(ckpt, tmp_path / "empty", 1).restore_or_initialize() is None
    np.testing.assert_array_equal(ckpt.w, [5.0, 5.0])


def test_a_checkpoint_of_other_objects_is_refused_naming_them(tmp_path):
    manager = jaxdist.CheckpointManager(jaxdist.Checkpoint(w=jnp.ones(3)), tmp_path, 1)
    path = manager.save()
    with pytest.raises(CheckpointMismatchError, match=r"w has \(3,\) there and \(4,\) here"):
        jaxdist.Checkpoint(w=jnp.ones(4)).restore(path)
    with pytest.raises(CheckpointMismatchError, match="another Checkpoint"):
        jaxdist.Checkpoint(w=jnp.ones(3), v=jnp.ones(1)).restore(path)
    with pytest.raises(CheckpointError, match="expected a checkpoint written by "
                                              "jaxdist.CheckpointManager"):
        jaxdist.Checkpoint(w=jnp.ones(3)).restore(tmp_path)


def test_bad_objects_and_arguments_are_one_line_errors(tmp_path):
    class FakeKerasModel:
        pass
    FakeKerasModel.__module__ = "keras.src.models.model"
    with pytest.raises(CheckpointError, match=r"Checkpoint\(model=<FakeKerasModel>\): Keras "
                                              r"models .* jaxdist.keras.BackupAndRestore"):
        jaxdist.Checkpoint(model=FakeKerasModel())
    with pytest.raises(CheckpointError, match=r"Checkpoint\(f=...\): holds a value of type "
                                              r"function"):
        jaxdist.Checkpoint(f=lambda: 0)
    with pytest.raises(CheckpointError, match="'_x': names starting with '_'"):
        jaxdist.Checkpoint(_x=1)
    ckpt = jaxdist.Checkpoint(w=jnp.ones(1))
    with pytest.raises(AttributeError, match="counted by save"):
        ckpt.save_counter = 3
    with pytest.raises(CheckpointError, match=r"max_to_keep=0\): expected a positive integer"):
        jaxdist.CheckpointManager(ckpt, tmp_path, max_to_keep=0)
    with pytest.raises(CheckpointError, match="expected a jaxdist.Checkpoint"):
        jaxdist.CheckpointManager({"w": 1}, tmp_path, 1)
    blocked = tmp_path / "file"
    blocked.write_text("x")
    with pytest.raises(CheckpointError, match=f"{blocked}/ck' cannot be created"):
        jaxdist.CheckpointManager(ckpt, blocked / "ck", 1)
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(CheckpointError, match="is not writable"):
            jaxdist.CheckpointManager(ckpt, ro, 1)


# ---------------------------------------------------------------------- the handler
def test_sigterm_saves_the_agreed_step_and_a_new_handler_restores_total_run_calls(tmp_path):
    config, calls = recording_config()
    ckpt = jaxdist.Checkpoint(w=jnp.zeros(2))
    handler = jaxdist.PreemptionCheckpointHandler(None, ckpt, tmp_path, config)
    assert handler.total_run_calls == 0
    step, ran = sigterm_at(3), 0
    with pytest.raises(Stop):
        for i in range(handler.total_run_calls, 100):
            ckpt.w = handler.run(step, ckpt.w, i)
            ran += 1
    assert calls == ["exit"]
    assert ran == handler.total_run_calls >= 4   # the step in flight (3) finished, then stop
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL   # the watcher is done
    np.testing.assert_array_equal(ckpt.w, [ran, ran])

    ckpt2 = jaxdist.Checkpoint(w=jnp.zeros(2))
    handler2 = jaxdist.PreemptionCheckpointHandler(None, ckpt2, tmp_path)
    assert handler2.total_run_calls == ran                  # restored
    assert handler2.checkpoint_manager.checkpoints == [os.path.join(tmp_path, "1")]
    np.testing.assert_array_equal(ckpt2.w, [ran, ran])      # exactly the steps run
    handler2.close()


def test_default_exit_is_sys_exit_42(tmp_path):
    ckpt = jaxdist.Checkpoint(w=jnp.zeros(1))
    handler = jaxdist.PreemptionCheckpointHandler(None, ckpt, tmp_path,
                                                  jaxdist.TerminationConfig(grace_period=20))
    step = sigterm_at(0)
    with pytest.raises(SystemExit) as e:
        for i in range(10):
            ckpt.w = handler.run(step, ckpt.w, i)
    assert e.value.code == 42


def test_termination_watcher_fn_is_a_notice_and_save_fn_replaces_the_save(tmp_path):
    saved = []
    notice = {"now": False}
    config, calls = recording_config(termination_watcher_fn=lambda: notice["now"],
                                     save_fn=lambda: saved.append("save_fn"))
    ckpt = jaxdist.Checkpoint(w=jnp.zeros(1))
    handler = jaxdist.PreemptionCheckpointHandler(None, ckpt, tmp_path, config)
    with pytest.raises(Stop):
        for i in range(200):
            if i == 2:
                notice["now"] = True
            ckpt.w = handler.run(lambda w: (time.sleep(0.05), w + 1)[1], ckpt.w)
    assert saved == ["save_fn"] and calls == ["exit"]
    assert handler.checkpoint_manager.checkpoints == []     # save_fn saved instead


def test_exit_fn_that_returns_lets_one_process_train_on_and_answer_the_next_notice(tmp_path):
    exits = []
    config = jaxdist.TerminationConfig(exit_fn=lambda: exits.append("exit"), grace_period=20)
    ckpt = jaxdist.Checkpoint(w=jnp.zeros(1))
    handler = jaxdist.PreemptionCheckpointHandler(None, ckpt, tmp_path, config)

    def step(w, i):
        if i in (2, 10):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)
        return w + 1
    for i in range(20):
        ckpt.w = handler.run(step, ckpt.w, i)
    assert exits == ["exit", "exit"] and handler.total_run_calls == 20
    assert float(ckpt.w[0]) == 20.0
    runs = [jaxdist.Checkpoint(w=jnp.zeros(1)).restore(p) for p in
            handler.checkpoint_manager.checkpoints]
    assert len(runs) == 1 and 11 <= runs[0].checkpointed_runs <= 12   # max_to_keep=1
    handler.close()


def test_save_checkpoint_if_preempted_passes_the_checkpoint_number(tmp_path):
    config, calls = recording_config()
    ckpt = jaxdist.Checkpoint(w=jnp.zeros(1))
    handler = jaxdist.PreemptionCheckpointHandler(None, ckpt, tmp_path, config)
    step = sigterm_at(4)
    with pytest.raises(Stop):
        for i in range(100):
            handler.save_checkpoint_if_preempted(checkpoint_number=handler.total_run_calls)
            ckpt.w = step(ckpt.w, i)
    stopped = handler.total_run_calls
    assert stopped >= 5
    assert handler.checkpoint_manager.checkpoints == [os.path.join(tmp_path, str(stopped))]


def test_handler_argument_errors(tmp_path):
    ckpt = jaxdist.Checkpoint(w=jnp.zeros(1))
    with pytest.raises(CheckpointError, match="a checkpoint_dir must be passed as well"):
        jaxdist.PreemptionCheckpointHandler(None, ckpt)
    with pytest.raises(CheckpointError, match="expected a jaxdist.Checkpoint or a "
                                              "jaxdist.CheckpointManager"):
        jaxdist.PreemptionCheckpointHandler(None, {"w": 1}, tmp_path)
    with pytest.raises(TypeError, match="expected a jaxdist.TerminationConfig"):
        jaxdist.PreemptionCheckpointHandler(None, ckpt, tmp_path, termination_config=30)
    ps = jaxdist.cluster_resolver.SimpleClusterResolver(jaxdist.cluster_resolver.ClusterSpec(
        {"worker": ["localhost:1"], "ps": ["localhost:2"]}), task_type="worker", task_id=0)
    with pytest.raises(NotImplementedError, match="parameter servers"):
        jaxdist.PreemptionCheckpointHandler(ps, ckpt, tmp_path)


# ---------------------------------------------------------------------- a custom loop
STEPS, GLOBAL_BATCH = 12, 16


@nnx.jit
def train_step(model, optimizer, batch):
    def loss_fn(model):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def _batches(strategy):
    rng = np.random.RandomState(0)
    x = rng.randn(STEPS * GLOBAL_BATCH, 4).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    data = jaxdist.Dataset.from_tensor_slices({"x": x, "y": y}).batch(GLOBAL_BATCH)
    return list(strategy.experimental_distribute_dataset(data))


def _loop(tmp_path, sigterm_at_step=None):
    """TF's custom loop: objects under the scope, the handler, ``run`` per step. Returns
    (model, optimizer, steps run here, whether it stopped)."""
    strategy = jaxdist.MirroredStrategy(first_devices(4))
    with strategy.scope():
        model, optimizer, _ = _objects(0)
        ckpt = jaxdist.Checkpoint(model=model, optimizer=optimizer)
    config, _ = recording_config()
    handler = jaxdist.PreemptionCheckpointHandler(strategy.cluster_resolver, ckpt,
                                                  tmp_path / "ckpt", config)
    model.train()
    batches, ran = _batches(strategy), 0

    def distributed_step(batch, i):
        if i == sigterm_at_step:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)
        return strategy.run(train_step, args=(model, optimizer, batch))

    try:
        for i in range(handler.total_run_calls, STEPS):
            handler.run(distributed_step, batches[i], i)
            ran += 1
    except Stop:
        return model, optimizer, ran, True
    handler.close()
    return model, optimizer, ran, False


@pytest.mark.devices(4)
def test_mirrored_custom_loop_resumes_to_the_uninterrupted_result_bit_for_bit(tmp_path):
    full_model, full_opt, ran, stopped = _loop(tmp_path / "full")
    assert (ran, stopped) == (STEPS, False)
    preemption.uninstall()

    _, _, first, stopped = _loop(tmp_path / "cut", sigterm_at_step=4)
    assert stopped and 5 <= first < STEPS
    preemption.uninstall()
    manager = jaxdist.CheckpointManager(jaxdist.Checkpoint(), tmp_path / "cut" / "ckpt", 1)
    assert len(manager.checkpoints) == 1
    restored = manager.checkpoint.restore(manager.latest_checkpoint)
    assert restored.checkpointed_runs == first     # exactly the steps run

    model, optimizer, second, stopped = _loop(tmp_path / "cut")
    assert not stopped and first + second == STEPS    # resumed where it stopped
    assert int(optimizer.step[...]) == STEPS
    for a, b in zip(_leaves(full_model, full_opt), _leaves(model, optimizer)):
        np.testing.assert_array_equal(a, b)            # bit for bit
