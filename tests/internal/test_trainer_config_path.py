"""The Trainer's config: its path from ``python -m jaxdist.train`` and who may change it.

* The config's path: a subprocess runs the CLI's ``main`` on a small synchronous job under a
  tracer. A *room* is a module file under ``jaxdist/``; the path enters a room when a function
  defined there is called with a piece of the config as an argument (the loaded config, one of
  its sections, a ``TrainConfig``/``CheckpointConfig``/``LoggingConfig``/``TerminationConfig``)
  or when code there reads a field of a config group (a property reads where it is defined).
  Consecutive entries of one room are one visit. The path may return to a room it already left
  at most ``MAX_RETURNS`` times (issue 36), and the synchronous job calls nothing in
  ``jaxdist/_src/ps`` (its learning-rate schedule comes from ``train/learning_rate.py``).
* Callbacks change no Trainer attribute but the two Keras ones (``stop_training``,
  ``learning_rate``, each one property); ``BackupAndRestore`` returns a new
  ``CheckpointConfig`` (``dataclasses.replace``) that ``fit`` hands to
  ``Trainer.replace_checkpoint_config``; the config groups are frozen and the option
  attributes read from them; ``train_state`` is the one state setter (the side-car evaluator
  uses it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist
from jaxdist._src.train import callbacks as C
from jaxdist._src.train.evaluator import SidecarEvaluator
from jaxdist._src.train.options import CheckpointConfig
from jaxdist._src.train.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_RETURNS = 4

# Runs in a fresh interpreter: argv[1] is the CLI's arguments (JSON); prints one RESULT line.
_TRACER = r'''
import dataclasses, json, os, sys, threading
import jaxdist
from jaxdist._src.distributed.termination import TerminationConfig
from jaxdist._src.train import options as O

ROOT = os.path.dirname(os.path.abspath(jaxdist.__file__)) + os.sep
PS = os.path.join(ROOT, "_src", "ps") + os.sep
GROUPS = (O.TrainConfig, O.CheckpointConfig, O.LoggingConfig)
TYPES = GROUPS + (TerminationConfig,)
MAIN = threading.get_ident()
roots, path, ps_calls = set(), [], set()

def enter(filename, what):
    room = os.path.relpath(filename, ROOT)
    if not path or path[-1][0] != room:
        path.append((room, what))

def is_config(v, depth=0):
    if id(v) in roots or isinstance(v, TYPES):
        return True
    return depth == 0 and isinstance(v, dict) and any(is_config(x, 1) for x in list(v.values()))

def profile(frame, event, arg):
    code = frame.f_code
    if not code.co_filename.startswith(ROOT):
        return
    if event == "return" and code.co_name == "load_config" and isinstance(arg, dict):
        roots.add(id(arg))
        roots.update(id(v) for v in arg.values() if isinstance(v, (dict, list)))
    if event != "call":
        return
    if code.co_filename.startswith(PS):
        ps_calls.add(os.path.relpath(code.co_filename, ROOT) + ":" + code.co_name)
    n = (code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 4)
         + bool(code.co_flags & 8))
    local = frame.f_locals
    if any(is_config(local.get(name)) for name in code.co_varnames[:n]
           if name not in ("self", "cls")):
        enter(code.co_filename, "call " + code.co_name)

for cls in GROUPS:
    fields = frozenset(f.name for f in dataclasses.fields(cls))

    def getattribute(self, name, _fields=fields, _get=object.__getattribute__):
        if name in _fields and threading.get_ident() == MAIN:
            f = sys._getframe(1)
            if f.f_code.co_filename.startswith(ROOT):
                enter(f.f_code.co_filename, "read " + name + " in " + f.f_code.co_name)
        return _get(self, name)

    cls.__getattribute__ = getattribute

from jaxdist._src.job.cli import main
sys.setprofile(profile)
try:
    rc = main(json.loads(sys.argv[1]))
finally:
    sys.setprofile(None)
ps_modules = sorted(m for m in sys.modules if m.startswith(
    ("jaxdist._src.ps", "jaxdist._src.coordinator", "jaxdist._src.job.parameter_server")))
print("RESULT " + json.dumps({"rc": rc, "path": path, "ps_calls": sorted(ps_calls),
                              "ps_modules": ps_modules}))
'''


def returns(path: list[str]) -> list[int]:
    """The indices of ``path`` (rooms, one entry per visit) that enter a room already left."""
    seen: set[str] = set()
    out = []
    for i, room in enumerate(path):
        if room in seen:
            out.append(i)
        seen.add(room)
    return out


def test_returns_counts_the_visits_to_a_room_already_left():
    assert returns(["a", "b", "c"]) == []
    assert returns(["a", "b", "a", "c", "b", "a"]) == [2, 4, 5]
    # The path the issue describes (trainer.py 6 times, loop.py 4 times) fails the bound.
    bad = ["job.py", "trainer.py", "loop.py"] * 4 + ["trainer.py", "trainer.py"]
    assert len(returns([r for i, r in enumerate(bad) if i == 0 or bad[i - 1] != r])) \
        > MAX_RETURNS


def _traced_cli(tmp_path, *overrides: str) -> dict:
    args = ["--config", os.path.join(REPO, "configs", "default.yaml"),
            "--set", 'strategy.devices=["/cpu:0"]', "--set", "data.name=synthetic",
            "--set", "data.num_examples=640", "--set", "data.num_features=8",
            "--set", "data.num_classes=4", "--set", "train.epochs=2",
            "--set", f"logging.dir={tmp_path / 'runs'}", "--set", "logging.tensorboard=false",
            "--set", "logging.progress_bar=never",
            "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--set", "checkpoint.every_steps=4"]
    for o in overrides:
        args += ["--set", o]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [REPO, *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-c", _TRACER, json.dumps(args)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout[-2000:], proc.stderr[-4000:])
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["rc"] == 0, proc.stderr[-4000:]
    return result


def test_the_cli_config_path_returns_at_most_4_times_and_never_calls_ps(tmp_path):
    result = _traced_cli(tmp_path, "optimizer.schedule=cosine", "optimizer.decay_steps=40")
    rooms = [room for room, _ in result["path"]]
    again = returns(rooms)
    shown = "\n".join(f"{room:40s} {what}{'   <- again' if i in again else ''}"
                      for i, (room, what) in enumerate(result["path"]))
    assert len(again) <= MAX_RETURNS, f"{len(again)} returns to a room already left:\n{shown}"
    # the whole way is traced: from the job down to the Trainer and its fit loop
    assert rooms[0] == os.path.join("_src", "job", "job.py")
    for room in ("trainer.py", "options.py", "learning_rate.py", "checkpoint_wiring.py"):
        assert os.path.join("_src", "train", room) in rooms, shown
    assert result["ps_calls"] == [], f"the synchronous job called ps/: {result['ps_calls']}"
    assert result["ps_modules"] == [], f"the synchronous job imported {result['ps_modules']}"


# ---------------------------------------------------------------------- who changes the config
class _RecordingTrainer(Trainer):
    """Records ``(module file, attribute)`` of every attribute assignment made from outside
    the Trainer's own methods."""

    assigned: list

    def __setattr__(self, name, value):
        caller = sys._getframe(1).f_code.co_filename
        self.__dict__.setdefault("assigned", []).append((os.path.basename(caller), name))
        super().__setattr__(name, value)


