"""SIGTERM during a Keras ``fit`` under a jaxdist strategy: ``jaxdist.keras.BackupAndRestore``
backs up the batch every process agreed on and the job exits 42; the rerun continues that
epoch at that batch and ends with the weights of an uninterrupted ``fit``, bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
from devutil import xla_flags

from jaxdist.testing import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.platform("cpu")]

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "keras_preempt_worker.py")
EPOCHS = "3"   # 3 x 32 batches


def _env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", KERAS_BACKEND="jax", JAX_NUM_CPU_DEVICES="2")
    env["XLA_FLAGS"] = xla_flags(2)
    env.pop("TF_CONFIG", None)
    return env


def _weights(path) -> list[np.ndarray]:
    with open(path) as f:
        return [np.asarray(w, np.float32) for w in json.load(f)]


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def _wait_for_batch(lines, epoch: int, batch: int) -> None:
    for line in lines:
        m = re.match(r"batch (\d+) (\d+)", line)
        if m and (int(m.group(1)), int(m.group(2))) >= (epoch, batch):
            return
    raise AssertionError(f"the fit ended before epoch {epoch} batch {batch}")


@pytest.mark.timeout(240)
def test_keras_fit_in_one_process_resumes_at_the_agreed_batch(tmp_path):
    run = lambda out, work, sleep: subprocess.Popen(  # noqa: E731
        [sys.executable, WORKER, str(out), str(work), EPOCHS, sleep], env=_env(), cwd=HERE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ref = run(tmp_path / "ref", tmp_path / "ref_work", "0")   # alongside the run to interrupt
    work = tmp_path / "work"
    p = subprocess.Popen([sys.executable, WORKER, str(tmp_path / "out"), str(work), EPOCHS,
                          "20"], env=_env(), cwd=HERE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    _wait_for_batch(p.stdout, 1, 5)          # mid-way through the second epoch
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 42, err[-3000:]
    meta = json.loads((work / "backup" / "training_metadata.json").read_text())
    assert meta["preempted"] and meta["epoch"] == 1 and 6 <= meta["batch"] < 32, meta
    assert "the backup of step" in err and "exiting with 42" in err
    _, ref_err = ref.communicate(timeout=120)
    assert ref.returncode == 0, ref_err[-3000:]
    rerun = run(tmp_path / "out", work, "0")
    _, rerun_err = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, rerun_err[-3000:]
    _assert_same(_weights(f"{tmp_path / 'out'}.0.json"), _weights(f"{tmp_path / 'ref'}.0.json"))


def _cluster(out, work, sleep) -> LocalCluster:
    c = LocalCluster(workers=2, devices_per_process=1, cwd=HERE, env={"KERAS_BACKEND": "jax"})
    c.start([sys.executable, WORKER, str(out), str(work), EPOCHS, sleep])
    return c


@pytest.mark.timeout(300)
def test_keras_multi_worker_sigterm_to_one_worker_stops_both(tmp_path):
    work = tmp_path / "work"
    with _cluster(tmp_path / "ref", tmp_path / "ref_work", "0") as ref, \
            _cluster(tmp_path / "out", work, "20") as c:   # the reference runs alongside
        c.wait_for_output("worker:0", r"batch 1 [5-9]\b", 120)
        c.kill("worker:1", signal.SIGTERM)
        codes = c.join(timeout=60)
        assert codes == {"worker:0": 42, "worker:1": 42}, c.describe()
        assert "the chief wrote the backup of step" in c.output("worker:1")
        assert set(ref.join(timeout=120).values()) == {0}, ref.describe()
    with _cluster(tmp_path / "out", work, "0") as c:
        assert set(c.join(timeout=120).values()) == {0}, c.describe()
    for i in (0, 1):
        _assert_same(_weights(f"{tmp_path / 'out'}.{i}.json"),
                     _weights(f"{tmp_path / 'ref'}.{i}.json"))
