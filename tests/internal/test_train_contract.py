"""The Trainer's contracts: hooks take a TrainState and return the new one; the fit loop's
parts (epoch plan, step runner, reporter) alone; the constructor's config dataclasses;
``batch_size`` at ``fit``; a wrong argument names the fix."""

import ast
import pathlib

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist
from jaxdist._src.job.data import make_synthetic
from jaxdist._src.job.models import MLP
from jaxdist._src.train import hook_registry, loop
from jaxdist._src.train.hooks import SyncHook
from jaxdist.train import (
    CheckpointConfig,
    LoggingConfig,
    NaNLossError,
    TrainConfig,
    Trainer,
    TrainState,
)

SRC = pathlib.Path(jaxdist.__file__).parent / "_src" / "train"


@pytest.fixture(scope="module")
def data():
    train, _ = make_synthetic(num_examples=128, num_features=6, num_classes=3,
                              validation_split=0.0)
    return train.x, train.y


def _model(seed=0):
    return MLP(6, [8], 3, rngs=nnx.Rngs(seed))


def _one_device():
    return jaxdist.OneDeviceStrategy(jax.devices()[0])


def _leaves(trainer):
    return [np.asarray(a) for a in jax.tree.leaves(jax.device_get(trainer.params))]


# ---------------------------------------------------------------------- the hooks' contract
def test_no_hook_assigns_an_attribute_of_anything_but_itself():
    """Hooks return the new TrainState; an attribute assignment in a hook module is only ever
    to the hook itself (``self.x = ...``), never to the trainer or the context."""
    files = [SRC / "hooks.py", *sorted((SRC / "parameter_server").glob("*.py"))]
    bad = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and not (
                            isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                        bad.append(f"{path.name}:{sub.lineno}: {ast.unparse(sub)}")
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "trainer":
                bad.append(f"{path.name}:{node.lineno}: reads {ast.unparse(node)}")
    assert bad == []


class _Mirrored(jaxdist.MirroredStrategy):
    """A strategy class of its own, to register a hook for."""


class _ZeroBiasHook(SyncHook):
    """Runs the synchronous step, then returns a new state with every bias set to zero."""

    calls = 0

    def train_step(self, ctx, state, x, y, num_steps, w=None, chunk=0):
        new, stats = super().train_step(ctx, state, x, y, num_steps, w, chunk)
        assert new is not state and new.step == state.step   # the Trainer advances the step
        type(self).calls += 1
        params = jax.tree_util.tree_map_with_path(
            lambda path, a: a * 0 if "bias" in jax.tree_util.keystr(path) else a, new.params)
        return new.replace(params=params), stats


@pytest.mark.devices(2)
def test_a_hook_returns_the_new_state_and_the_trainer_keeps_it(data):
    hook_registry.register_trainer_hook(_Mirrored, _ZeroBiasHook)
    try:
        strategy = _Mirrored(jax.devices()[:2])
        with strategy.scope():
            t = Trainer(_model(), optax.sgd(0.1), strategy=strategy,
                        config=TrainConfig(global_batch_size=16),
                        logging=LoggingConfig(progress_bar="never"))
        assert type(t._hook) is _ZeroBiasHook
        before = t.train_state
        t.fit(data, steps=3, verbose=0)
    finally:
        hook_registry._HOOKS.pop(_Mirrored, None)
    assert _ZeroBiasHook.calls == 3
    state = t.train_state
    assert isinstance(state, TrainState) and state is not before
    assert (state.step, state.epoch, state.step_in_epoch) == (3, 0, 3)
    biases = [a for p, a in jax.tree_util.tree_leaves_with_path(jax.device_get(state.params))
              if "bias" in jax.tree_util.keystr(p)]
    assert biases and all(not np.any(b) for b in biases)
    assert t.params is state.params        # the Trainer's attributes are views of the state
    with pytest.raises(AttributeError):    # frozen: a hook cannot change it in place
        state.step = 7


# ---------------------------------------------------------------------- the fit loop's parts
def test_plan_epoch_cuts_full_chunks_then_single_steps_and_groups_blocks():
    chunks, groups = loop.plan_epoch(1, 9, 3, blocks=True, block_sizes={3: 2, 1: 4})
    assert chunks == [(1, 3), (4, 3), (7, 1), (8, 1)]
    assert groups == [[(1, 3), (4, 3)], [(7, 1), (8, 1)]]
    chunks, groups = loop.plan_epoch(0, 4, 2, blocks=False, block_sizes={2: 8, 1: 8})
    assert groups == [[(0, 2)], [(2, 2)]]
    assert loop.plan_epoch(5, 5, 2, blocks=True, block_sizes={2: 1, 1: 1}) == ([], [])
    steps = list(loop.epoch_steps([[(0, 2), (2, 2)], [(4, 1)]], iter(["a", "b"])))
    assert steps == [(0, (0, 2), "a"), (1, (2, 2), "a"), (0, (4, 1), "b")]


class _CountingHook:
    """A hook that adds the number of steps to the parameters (no devices involved)."""

    def train_step(self, ctx, state, x, y, num_steps, w=None, chunk=0):
        self.chunk = chunk
        return state.replace(params=state.params + num_steps), {"loss": np.ones(num_steps)}


def test_step_runner_advances_the_position_and_rolls_the_epoch_over():
    hook = _CountingHook()
    runner = loop.StepRunner(hook, ctx=None, steps_per_epoch=4, blocks=True)
    state = TrainState(params=0, rest=None, opt_state=None)
    state, stats = runner.run(state, None, None, None, first=0, num_steps=3, chunk=1)
    assert (state.params, state.step, state.epoch, state.step_in_epoch) == (3, 3, 0, 3)
    assert hook.chunk == 1 and list(stats["loss"]) == [1, 1, 1]
    state, _ = runner.run(state, None, None, None, first=3, num_steps=1, chunk=0)
    assert (state.step, state.epoch, state.step_in_epoch) == (4, 1, 0)
    runner.blocks = False                  # without input blocks the chunk is always 0
    runner.run(state, None, None, None, first=0, num_steps=1, chunk=5)
    assert hook.chunk == 0


class _Callbacks:
    callbacks: list = []

    def overrides(self, name):
        return False


def test_reporter_summarizes_and_stops_at_the_first_nan_step():
    logged = []

    class Logger:
        def write(self, event, step, **values):
            logged.append((event, step, values))
            return {"event": event, "step": step, **values}

    history = type("H", (), {"records": [], "history": {}})()
    reporter = loop.FitReporter(Logger(), history, _Callbacks(), batch_size=4, accuracy=True,
                                metric_results=lambda sums: {}, learning_rate=lambda: 0.5,
                                halt_on_nan=True, checkpoint_dir="/ckpt")
    good = {"loss": np.array([1.0, 3.0]), "correct": np.array([4, 2]),
            "weight": np.array([4.0, 4.0])}
    reporter.record(good, TrainState(None, None, None, step=2))
    reporter.log_train(TrainState(None, None, None, step=2, epoch=0))
    (event, step, values), = logged
    assert (event, step, values["loss"], values["accuracy"]) == ("train", 2, 2.0, 0.75)
    assert values["learning_rate"] == 0.5
    bad = {"loss": np.array([0.5, np.nan]), "correct": np.zeros(2), "weight": np.ones(2)}
    reporter.record(bad, TrainState(None, None, None, step=4), last_checkpoint=2)
    with pytest.raises(NaNLossError, match="at step 4 .*last good checkpoint is step 2 in "
                                           "/ckpt") as e:
        reporter.check_nan(last_checkpoint=2)
    assert (e.value.step, e.value.last_checkpoint) == (4, 2)


# ---------------------------------------------------------------------- the constructor
def test_config_dataclasses_and_flat_keywords_train_the_same(data, tmp_path):
    one = _one_device()
    with one.scope():
        a = Trainer(_model(), optax.adam(1e-2), strategy=one,
                    config=TrainConfig(global_batch_size=16, steps_per_execution=2, seed=3),
                    checkpoint=CheckpointConfig(dir=str(tmp_path / "a"), every_steps=2),
                    logging=LoggingConfig(progress_bar="never"))
        b = Trainer(_model(), optax.adam(1e-2), strategy=one, global_batch_size=16,
                    steps_per_execution=2, seed=3, checkpoint_dir=str(tmp_path / "b"),
                    checkpoint_every_steps=2, progress_bar="never")
    ha, hb = (t.fit(data, epochs=1, verbose=0) for t in (a, b))
    assert ha.history["loss"] == hb.history["loss"]
    for x, y in zip(_leaves(a), _leaves(b)):
        np.testing.assert_array_equal(x, y)
    assert a.checkpoint_every_steps == 2 and a.last_checkpoint == 8


def test_a_wrong_argument_is_a_type_error_naming_the_fix():
    one = _one_device()
    with one.scope():
        with pytest.raises(TypeError, match="checkpoint_directory.*did you mean checkpoint_dir"
                                            r"=.*CheckpointConfig\(dir=\.\.\.\)"):
            Trainer(_model(), optax.sgd(0.1), checkpoint_directory="/tmp/x")
        with pytest.raises(TypeError, match=r"log_dir='x' and logging=LoggingConfig\(\.\.\.\); "
                                            "set dir= in the LoggingConfig"):
            Trainer(_model(), optax.sgd(0.1), log_dir="x", logging=LoggingConfig())
        with pytest.raises(TypeError, match="config=.... takes a jaxdist.train.TrainConfig, "
                                            "got CheckpointConfig"):
            Trainer(_model(), optax.sgd(0.1), config=CheckpointConfig())


# ---------------------------------------------------------------------- batch_size at fit
@pytest.mark.devices(2)  # the refused batch size is one that does not divide across 2 replicas
def test_batch_size_at_fit_equals_global_batch_size_at_construction(data):
    strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
    with strategy.scope():
        a = Trainer(_model(), optax.adam(1e-2), strategy=strategy, global_batch_size=16,
                    progress_bar="never")
        b = Trainer(_model(), optax.adam(1e-2), strategy=strategy, progress_bar="never")
    assert b.global_batch_size is None
    ha = a.fit(data, epochs=1, verbose=0)
    hb = b.fit(data, epochs=1, verbose=0, batch_size=16)
    assert b.global_batch_size == 16
    np.testing.assert_allclose(ha.history["loss"], hb.history["loss"], rtol=1e-6)
    for x, y in zip(_leaves(a), _leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-6)
    with pytest.raises(ValueError, match="global_batch_size=15 does not divide across the 2"):
        b.fit(data, steps=1, verbose=0, batch_size=15)


def test_an_already_batched_dataset_needs_no_batch_size(data):
    x, y = data
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 128, 16)]
    one = _one_device()
    with one.scope():
        a = Trainer(_model(), optax.adam(1e-2), strategy=one, global_batch_size=16,
                    progress_bar="never", shuffle=False)
        b = Trainer(_model(), optax.adam(1e-2), strategy=one, progress_bar="never",
                    shuffle=False)
    ha = a.fit(iter(batches), steps_per_epoch=8, verbose=0)
    hb = b.fit(iter(batches), steps_per_epoch=8, verbose=0)
    assert b.global_batch_size == 16
    np.testing.assert_allclose(ha.history["loss"], hb.history["loss"], rtol=1e-6)
    # arrays with no batch size anywhere: Keras' 32
    one = _one_device()
    with one.scope():
        c = Trainer(_model(), optax.adam(1e-2), strategy=one, progress_bar="never")
    c.fit(data, steps=1, verbose=0)
    assert c.global_batch_size == 32
