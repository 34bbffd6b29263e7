"""Port of TensorFlow's failure-handling tests (tensorflow/python/distribute/failure_handling/):
``failure_handler_test.py`` (``PreemptionCheckpointTest``) and ``gce_failure_handler_test.py``
(``GceFailureHandlingTest``).

TF's inputs and expected values are kept: the ``Model`` with one variable ``v``, each step adding
1 on every replica with SUM aggregation (here ``v[...] += all_reduce("SUM", 1.0)`` in the replica
function), ``EPOCHS_TO_RUN`` x ``STEPS_PER_EPOCH`` steps, the final
``v == num_replicas_in_sync * EPOCHS_TO_RUN * STEPS_PER_EPOCH``, 4 workers in the multi-worker
cases, the checkpoint numbers TF finds after a restart and ``total_run_calls`` restored. The
multi-worker cases run 4 real processes (``jaxdist.testing.LocalCluster``; this file is the
worker program) and the local cases run in this process, as TF's do.

The spelling that changes: ``tf.train.Checkpoint(model=model)`` -> ``jaxdist.Checkpoint``;
TF's ``_make_checkpoint_manager`` (a temporary directory for non-chief workers) -> one
``jaxdist.CheckpointManager`` on every worker (only the chief writes); ``ckpt-N.index`` files ->
numbered checkpoint directories ``N``; ``_save_checkpoint_if_preempted`` -> the public
``save_checkpoint_if_preempted``; TF's multiprocessing ``Event`` s shared with the workers ->
files; the GCE maintenance-notice watcher (``gce_util.termination_watcher_function_gce``,
patched by TF's test) -> the same function passed as ``TerminationConfig.termination_watcher_fn``.

Where jaxdist differs, the expectation changes and says why:

* TF's ``grace_period`` > 0 trains through the grace period and saves a second checkpoint before
  it ends (TF expects checkpoint 2); jaxdist saves once, at the step no process started, and
  exits (checkpoint 1): ``grace_period`` is the deadline, and must be positive, so TF's
  ``grace_period=0`` ("save at once", jaxdist's only behaviour) is the default config here.
* The exit status is jaxdist's restart code 42 where TF's GCE platform config exits with 143.

TF's timings are changed so the notice lands while training runs: the preemption sender polls
every 0.05 s instead of 1 s, and each step sleeps ``STEP_SLEEP`` (``STEP_SLEEP_MW`` in a worker
task); TF's corner case "training finished before the notice" stays handled as TF handles it.

By default the multi-worker cases run a covering subset of TF's parameter grid (each input kind
and each API at least once across processes); ``JAXDIST_TF_FULL_GRID=1`` runs every combination.
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
import threading
import time

import pytest

CLUSTER_SIZE = 4
STEP_SLEEP = 0.01      # seconds per step in this process (SIGTERM to itself lands at once)
STEP_SLEEP_MW = 0.03   # per step in a worker task (the notice crosses processes)
FULL_GRID = os.environ.get("JAXDIST_TF_FULL_GRID") == "1"


# ---------------------------------------------------------------------- events
class FileEvent:
    """TF's ``multi_process_runner.manager().Event()`` across processes: a file."""

    def __init__(self, path: str):
        self.path = str(path)

    def set(self) -> None:
        open(self.path, "a").close()

    def is_set(self) -> bool:
        return os.path.exists(self.path)


def _checkpoint_numbers(checkpoint_dir: str) -> list[int]:
    """TF: ``re.search(r'.*ckpt-(\\d+).index', f)`` over ``gfile.ListDirectory``."""
    if not os.path.isdir(checkpoint_dir):
        return []
    return [int(f) for f in os.listdir(checkpoint_dir) if re.fullmatch(r"\d+", f)]


def _strategy(strategy_option: str):
    import jaxdist

    if strategy_option == "MS":
        return jaxdist.MirroredStrategy()
    if strategy_option == "OneDevice":
        return jaxdist.OneDeviceStrategy("/cpu:0")
    return jaxdist.MultiWorkerMirroredStrategy()   # CollectiveAllReduceStrategy


