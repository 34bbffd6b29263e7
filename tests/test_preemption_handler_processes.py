"""``PreemptionCheckpointHandler`` in a real 2-process MultiWorkerMirroredStrategy custom loop
(127.0.0.1, one CPU device per process): SIGTERM to worker:1 stops both processes at one agreed
step, the chief writes that step's checkpoint, both exit 42, and the rerun resumes there and
ends where an uninterrupted run ends, bit for bit."""

import os
import re
import signal
import sys

import numpy as np
import pytest

import jaxdist
from jaxdist.testing import LocalCluster

pytestmark = pytest.mark.slow

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "handler_mw_worker.py")
STEPS = 40


def _command(ckpt_dir, out, sleep, *extra):
    return [sys.executable, WORKER, str(ckpt_dir), str(out), str(STEPS), str(sleep), *extra]


def _final(path):
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


@pytest.mark.timeout(240)
def test_sigterm_to_one_worker_saves_the_agreed_step_and_the_rerun_finishes_bit_for_bit(
        tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    with LocalCluster(workers=2, devices_per_process=1) as c:
        # Uninterrupted reference.
        c.start(_command(tmp_path / "ref_ckpt", tmp_path / "ref.npz", 0))
        assert c.join(timeout=120) == {"worker:0": 0, "worker:1": 0}, c.describe()

        c.start(_command(ckpt_dir, tmp_path / "out.npz", 0.1))
        c.wait_for_output("worker:1", r"^step 5$", 90)
        c.kill("worker:1", signal.SIGTERM)
        codes = c.join(timeout=60)
        assert codes == {"worker:0": 42, "worker:1": 42}, c.describe()
        stops = {n: int(re.search(r"stopped before step (\d+)", c.output(n)).group(1))
                 for n in ("worker:0", "worker:1")}
        agreed = stops["worker:0"]
        assert stops["worker:1"] == agreed and 6 <= agreed < STEPS, c.describe()
        assert "the preemption checkpoint of step" in c.output("worker:0")  # the chief wrote
        assert f"the chief wrote the preemption checkpoint of step {agreed}" in \
            c.output("worker:1")
        ran = [ln for ln in c.output("worker:0").splitlines() if ln.startswith("step ")]
        assert len(ran) == agreed   # nothing lost: every step started was finished and saved

        manager = jaxdist.CheckpointManager(jaxdist.Checkpoint(), ckpt_dir, max_to_keep=1)
        assert [os.path.basename(p) for p in manager.checkpoints] == ["1"]
        assert manager.checkpoint.restore(manager.latest_checkpoint).checkpointed_runs == agreed
        assert not os.path.exists(tmp_path / "workertemp_1")  # worker:1 wrote nothing

        c.start(_command(ckpt_dir, tmp_path / "out.npz", 0))
        assert c.join(timeout=120) == {"worker:0": 0, "worker:1": 0}, c.describe()
        for n in ("worker:0", "worker:1"):
            assert f"start at {agreed}" in c.output(n), c.describe()
    for a, b in zip(_final(tmp_path / "ref.npz"), _final(tmp_path / "out.npz")):
        np.testing.assert_array_equal(a, b)


@pytest.mark.timeout(120)
def test_an_exit_fn_that_returns_in_a_multi_process_job_is_an_error_naming_the_step(tmp_path):
    with LocalCluster(workers=2, devices_per_process=1) as c:
        c.start(_command(tmp_path / "ckpt", tmp_path / "out.npz", 0.1, "returning-exit"))
        c.wait_for_output("worker:0", r"^step 3$", 90)
        c.kill("worker:0", signal.SIGTERM)
        codes = c.join(timeout=60)
        assert codes == {"worker:0": 1, "worker:1": 1}, c.describe()
        for n in ("worker:0", "worker:1"):
            out = c.output(n)
            assert "exit_fn returned" in out, c.describe()
            assert re.search(r"PreemptionError: TerminationConfig.exit_fn returned after the "
                             r"preemption checkpoint of step \d+ on worker \d: in a "
                             r"multi-process job every process must exit", out), c.describe()
