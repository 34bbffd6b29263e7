"""Keras ``fit`` under MultiWorkerMirroredStrategy on real processes.

2 processes x 2 forced CPU devices on 127.0.0.1 (a ``LocalCluster`` killed mid-job, then
relaunched by ``python -m jaxdist.launch``); each is given the whole data and the global batch
size, ``fit`` gives each its rows of every global batch, and the result must equal one device
over the same global batches.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxdist.testing import LocalCluster

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/


def _reference(epochs):
    """One device (this process's default device, no strategy) over the same global batches."""
    sys.path.insert(0, HERE)
    import keras_mw_worker as w

    x, y = w.data()
    m = w.model()
    h = m.fit(x, y, batch_size=w.GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0).history
    return {"history": {k: [float(v) for v in vs] for k, vs in h.items()},
            "weights": [np.asarray(a) for a in m.get_weights()]}


def _worker(tmp_path, out, epochs, kill_after):
    return [sys.executable, os.path.join(HERE, "keras_mw_worker.py"), str(out), str(tmp_path),
            str(epochs), str(kill_after)]


def _run(tmp_path, out, epochs, kill_after=-1, meanwhile=lambda: None):
    """Runs the job on a LocalCluster; calls ``meanwhile()`` while it runs and returns the
    exit codes, the cluster's description and what ``meanwhile`` returned."""
    cmd = _worker(tmp_path, out, epochs, kill_after)
    with LocalCluster(workers=2, devices_per_process=2, env={"KERAS_BACKEND": "jax"}) as c:
        c.start(cmd)
        result = meanwhile()
        codes = c.join(timeout=150)
        return codes, c.describe(), result


def _assert_same(got, ref, epochs=slice(None)):
    for k, v in ref["history"].items():
        np.testing.assert_allclose(got["history"][k], v[epochs], rtol=1e-5, atol=1e-6)
    for a, b in zip(got["weights"], ref["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_fit_across_processes_matches_one_device_and_resumes(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # A job killed (every process, abruptly) after its 2nd epoch (the one-device reference is
    # computed while it runs) ...
    codes, why, ref = _run(tmp_path, tmp_path / "killed", epochs=3, kill_after=1,
                           meanwhile=lambda: _reference(epochs=3))
    assert codes == {"worker:0": 17, "worker:1": 17}, why
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "e1.weights.h5", "e2.weights.h5"]
    # ... relaunched: BackupAndRestore resumes at epoch 3 on every worker, and the result is
    # the uninterrupted run's (one device, same global batches).
    env = dict(os.environ, JAX_PLATFORMS="cpu", KERAS_BACKEND="jax")
    env.pop("TF_CONFIG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "jaxdist.launch", "--workers", "2", "--devices-per-process", "2",
         "--", *_worker(tmp_path, tmp_path / "mw", 3, -1)],
        env=env, cwd=os.path.dirname(HERE), capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for i in range(2):
        got = json.loads((tmp_path / f"mw.{i}.json").read_text())
        assert (got["replicas"], got["processes"]) == (4, 2)
        _assert_same(got, ref, epochs=slice(2, 3))  # the relaunch trained epoch 3 only
    assert not (tmp_path / "backup").exists()  # removed by the chief at the end of fit
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "e1.weights.h5", "e2.weights.h5", "e3.weights.h5"]
    m = __import__("keras_mw_worker").model()
    m.load_weights(str(tmp_path / "ckpt" / "e3.weights.h5"))
    for a, b in zip(m.get_weights(), ref["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # TensorBoard: one writer (the chief) per run; the resumed run logs epoch 3 (step 2). The
    # killed run's last event may be lost with the process (os._exit skips the writer thread).
    runs = sorted((tmp_path / "logs" / "train").glob("events.out.tfevents.*"))
    assert len(runs) == 2, runs
    steps = []
    for r in runs:
        acc = EventAccumulator(str(r)).Reload()
        steps += [e.step for e in acc.Scalars("epoch_loss")]
    assert 0 in steps and 2 in steps and set(steps) <= {0, 1, 2}, steps


def test_writers_skip_non_chief_processes(tmp_path, monkeypatch):
    os.environ.setdefault("KERAS_BACKEND", "jax")
    keras = pytest.importorskip("keras")
    import jax

    from jaxdist._src.keras import callbacks as jk

    sys.path.insert(0, HERE)
    import keras_mw_worker as w

    monkeypatch.setattr(jax, "process_index", lambda: 1)
    x, y = w.data()
    m = w.model()
    m.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[
        jk.ModelCheckpoint(str(tmp_path / "c.weights.h5"), save_weights_only=True),
        jk.BackupAndRestore(str(tmp_path / "backup"), delete_checkpoint=False),
        jk.TensorBoard(tmp_path / "logs"),
    ])
    assert list(tmp_path.iterdir()) == []
    del keras
