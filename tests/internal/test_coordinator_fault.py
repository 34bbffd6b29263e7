"""Fault tolerance of the ClusterCoordinator with real processes (TF's fault_tolerance_test):
workers killed between and in the middle of functions, both workers lost, restarted workers
rebuilding their datasets, hung workers, results that outlive their worker, exactly-once
evaluation."""

import os
import signal
import time

import numpy as np
import pytest
from coordinator_util import (
    by_value,
    coordinator_for,
    restart,
    start_cluster,
    strategy_for,
    wait_until,
)

from jaxdist._src.coordinator.worker_client import WorkerClient
from jaxdist._src.ps import optimizers as O

pytestmark = pytest.mark.slow
by_value(__name__)


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster(workers=2, ps=1)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def strategy(cluster):
    return strategy_for(cluster)


@pytest.fixture
def coordinator(strategy, cluster):
    for name in ("worker:0", "worker:1"):  # every test starts with both workers up
        if not cluster.tasks[name].running():
            restart(cluster, name)
    coord = coordinator_for(strategy)
    wait_until(lambda: all(w.up.is_set() for w in coord.worker_states()), 20, "workers up")
    yield coord
    coord.shutdown()


_names = iter(range(1000))


def make_counter(strategy):
    with strategy.scope():
        counter = strategy.create_variables({"n": np.zeros((), np.float32)}, O.sgd(-1.0),
                                            name=f"counter{next(_names)}")

    def step(sleep=0.0):
        time.sleep(sleep)
        counter.apply_gradients({"n": np.ones((), np.float32)})
        return os.getpid()

    return counter, step


def busy_worker(cluster, index: int, timeout: float = 20.0) -> None:
    """Waits until worker ``index`` is in the middle of a function."""
    client = WorkerClient(cluster.cluster["worker"], cluster.coordinator_token)
    try:
        wait_until(lambda: client.call(index, "Ping", timeout=5.0)[0]["busy"], timeout,
                   f"worker:{index} to run a function")
    finally:
        client.close()


def test_worker_killed_between_functions_runs_exactly_n(cluster, strategy, coordinator):
    counter, step = make_counter(strategy)
    for _ in range(6):
        coordinator.schedule(step, args=(0.02,))
    coordinator.join()
    cluster.kill("worker:0")
    rvs = [coordinator.schedule(step, args=(0.02,)) for _ in range(6)]
    time.sleep(0.5)
    restart(cluster, "worker:0")
    wait_until(lambda: coordinator.worker_states()[0].up.is_set(), 20, "worker:0 to rejoin")
    rvs += [coordinator.schedule(step, args=(0.05,)) for _ in range(8)]
    coordinator.join()
    assert float(counter.pull()["n"]) == 20.0  # exactly once: nothing lost, nothing doubled
    assert coordinator.worker_states()[0].restarts == 1
    new_pid = cluster.tasks["worker:0"].pid
    assert any(rv.fetch() == new_pid for rv in rvs), "the restarted worker did not rejoin"


def test_worker_killed_mid_function_reruns_it_elsewhere(cluster, strategy, coordinator):
    counter, step = make_counter(strategy)
    rvs = [coordinator.schedule(step, args=(0.3,)) for _ in range(10)]
    busy_worker(cluster, 0)
    cluster.kill("worker:0")
    coordinator.join()
    n = float(counter.pull()["n"])
    assert 10.0 <= n <= 11.0, n  # at least once; the killed function ran again
    assert sum(coordinator.functions_run()) == 10
    assert coordinator.worker_states()[0].downs == 1
    assert {rv.worker for rv in rvs[-3:]} == {"worker:1"}


def test_both_workers_killed_and_restarted_completes(cluster, strategy, coordinator):
    counter, step = make_counter(strategy)
    for _ in range(12):
        coordinator.schedule(step, args=(0.1,))
    busy_worker(cluster, 0)
    cluster.kill("worker:0")
    cluster.kill("worker:1")
    time.sleep(0.5)
    assert not coordinator.done()
    restart(cluster, "worker:0")
    restart(cluster, "worker:1")
    coordinator.join()
    assert 12.0 <= float(counter.pull()["n"]) <= 14.0
    assert sum(coordinator.functions_run()) == 12


def test_restarted_worker_rebuilds_its_dataset(cluster, coordinator):
    def dataset_fn(ctx):
        return iter(range(1000 * ctx.input_pipeline_id, 1000 * ctx.input_pipeline_id + 500))

    it = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def take(it):
        time.sleep(0.02)
        return next(it), os.getpid()

    first = [coordinator.schedule(take, args=(it,)) for _ in range(8)]
    coordinator.join()
    old_pid = cluster.tasks["worker:0"].pid
    taken0 = sorted(v for v, pid in (rv.fetch() for rv in first) if pid == old_pid)
    assert taken0 and taken0 == list(range(len(taken0)))
    restart(cluster, "worker:0")
    wait_until(lambda: coordinator.worker_states()[0].restarts == 1, 20, "restart seen")
    rvs = [coordinator.schedule(take, args=(it,)) for _ in range(16)]
    coordinator.join()
    new_pid = cluster.tasks["worker:0"].pid
    after = [v for v, pid in (rv.fetch() for rv in rvs) if pid == new_pid]
    assert after, "the restarted worker ran nothing"
    # Its dataset was rebuilt: it starts again from the first element, in order.
    assert sorted(after) == list(range(len(after)))
    w1 = [v for v, pid in (rv.fetch() for rv in first + rvs) if v >= 1000]
    assert sorted(w1) == list(range(1000, 1000 + len(w1)))  # worker:1 kept its position