def _trainer(cls=Trainer, **kw):
    kw.setdefault("progress_bar", "never")
    kw.setdefault("log_every_steps", 1000)
    strategy = jaxdist.OneDeviceStrategy(jax.devices()[0])
    with strategy.scope():
        return cls(nnx.Linear(4, 3, rngs=nnx.Rngs(0)),
                   optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
                   strategy=strategy, global_batch_size=16, **kw)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32)


def test_callbacks_assign_only_the_keras_properties(tmp_path):
    t = _trainer(_RecordingTrainer)
    before = t.checkpoint_config
    backup = str(tmp_path / "backup")
    x, y = _data()
    t.fit((x, y), epochs=4, validation_data=(x, y), verbose=0, callbacks=[
        C.BackupAndRestore(backup, save_freq=2, delete_checkpoint=False),
        C.ReduceLROnPlateau(monitor="loss", patience=0, factor=0.5, min_delta=10.0),
        C.EarlyStopping(monitor="loss", patience=0, min_delta=10.0),
        C.ModelCheckpoint(str(tmp_path / "best"), monitor="val_loss"),
        C.CSVLogger(str(tmp_path / "log.csv")), C.TerminateOnNaN()])
    by_callbacks = {name for where, name in t.assigned if where == "callbacks.py"}
    assert by_callbacks == {"learning_rate", "stop_training"}, t.assigned
    for name in by_callbacks:   # Keras' names, each one property of the Trainer
        assert isinstance(getattr(Trainer, name), property)
    assert t.stop_training and t.epoch < 4              # EarlyStopping stopped fit
    assert t.learning_rate == pytest.approx(0.05)       # ReduceLROnPlateau halved it once
    # BackupAndRestore's new checkpoint options replaced the group; the old one is unchanged
    assert t.checkpoint_config is not before and before.dir is None
    assert t.checkpoint_config == dataclasses.replace(before, dir=backup, resume=True,
                                                      every_steps=2)
    assert os.listdir(backup)


