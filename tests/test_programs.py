"""The corpus of real programs (``tests/programs/``) on 4 devices against 1 device.

Each program is someone else's published training program ported to jaxdist (its header
names the source and lists every edit beyond API renames). Its ``main(strategy)`` runs once
under ``MirroredStrategy`` over 4 local devices and once without a strategy (the default
strategy: the original single-device program), over the same global batches. Final weights,
losses and metrics must agree to 1e-5: each array by the norm of its difference
(``|a - b| <= 1e-5 |b| + 1e-6 sqrt(size)``: elementwise relative error is meaningless for the
many weights near zero, e.g. a bias that BatchNorm cancels, whose value is rounding noise),
each scalar to 1e-5 relative, unless a program's ``LOOSER`` entry states why it needs more.

A program that fails today because of a known, open jaxdist limitation is marked
``xfail(strict=True)`` with that limitation as the reason, so it reports XPASS (a failure)
the day the fix lands and the mark must go.

The multi-process programs (marked ``slow``) run as their tutorials run them:
TF's multi-worker Keras tutorial as each task of ``python -m jaxdist.launch --workers 2
--devices-per-process 2``; the parameter-server tutorial's functions scheduled by a
``ClusterCoordinator`` in this process onto a worker task with 4 CPU devices, with 2 ps tasks.

The in-process tests need 4 local devices (tests/conftest.py forces 8 CPU devices) and are
skipped with fewer; the multi-process ones force their tasks' CPU devices themselves.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")

from devutil import xla_flags

import jaxdist  # noqa: E402

DEVICES = 4
HERE = os.path.dirname(os.path.abspath(__file__))
RTOL, ATOL = 1e-5, 1e-6   # ATOL: per element (scaled by sqrt(size) for a norm)

# name -> how it is compared where 1e-5 on every value is not the bar, and why.
LOOSER: dict[str, dict] = {
    "flax_mnist_example": dict(
        rtol=5e-3,
        why="float32 rounding is amplified to ~1e-3 here: the gradients of the biases before "
            "BatchNorm are differences of nearly equal terms, and SGD at lr 0.1 with momentum "
            "0.9 feeds them back. Scaling the input images by 1 + 2**-22 moves the 1-device "
            "result as far (conv1's bias by 2.3e-3, batch_norm1's by 6.4e-4, the kernels by "
            "1e-5..4e-5, relative norms) as 2, 4 or 8 devices do, and the 4-device result is "
            "within 7e-6 of that perturbed 1-device run; 4 devices only sum in another order."),
    "flax_mnist_tutorial": dict(
        rtol=5e-3, drop=("conv2/bias", "batch_norm2/mean"),
        why="AdamW divides each gradient by its running RMS, so a parameter whose gradient is "
            "zero up to rounding takes full-size steps in a direction set by rounding, and 4 "
            "devices sum each gradient in another order than 1 device. conv2's bias is such a "
            "parameter (batch_norm2 subtracts the batch mean, cancelling it in training): it is "
            "left out, and so is batch_norm2's running mean, which accumulates it. Through that "
            "mean it reaches the eval losses: 4 devices move them by up to 1.8e-3 (relative), "
            "and so does rounding alone (a 2**-22 relative change of the learning rate moves "
            "the 1-device test losses by up to 1.4e-3); how far depends on the CPU's vector "
            "instructions and XLA's optimisation level, hence 5e-3. The weights compared "
            "agree to 2.4e-4 (conv1's bias; the kernels to 5e-5)."),
    "keras_timeseries_classification": dict(
        rtol=2e-3,
        drop=tuple(f"['weights'][{i}]" for i in (1, 4, 7, 10, 13, 16)),
        why="each Conv1D's bias feeds a BatchNormalization that subtracts the batch mean, so "
            "its gradient is zero up to rounding and Adam takes full-size steps in a direction "
            "set by rounding (4 devices sum in another order than 1): the three conv biases "
            "and the moving means that accumulate them are left out; the other weights agree "
            "to 1e-3 (BatchNorm's beta moves with the bias) and the history and test accuracy "
            "(compared before the weights) to 1e-5."),
}

UNEVEN = ("Keras fit/evaluate/predict on a last batch that does not divide over the replicas "
          "(today: ValueError / jax IndivisibleError)")
FIT_DATASET = "model.fit(jaxdist.Dataset) (today: Keras' 'Unrecognized data type')"

# Programs whose input pipeline is tf.data, kept as written (the tfdata test extra).
NEEDS_TF_DATA = ("tf_save_and_load",)

# name -> the open jaxdist limitation that makes it fail today.
XFAIL: dict[str, str] = {}

IN_PROCESS = [
    "flax_mnist_example",
    "keras_mnist_convnet",
    "keras_text_classification",
    "keras_timeseries_classification",
    "keras_structured_data",
    "tf_distribute_keras",
    "tf_custom_training",
    "jax_spmd_mnist",
    "keras_custom_train_step",
    "flax_seq2seq",
    "tf_save_and_load",
    "flax_mnist_tutorial",
]


def _need(n: int) -> None:
    have = jax.local_device_count()
    if have < n:
        pytest.skip(f"needs {n} local devices, {have} available")


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def assert_same_results(got, ref, rtol=RTOL, atol=ATOL, drop=(), why="") -> None:
    """Every leaf of ``got`` equals ``ref``'s to the tolerance (arrays by the norm of the
    difference, scalars elementwise); same structure; leaves whose path contains a ``drop``
    entry are skipped."""
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
    flat_ref = jax.tree_util.tree_flatten_with_path(ref)[0]
    compared = 0
    for (path, a), (_, b) in zip(flat_got, flat_ref):
        name = jax.tree_util.keystr(path)
        if any(d in name for d in drop):
            continue
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape, (name, a.shape, b.shape)
        if a.ndim:
            err, size = np.linalg.norm(a - b), np.linalg.norm(b)
            assert err <= rtol * size + atol * np.sqrt(a.size), (
                f"{name}: |a - b| = {err}, |b| = {size} ({why or 'default tolerance'})")
        else:
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=name)
        compared += 1
    assert compared, "nothing was compared"


def _like(ref, loaded):
    """``loaded`` (JSON: arrays as nested lists) with ``ref``'s structure and arrays."""
    treedef = jax.tree.structure(ref)
    return jax.tree.unflatten(treedef, [np.asarray(x) for x in treedef.flatten_up_to(loaded)])