# ---------------------------------------------------------------------- TF's worker_fn
def worker_fn(checkpoint_dir, input_arg="checkpoint", strategy_option="MWMS",
              training_started_event=None, training_restarted=None, training_finished=None,
              termination_config=None, api_wrapping_train=True, epochs_to_run=8,
              steps_per_epoch=15, expect_on_restart="index_1", checkpoint_number=False,
              step_sleep=STEP_SLEEP):
    """TF's ``PreemptionCheckpointTest.worker_fn`` / ``GceFailureHandlingTest.worker_fn``."""
    import jax.numpy as jnp
    from flax import nnx

    import jaxdist

    strategy = _strategy(strategy_option)

    class Model(nnx.Module):
        def __init__(self):
            self.v = nnx.Variable(jnp.float32(0.0))   # ON_WRITE, aggregation SUM

    with strategy.scope():
        model = Model()
        fh_ckpt = jaxdist.Checkpoint(model=model)
        if input_arg == "checkpoint":
            checkpoint_or_manager = fh_ckpt
        else:
            checkpoint_or_manager = jaxdist.CheckpointManager(fh_ckpt, checkpoint_dir,
                                                              max_to_keep=1)
        preemption_handler = jaxdist.PreemptionCheckpointHandler(
            strategy.cluster_resolver, checkpoint_or_manager, checkpoint_dir,
            termination_config)

    # TF defines train_step (a tf.function) inside distributed_train_step; defined once here,
    # so strategy.run compiles it once.
    def train_step(model):
        ctx = jaxdist.get_replica_context()
        model.v[...] = model.v[...] + ctx.all_reduce("SUM", jnp.float32(1.0))

    def distributed_train_step(current_epoch, current_step):
        strategy.run(train_step, args=(model,))
        time.sleep(step_sleep)
        if current_step == steps_per_epoch - 1:
            print(f"epoch {current_epoch} finished", flush=True)

    print(f"Start training at {preemption_handler.total_run_calls}", flush=True)

    if training_restarted is not None and training_restarted.is_set() and \
            not training_finished.is_set():
        print("training restarted", flush=True)
        checkpoint_index = _checkpoint_numbers(checkpoint_dir)
        assert checkpoint_index, f"no checkpoint in {checkpoint_dir}"
        if expect_on_restart == "index_1":
            # TF: 2 with a grace period (a second save at its end); jaxdist saves once.
            assert max(checkpoint_index) == 1, checkpoint_index
        else:  # save_checkpoint_if_preempted(checkpoint_number=total_run_calls)
            assert max(checkpoint_index) == preemption_handler.total_run_calls, (
                checkpoint_index, preemption_handler.total_run_calls)

    for epoch in range(preemption_handler.total_run_calls // steps_per_epoch, epochs_to_run):
        for step in range(preemption_handler.total_run_calls % steps_per_epoch,
                          steps_per_epoch):
            if api_wrapping_train:
                preemption_handler.run(distributed_train_step, epoch, step)
            else:
                if checkpoint_number:
                    preemption_handler.save_checkpoint_if_preempted(
                        checkpoint_number=preemption_handler.total_run_calls)
                else:
                    preemption_handler.save_checkpoint_if_preempted()
                distributed_train_step(epoch, step)
        # TF: trigger the preemption at random epoch ends, surely near the end.
        trigger_it = epoch >= epochs_to_run - 2
        if training_started_event is not None and not training_started_event.is_set():
            if trigger_it or random.randrange(0, 9) > 6:
                print("Set preemption signal", flush=True)
                training_started_event.set()

    training_finished.set()
    print("Training finished.", flush=True)
    expected = strategy.num_replicas_in_sync * epochs_to_run * steps_per_epoch
    assert float(model.v[...]) == expected, (float(model.v[...]), expected)
    return preemption_handler


def gce_watcher(maintenance_event, frequent_send):
    """TF's ``mock_termination_watcher_function_gce``."""
    def watcher(*args, **kwargs):
        del args, kwargs
        if not frequent_send:
            time.sleep(1)
            if (not maintenance_event.is_set()) and (random.randrange(0, 7) == 5):
                maintenance_event.set()
                print("Termination notice available.", flush=True)
                return True
        elif frequent_send and not maintenance_event.is_set():
            print("Termination notice available.", flush=True)
            return True
        return False
    return watcher


# ---------------------------------------------------------------------- the worker program
def _worker_main(argv: list[str]) -> int:
    """``python test_tf_failure_handling.py worker KEY=VALUE ...``: ``worker_fn`` in a task."""
    import jaxdist

    kw = dict(a.split("=", 1) for a in argv)
    d = kw["dir"]
    events = {n: FileEvent(os.path.join(d, f"event_{n}")) for n in
              ("started", "restarted", "finished", "maintenance")}
    config_kw = {}
    if kw.get("grace_period"):
        config_kw["grace_period"] = float(kw["grace_period"])
    if kw.get("save_fn") == "1":
        config_kw["save_fn"] = lambda: print("Do nothing", flush=True)
    if kw.get("gce"):
        config_kw["termination_watcher_fn"] = gce_watcher(events["maintenance"],
                                                          kw["gce"] == "frequent")
    worker_fn(os.path.join(d, "fh_ckpt"), kw["input_arg"], "MWMS",
              events["started"] if kw.get("trigger") == "1" else None,
              events["restarted"], events["finished"],
              jaxdist.TerminationConfig(**config_kw), kw.get("api") == "1",
              int(kw["epochs"]), int(kw["steps"]), kw.get("expect", "index_1"),
              kw.get("checkpoint_number") == "1", STEP_SLEEP_MW)
    return 0


# ---------------------------------------------------------------------- pytest side
_SENDERS: list[threading.Thread] = []


@pytest.fixture(autouse=True)
def _sigterm_restored():
    from jaxdist._src.distributed import preemption

    preemption.uninstall()
    yield
    for t in _SENDERS:   # a SIGTERM still on its way is answered before SIGTERM is restored
        t.join(10)
    _SENDERS.clear()
    time.sleep(0.2)
    preemption.uninstall()


def _cluster_command(tmp_path, **kw):
    args = [f"{k}={v}" for k, v in kw.items()]
    return [sys.executable, os.path.abspath(__file__), "worker", f"dir={tmp_path}", *args]


def raise_if_not_all_exit(grace_period, c, max_wait=40):
    """TF's helper: every worker exits within max(grace_period + 15, MAX_WAIT_TIME)."""
    deadline = time.monotonic() + max(grace_period + 15, max_wait)
    for name in c.task_names:
        left = max(0.0, deadline - time.monotonic())
        code = c.tasks[name].wait(left)
        if code is None:
            raise RuntimeError("Waited long but at least one worker still exist. Considering "
                               "size of our model, this should not happen.\n" + c.describe())
    return {n: c.returncode(n) for n in c.task_names}


def _run_mw(tmp_path, wait_grace=0, **kw):
    """TF's multi-worker branch: start, preempt one worker, all exit, restart, join."""
    from jaxdist.testing import LocalCluster

    events = {n: FileEvent(tmp_path / f"event_{n}") for n in
              ("started", "restarted", "finished", "maintenance")}
    with LocalCluster(workers=CLUSTER_SIZE, devices_per_process=1) as c:
        c.start(_cluster_command(tmp_path, **kw))
        if True:  # TF: wait for training_started_event, then SIGTERM a random worker
            deadline = time.monotonic() + 120
            while not events["started"].is_set() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert events["started"].is_set(), c.describe()
            killed_worker = random.randrange(0, CLUSTER_SIZE)
            c.tasks[f"worker:{killed_worker}"].signal(signal.SIGTERM)
        codes = raise_if_not_all_exit(wait_grace, c, max_wait=120)
        if events["finished"].is_set():
            # TF's corner case: training ended before the notice. The workers exit 0; the one
            # that got SIGTERM after its loop (nothing left to save) ends as SIGTERM ends it.
            print("training ended before the notice (TF's corner case)")
            assert set(codes.values()) <= {0, -signal.SIGTERM, 128 + signal.SIGTERM}, \
                c.describe()
            return c.describe()
        assert set(codes.values()) == {42}, c.describe()   # preempted: restart code
        stops = set(re.findall(r"stopped before step (\d+)", c.describe()))
        assert len(stops) == 1, c.describe()              # one agreed step
        print(f"preempted at step {stops.pop()}")
        first = c.describe()
        events["restarted"].set()
        c.start(_cluster_command(tmp_path, **kw))
        codes = c.join(timeout=250)
        assert codes == {f"worker:{i}": 0 for i in range(CLUSTER_SIZE)}, c.describe()
        assert events["finished"].is_set()
        starts = [int(m) for m in re.findall(r"Start training at (\d+)", c.output("worker:0"))]
        assert starts and starts[-1] != 0, c.describe()   # no step repeated after restart
        return first + c.describe()


def _run_local(tmp_path, input_arg, strategy_option, termination_config, api_wrapping_train,
               send_sigterm, epochs_to_run=8, steps_per_epoch=15, expect="index_1",
               checkpoint_number=False, maintenance_event=None, expected_code=42):
    """TF's local branch: the worker in this process, SIGTERM to this process, SystemExit,
    the in-process restart."""
    checkpoint_dir = str(tmp_path / "fh_ckpt")
    training_started_event = threading.Event()
    training_restarted = threading.Event()
    training_finished = threading.Event()
    if send_sigterm:
        def sending_sigterm(training_started_event):
            while not training_started_event.is_set():
                time.sleep(0.05)
            training_started_event.set()
            os.kill(os.getpid(), signal.SIGTERM)

        sender = threading.Thread(target=sending_sigterm, args=(training_started_event,))
        _SENDERS.append(sender)
        sender.start()

    args = dict(input_arg=input_arg, strategy_option=strategy_option,
                training_started_event=training_started_event if send_sigterm else None,
                training_restarted=training_restarted, training_finished=training_finished,
                termination_config=termination_config, api_wrapping_train=api_wrapping_train,
                epochs_to_run=epochs_to_run, steps_per_epoch=steps_per_epoch,
                expect_on_restart=expect, checkpoint_number=checkpoint_number)
    caught_exit = False
    try:
        worker_fn(checkpoint_dir, **args)
    except SystemExit as exit_error:
        caught_exit = True
        assert exit_error.code == expected_code
    if send_sigterm:
        sender.join(10)
    preempted = (maintenance_event.is_set() if maintenance_event is not None
                 else True)
    if preempted and not training_finished.is_set():
        assert caught_exit
        training_restarted.set()
        worker_fn(checkpoint_dir, **args)
        assert training_finished.is_set()
    return caught_exit


def _grid(*cases, full=()):
    """The default cases, and the rest of TF's grid under JAXDIST_TF_FULL_GRID=1."""
    skip = pytest.mark.skipif(not FULL_GRID, reason="the rest of TF's multi-worker grid: "
                              "JAXDIST_TF_FULL_GRID=1 runs it (4 processes per case)")
    return [*cases, *(pytest.param(*c, marks=skip) for c in full)]


# ====================================================================== failure_handler_test
@pytest.mark.parametrize("input_arg", ["checkpoint", "manager"])
@pytest.mark.parametrize("api_wrapping_train", [True, False])
def test_preemption_checkpointing_local(tmp_path, input_arg, api_wrapping_train):
    import jaxdist

    _run_local(tmp_path, input_arg, "MWMS", jaxdist.TerminationConfig(), api_wrapping_train,
               send_sigterm=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("input_arg,api_wrapping_train", _grid(
    ("checkpoint", True), ("manager", False),
    full=[("checkpoint", False), ("manager", True)]))
def test_preemption_checkpointing_multi_worker(tmp_path, input_arg, api_wrapping_train):
    _run_mw(tmp_path, input_arg=input_arg, api=int(api_wrapping_train), trigger=1,
            epochs=8, steps=15)


@pytest.mark.skip(reason="TF's test_error_propagation: TF forwards an error raised on one "
                         "worker to the others (report_error_to_cluster), which re-raise it; "
                         "a Python exception on a jaxdist worker ends that process, and the "
                         "others end with PeerLostError naming it "
                         "(tests/test_multi_worker_processes.py)")
def test_error_propagation():
    pass


@pytest.mark.parametrize("input_arg", ["checkpoint", "manager"])
def test_grace_period_continue_training_local(tmp_path, input_arg):
    import jaxdist

    # TF: grace_period=1 "because single worker trains super fast".
    _run_local(tmp_path, input_arg, "MWMS", jaxdist.TerminationConfig(grace_period=1), True,
               send_sigterm=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("input_arg", _grid("checkpoint", full=[("manager",)]))
def test_grace_period_continue_training_multi_worker(tmp_path, input_arg):
    _run_mw(tmp_path, wait_grace=5, grace_period=5, input_arg=input_arg, api=1, trigger=1,
            epochs=8, steps=15)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_passed_in_save_fn(tmp_path):
    from jaxdist.testing import LocalCluster

    checkpoint_dir = tmp_path / "fh_ckpt"
    os.makedirs(checkpoint_dir)
    started = FileEvent(tmp_path / "event_started")
    with LocalCluster(workers=CLUSTER_SIZE, devices_per_process=1) as c:
        c.start(_cluster_command(tmp_path, input_arg="checkpoint", api=1, trigger=1, save_fn=1,
                                 epochs=8, steps=15))
        deadline = time.monotonic() + 120
        while not started.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        killed_worker = random.randrange(0, CLUSTER_SIZE)
        c.tasks[f"worker:{killed_worker}"].signal(signal.SIGTERM)
        codes = raise_if_not_all_exit(5, c, max_wait=120)
        if not FileEvent(tmp_path / "event_finished").is_set():
            assert set(codes.values()) == {42}, c.describe()
            assert "Do nothing" in c.output("worker:0"), c.describe()   # the chief's save_fn
    # By default a checkpoint is saved (the other tests); the passed-in save_fn skips it.
    assert _checkpoint_numbers(str(checkpoint_dir)) == []


# ====================================================================== gce_failure_handler_test
GCE_EPOCHS, GCE_STEPS = 5, 6
STRATEGY_OPTIONS = ["MS", "OneDevice", "MWMS_local"]


@pytest.mark.parametrize("input_arg", ["checkpoint", "manager"])
@pytest.mark.parametrize("strategy_option", STRATEGY_OPTIONS)
def test_gce_basic_run_local(tmp_path, input_arg, strategy_option):
    import jaxdist

    maintenance_event = threading.Event()
    # TF's default worker config on GCE: grace_period=0 -> jaxdist's default (see module doc).
    config = jaxdist.TerminationConfig(
        termination_watcher_fn=gce_watcher(maintenance_event, False))
    _run_local(tmp_path, input_arg, strategy_option, config, True, send_sigterm=False,
               epochs_to_run=GCE_EPOCHS, steps_per_epoch=GCE_STEPS,
               maintenance_event=maintenance_event)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("input_arg", _grid("manager", full=[("checkpoint",)]))
def test_gce_basic_run_multi_worker(tmp_path, input_arg):
    from jaxdist.testing import LocalCluster

    finished = FileEvent(tmp_path / "event_finished")
    restarted = FileEvent(tmp_path / "event_restarted")
    command = _cluster_command(tmp_path, input_arg=input_arg, api=1, gce="random",
                               epochs=GCE_EPOCHS, steps=GCE_STEPS)
    with LocalCluster(workers=CLUSTER_SIZE, devices_per_process=1) as c:
        c.start(command)
        codes = raise_if_not_all_exit(0, c, max_wait=120)
        if not finished.is_set():
            assert set(codes.values()) == {42}, c.describe()
            restarted.set()
            c.start(command)
            codes = c.join(timeout=250)
        assert set(codes.values()) == {0}, c.describe()
        assert finished.is_set()


@pytest.mark.parametrize("grace_period", [0, 7])
@pytest.mark.parametrize("input_arg", ["checkpoint", "manager"])
@pytest.mark.parametrize("strategy_option", STRATEGY_OPTIONS)
@pytest.mark.parametrize("api_wrapping_train", [True, False])
def test_gce_multiple_workers_preempted_consecutively_local(
        tmp_path, grace_period, input_arg, strategy_option, api_wrapping_train):
    import jaxdist

    maintenance_event = threading.Event()
    config = jaxdist.TerminationConfig(
        termination_watcher_fn=gce_watcher(maintenance_event, True),
        grace_period=grace_period or None)
    _run_local(tmp_path, input_arg, strategy_option, config, api_wrapping_train,
               send_sigterm=False, epochs_to_run=GCE_EPOCHS, steps_per_epoch=GCE_STEPS,
               maintenance_event=maintenance_event,
               expect="index_1" if api_wrapping_train else "total_run_calls",
               checkpoint_number=not api_wrapping_train)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("grace_period,input_arg,api_wrapping_train", _grid(
    (7, "checkpoint", False),
    full=[(g, i, a) for g in (0, 7) for i in ("checkpoint", "manager") for a in (True, False)
          if (g, i, a) != (7, "checkpoint", False)]))
def test_gce_multiple_workers_preempted_consecutively_multi_worker(
        tmp_path, grace_period, input_arg, api_wrapping_train):
    from jaxdist.testing import LocalCluster

    maintenance = FileEvent(tmp_path / "event_maintenance")
    restarted = FileEvent(tmp_path / "event_restarted")
    kw = dict(input_arg=input_arg, api=int(api_wrapping_train), gce="frequent",
              epochs=GCE_EPOCHS, steps=GCE_STEPS,
              expect="index_1" if api_wrapping_train else "total_run_calls",
              checkpoint_number=int(not api_wrapping_train))
    if grace_period:
        kw["grace_period"] = grace_period
    with LocalCluster(workers=CLUSTER_SIZE, devices_per_process=1) as c:
        c.start(_cluster_command(tmp_path, **kw))
        codes = raise_if_not_all_exit(grace_period, c, max_wait=120)
        assert set(codes.values()) == {42}, c.describe()
        found_message = sum(len(re.findall(r"Termination notice available", c.output(n)))
                            for n in c.task_names)
        assert found_message >= 1   # TF: 'has received termination notice'
        maintenance.set()
        restarted.set()
        c.start(_cluster_command(tmp_path, **kw))
        codes = c.join(timeout=250)
        assert set(codes.values()) == {0}, c.describe()
        assert FileEvent(tmp_path / "event_finished").is_set()


@pytest.mark.parametrize("input_arg", ["checkpoint", "manager"])
@pytest.mark.parametrize("strategy_option", [*STRATEGY_OPTIONS, "MWMS_multi_worker"])
@pytest.mark.parametrize("api_wrapping_train", [True, False])
def test_gce_grace_period_continue_training(tmp_path, input_arg, strategy_option,
                                            api_wrapping_train):
    # TF's test compares strategy_option with 'multi_worker', which no case is: every case,
    # MWMS_multi_worker included, runs TF's local branch (in this process).
    import jaxdist

    maintenance_event = threading.Event()
    config = jaxdist.TerminationConfig(
        termination_watcher_fn=gce_watcher(maintenance_event, False), grace_period=7)
    _run_local(tmp_path, input_arg,
               "MWMS_local" if strategy_option == "MWMS_multi_worker" else strategy_option,
               config, api_wrapping_train, send_sigterm=False, epochs_to_run=GCE_EPOCHS,
               steps_per_epoch=GCE_STEPS, maintenance_event=maintenance_event,
               expect="index_1" if api_wrapping_train else "total_run_calls",
               checkpoint_number=not api_wrapping_train)


@pytest.mark.skip(reason="GCE platform detection and its metadata server "
                         "(gce_util.detect_platform, request_compute_metadata), the GCE "
                         "default exit code 143 and TF's watcher threads' names "
                         "(PeerTerminationWatcher, WorkerTerminationSignalWatcher) have no "
                         "jaxdist counterpart: a platform's notice is a termination_watcher_fn")
def test_gce_platform_detection_and_watcher_threads():
    pass


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    sys.exit(_worker_main(sys.argv[2:]))