def test_backup_and_restore_returns_a_new_checkpoint_config():
    cb = C.BackupAndRestore("backup")
    old = CheckpointConfig(keep=5)
    new = cb.checkpoint_config(old)
    assert (new.dir, new.resume, new.keep, new.every_steps) == ("backup", True, 5, 2 ** 62)
    assert old == CheckpointConfig(keep=5)
    with pytest.raises(ValueError, match=r"BackupAndRestore\('backup'\) and the trainer's "
                                         r"checkpoint_dir='elsewhere' disagree"):
        cb.checkpoint_config(CheckpointConfig(dir="elsewhere"))


def test_the_config_groups_are_frozen_and_the_options_read_from_them():
    t = _trainer(checkpoint_dir="ckpt", keep_checkpoints=2)
    assert (t.checkpoint_dir, t.keep_checkpoints, t.steps_per_execution) == ("ckpt", 2, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.checkpoint_config.dir = "other"
    with pytest.raises(AttributeError, match=r"checkpoint_dir is read from "
                                             r"trainer.checkpoint_config.dir .*'other'.*"
                                             r"replace_checkpoint_config"):
        t.checkpoint_dir = "other"
    t.replace_checkpoint_config(dataclasses.replace(t.checkpoint_config, dir="other"))
    assert t.checkpoint_dir == "other" and t.context.checkpoint_dir == "other"
    with pytest.raises(TypeError, match="takes a jaxdist.train.CheckpointConfig, got dict"):
        t.replace_checkpoint_config({"dir": "x"})
    # the global batch size is the TrainConfig's, replaced when fit takes another
    assert t.config.global_batch_size == t.global_batch_size == 16
    x, y = _data()
    t.replace_checkpoint_config(dataclasses.replace(t.checkpoint_config, dir=None))
    t.fit((x, y), steps=1, batch_size=32, verbose=0)
    assert t.config.global_batch_size == 32


def test_train_state_is_the_one_state_setter():
    t = _trainer()
    with pytest.raises(AttributeError, match=r"params is a field of trainer.train_state .*"
                                             r"train_state.replace\(params=...\)"):
        t.params = t.params
    state = t.train_state.replace(step=5)
    t.train_state = state
    assert t.step == 5 and t.train_state is state
    with pytest.raises(TypeError, match="train_state must be a TrainState, got dict"):
        t.train_state = {"params": None}


def test_stop_training_is_one_property_reset_by_every_fit():
    t = _trainer()
    x, y = _data()
    stop = C.LambdaCallback(on_train_batch_end=lambda batch, logs: setattr(
        t, "stop_training", True))
    t.fit((x, y), epochs=3, verbose=0, callbacks=[stop])
    assert t.stop_training and t.step == 1 and not t.stop_training_by_error
    t.fit((x, y), epochs=3, verbose=0)    # a new fit starts with stop_training False
    assert not t.stop_training and t.epoch == 3
    with pytest.raises(AttributeError):
        t.stop_training_by_error = True   # read only: fit sets it


class _OneCheckpoint:
    """A reader with one checkpoint, step 7 (the state the trainer already has)."""

    def latest_step(self):
        return 7

    def all_steps(self):
        return [7]

    def is_final(self, step):
        return True

    def restore(self, step, like):
        return like, {"epoch": 1}

    def close(self):
        pass


def test_the_sidecar_evaluator_sets_the_state_through_train_state(tmp_path):
    t = _trainer(_RecordingTrainer)
    x, y = _data()
    t.assigned.clear()
    records = SidecarEvaluator(t, (x, y), str(tmp_path), reader=_OneCheckpoint(),
                               tensorboard=False).start()
    assert [r["step"] for r in records] == [7]
    assert {name for where, name in t.assigned if where == "evaluator.py"} == {"train_state"}