def _param(name: str):
    marks = ([pytest.mark.xfail(strict=True, raises=ValueError, reason=XFAIL[name])]
             if name in XFAIL else [])
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [_param(n) for n in IN_PROCESS])
def test_program_on_4_devices_matches_1_device(name):
    _need(DEVICES)
    if name in NEEDS_TF_DATA:
        pytest.importorskip("tensorflow",
                            reason="tensorflow (the tfdata test extra) is not installed")
    program = importlib.import_module(f"programs.{name}")
    ref = program.main(None)
    got = program.main(jaxdist.MirroredStrategy(jax.local_devices()[:DEVICES]))
    assert_same_results(got, ref, **LOOSER.get(name, {}))


def _launch_env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", KERAS_BACKEND="jax")
    for key in ("TF_CONFIG", "JAX_NUM_CPU_DEVICES"):
        env.pop(key, None)  # the launcher gives each task its own
    # Of the suite's XLA flags the tasks keep the optimisation level (they compile as this
    # process does); the launcher gives each its device count.
    env["XLA_FLAGS"] = xla_flags()
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.dirname(HERE), HERE, env.get("PYTHONPATH")) if p)
    return env


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["tf_multi_worker_with_keras", "tf_multi_worker_with_ctl"])
def test_multi_worker_tutorial_on_2_processes_matches_1_device(tmp_path, name):
    """TF's multi-worker tutorials (Keras ``fit``; a custom loop on
    ``distribute_datasets_from_function``) as each task of ``python -m jaxdist.launch
    --workers 2 --devices-per-process 2`` (4 replicas on one global mesh), against the same
    program on 1 device over the same global batches. Their input is the tutorial's tf.data
    pipeline (the tfdata test extra)."""
    pytest.importorskip("tensorflow", reason="tensorflow (the tfdata test extra) is not installed")
    out = tmp_path / "result"
    log = tmp_path / "launch.log"
    # The cluster starts first; the 1-device reference runs here while its tasks start up.
    with open(log, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxdist.launch", "--workers", "2",
             "--devices-per-process", "2", "--", sys.executable, "-m",
             f"programs.{name}", str(out), str(tmp_path)],
            cwd=HERE, env=_launch_env(), stdout=log_file, stderr=subprocess.STDOUT)
    try:
        program = importlib.import_module(f"programs.{name}")
        ref = program.main(None, num_workers=2)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:  # the reference failed, or the cluster ran past its timeout
            proc.terminate()     # the launcher stops its tasks on SIGTERM
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, log.read_text()[-4000:]
    for i in range(2):
        got = json.loads((tmp_path / f"result.{i}.json").read_text())
        assert got.pop("replicas") == DEVICES
        assert_same_results(_like(ref, got), ref)


PARAMETER_SERVER = ["tf_parameter_server_custom_loop", "tf_parameter_server_keras_fit"]


@pytest.fixture(scope="module")
def ps_cluster():
    """1 worker task with 4 CPU devices and 2 ps tasks on 127.0.0.1; this process is the
    chief (the coordinator). Workers import the programs' modules (``PYTHONPATH``)."""
    from coordinator_util import start_cluster

    env = _launch_env()
    c = start_cluster(workers=1, ps=2, devices_per_process=DEVICES,
                      env={"KERAS_BACKEND": "jax", "PYTHONPATH": env["PYTHONPATH"]})
    yield c
    c.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", PARAMETER_SERVER)
def test_parameter_server_program_on_a_4_device_worker_matches_1_device(name, ps_cluster):
    """TF's parameter-server tutorial: its functions scheduled by a ``ClusterCoordinator``
    onto a worker task with 4 devices, variables partitioned over 2 ps tasks, against the
    same program in this process on 1 device with an in-process parameter service
    (``programs/_inprocess.py``)."""
    from coordinator_util import ChiefResolver, coordinator_for

    program = importlib.import_module(f"programs.{name}")
    ref = program.main(None)
    strategy = program.make_strategy(ChiefResolver(ps_cluster.cluster, ps_cluster.token))
    coordinator = coordinator_for(strategy)
    try:
        assert strategy.num_replicas_in_sync == DEVICES
        got = program.main(strategy, coordinator)
    finally:
        coordinator.shutdown()
    assert_same_results(got, ref)
