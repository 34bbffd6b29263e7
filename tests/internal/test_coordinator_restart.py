"""The coordinator process dies and a new one continues from the ps checkpoint; a lost ps
makes schedule/join raise a typed error naming it."""

import json
import os
import sys
import time

import numpy as np
import pytest
from coordinator_util import (
    SERVER,
    by_value,
    coordinator_for,
    start_cluster,
    strategy_for,
    wait_listening,
    wait_until,
)

from jaxdist._src.coordinator.worker_client import WorkerClient
from jaxdist._src.ps import optimizers as O
from jaxdist._src.ps.errors import PSUnavailableError

pytestmark = pytest.mark.slow
by_value(__name__)
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHIEF = [sys.executable, os.path.join(TESTS, "coordinator_chief.py")]


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory):
    return tmp_path_factory.mktemp("ps_root")


@pytest.fixture(scope="module")
def cluster(checkpoint_root):
    # A ps saves only under the --checkpoint_dir it was started with (its checkpoint root).
    c = start_cluster(workers=2, ps=1, ps_args=("--checkpoint_dir", str(checkpoint_root)))
    yield c
    c.stop()


def _json(output: str) -> dict:
    return json.loads([line for line in output.splitlines() if line.startswith("{")][-1])


def test_new_coordinator_continues_from_the_ps_checkpoint(cluster, checkpoint_root):
    ckpt = str(checkpoint_root / "ckpt")
    cluster.start_task("chief:0", [*CHIEF, "train", ckpt])
    code = cluster.wait("chief:0", 90)
    assert code == -9, cluster.describe()  # it was killed with functions in flight
    assert _json(cluster.output("chief:0")) == {"before_kill": 9.0}
    client = WorkerClient(cluster.cluster["worker"], cluster.coordinator_token)
    try:  # the workers finish what they were running; then restart the ps from its checkpoint
        wait_until(lambda: not any(client.call(i, "Ping", timeout=5)[0]["busy"]
                                   for i in range(2)), 20, "workers idle")
    finally:
        client.close()
    cluster.kill("ps:0")
    cluster.start_task("ps:0", [*SERVER, "--checkpoint_dir", ckpt])
    wait_listening(cluster, "ps:0")
    cluster.start_task("chief:0", [*CHIEF, "resume", ckpt])
    assert cluster.wait("chief:0", 90) == 0, cluster.describe()
    out = _json(cluster.output("chief:0"))
    assert out["restored_at"] == 6.0  # the restarted ps restored step 6
    assert out["step"] == 10.0 and out["w"] == [10.0] * 4  # 6 from the checkpoint + 4


def _lose_the_ps(cluster) -> float:
    """Kills ps:0 with steps queued: join and schedule raise the typed error naming it; returns
    the seconds join took to raise."""
    strategy = strategy_for(cluster, timeout=5.0)
    with strategy.scope():
        counter = strategy.create_variables({"n": np.zeros((), np.float32)}, O.sgd(-1.0),
                                            name="ps_loss_counter")

    def step():
        time.sleep(0.1)
        counter.apply_gradients({"n": np.ones((), np.float32)})

    coord = coordinator_for(strategy, ps_timeout=1.0)
    try:
        for _ in range(4):
            coord.schedule(step)
        coord.join()
        for _ in range(50):
            coord.schedule(step)
        cluster.kill("ps:0")
        t0 = time.monotonic()
        with pytest.raises(PSUnavailableError, match="ps:0") as info:
            coord.join()
        took = time.monotonic() - t0
        assert info.value.task == "ps:0"
        with pytest.raises(PSUnavailableError, match="ps:0"):
            coord.schedule(step)
    finally:
        coord.shutdown()
    return took


def test_lost_ps_raises_a_typed_error_naming_it(cluster):
    _lose_the_ps(cluster)  # the module's cluster: its last test


@pytest.mark.timing
def test_a_lost_ps_is_named_within_seconds():
    """The wall-clock claim (deselected by default): ps_timeout=1 s names the lost ps within
    15 s. A cluster of its own (the module's has lost its ps)."""
    cluster = start_cluster(workers=2, ps=1)
    try:
        assert _lose_the_ps(cluster) < 15
    finally:
        cluster.stop()