def test_remote_value_outlives_its_worker(cluster, coordinator):
    def where():
        return os.getpid()

    rvs = [coordinator.schedule(where) for _ in range(6)]
    coordinator.join()
    pid0 = cluster.tasks["worker:0"].pid
    mine = [rv for rv in rvs if rv.fetch() == pid0]
    assert mine, "worker:0 ran nothing"
    cluster.kill("worker:0")
    wait_until(lambda: not coordinator.worker_states()[0].up.is_set(), 10, "worker:0 down")
    assert all(rv.fetch() == pid0 for rv in mine)
    assert coordinator.schedule(where).fetch(timeout=30) == cluster.tasks["worker:1"].pid


def test_hung_worker_is_declared_down_and_rejoins(cluster, strategy, coordinator):
    counter, step = make_counter(strategy)
    rvs = [coordinator.schedule(step, args=(0.2,)) for _ in range(8)]
    busy_worker(cluster, 0)
    cluster.kill("worker:0", signal.SIGSTOP)  # alive but silent: only heartbeats tell
    try:
        wait_until(lambda: not coordinator.worker_states()[0].up.is_set(), 10,
                   "heartbeat timeout")
        coordinator.join()  # worker:1 ran the hung worker's function too
        assert sum(coordinator.functions_run()) == 8
    finally:
        cluster.kill("worker:0", signal.SIGCONT)
    wait_until(lambda: coordinator.worker_states()[0].up.is_set(), 10, "worker:0 rejoins")
    assert coordinator.worker_states()[0].restarts == 0  # same process, back on its own
    more = [coordinator.schedule(step, args=(0.1,)) for _ in range(8)]
    coordinator.join()
    assert "worker:0" in {rv.worker for rv in more}
    wait_until(lambda: float(counter.pull()["n"]) >= 16.0, 10, "the resumed push")
    assert float(counter.pull()["n"]) in (16.0, 17.0)  # at-least-once
    assert len(rvs) == 8


def test_exactly_once_evaluation_despite_a_lost_worker(cluster, strategy, coordinator):
    attempts, _ = make_counter(strategy)

    def dataset_fn(shard, num_shards):
        return [np.arange(40)[shard::num_shards][i:i + 2] for i in range(0, 5, 2)]

    def eval_fn(batches):
        attempts.apply_gradients({"n": np.ones((), np.float32)})
        seen = []
        for b in batches:
            time.sleep(0.1)
            seen += np.asarray(b).tolist()
        return seen

    import threading

    killer = threading.Thread(target=lambda: (busy_worker(cluster, 0), cluster.kill("worker:0")))
    killer.start()
    parts = coordinator.evaluate(eval_fn, dataset_fn, num_shards=8)
    killer.join()
    visited = sorted(v for p in parts for v in p)
    assert visited == list(range(40))  # every example exactly once
    # ... although worker:0 was lost in the middle of a shard (its function had started; the
    # shard ran again elsewhere). Whether that first run's counter push reached the ps before
    # the kill is a race, so the count is 8 or 9.
    assert coordinator.worker_states()[0].downs == 1
    assert float(attempts.pull()["n"]) >= 8


def test_worker_killed_mid_batch_reruns_only_the_closures_without_an_answer(
        cluster, strategy, coordinator):
    counter, step = make_counter(strategy)
    w0 = coordinator._workers[0]
    rvs = [coordinator.schedule(step, args=(0.2,)) for _ in range(24)]

    def batch_on_worker0() -> bool:
        return any(len(batch) > 1 for batch in w0.batches())

    wait_until(batch_on_worker0, 20, "worker:0 to hold a batch of several closures")
    busy_worker(cluster, 0)
    lost = [c.closure_id for batch in w0.batches() for c in batch]
    cluster.kill("worker:0")
    coordinator.join()
    assert all(isinstance(rv.fetch(), int) for rv in rvs)
    n = float(counter.pull()["n"])
    # At least once: only the closure running when worker:0 died ran twice; the rest of its
    # batch had not started (or had answered) and ran once.
    assert 24.0 <= n <= 25.0, n
    assert sum(coordinator.functions_run()) == 24
    assert coordinator.worker_states()[0].downs == 1
    first = int(rvs[0]._name.split("#")[1])
    rerun = [rvs[cid - first] for cid in lost if rvs[cid - first].worker == "worker:1"]
    assert len(rerun) >= 2, (lost, [rvs[cid - first].worker for cid in lost])
