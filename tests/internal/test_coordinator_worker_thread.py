"""``WorkerThread`` (jaxdist/_src/coordinator/worker_thread.py) on its explicit interface, with no
process: a real ``WorkerService`` answers in this process through a stand-in for the
``WorkerClient``. Runs closures and settles their values, puts back what a lost call did not
answer (at-least-once for those, exactly once for the answered), cancels its call when an
earlier closure failed, and reads no private attribute of another object."""

from __future__ import annotations

import ast
import os
import threading
import time

import numpy as np
import pytest

from jaxdist._src.cluster.task_info import TaskInfo
from jaxdist._src.coordinator import worker_thread as wt
from jaxdist._src.coordinator.closure_queue import Closure, ClosureQueue
from jaxdist._src.coordinator.errors import CancelledError, WorkerUnavailableError
from jaxdist._src.coordinator.health import WorkerState
from jaxdist._src.coordinator.remote_value import RemoteValue
from jaxdist._src.coordinator.resources import PerWorkerResources
from jaxdist._src.coordinator.worker_runtime import WorkerRuntime, set_current
from jaxdist._src.coordinator.worker_service import SEQ_KEY, SESSION_KEY, WorkerService

SETTINGS = wt.SenderSettings(num_workers=1, rpc_timeout=10.0, closure_timeout=10.0,
                             ps_rpc_timeout=10.0, join_timeout=10.0)


class _Call:
    """The call handle ``on_start`` gets: ``cancel()`` is what heartbeats and ``cancel`` use."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


class InProcessClient:
    """A ``WorkerClient`` stand-in over one in-process ``WorkerService`` (worker 0).

    Args:
        lose_after: the first ``RunClosures`` call is lost (``WorkerUnavailableError``) after
            this many answers, as when the worker dies mid-batch.
    """

    def __init__(self, lose_after: int | None = None) -> None:
        info = TaskInfo({"worker": ["127.0.0.1:1"], "ps": []}, "worker", 0, "t")
        runtime = WorkerRuntime(info, strategy_factory=lambda info, timeout: "strategy")
        set_current(runtime)
        self.service = WorkerService(runtime)
        self.lose_after = lose_after
        self.calls: list[_Call] = []
        self.requests: list[tuple[dict, dict]] = []

    def call(self, task, method, meta, arrays, timeout, on_start=None):
        assert task == 0 and timeout == SETTINGS.rpc_timeout
        if on_start is not None:
            on_start(_Call())
        return self.service.handle(method, meta, arrays)

    def call_stream(self, task, method, meta, arrays, timeout, on_start=None):
        assert task == 0 and method == "RunClosures" and timeout == SETTINGS.closure_timeout
        call = _Call()
        self.calls.append(call)
        self.requests.append((meta, arrays))
        if on_start is not None:
            on_start(call)
        svc = self.service
        answers = svc.run_closures(svc.batch_items(meta, arrays),
                                   active=lambda: not call.cancelled.is_set(),
                                   session=meta.get(SESSION_KEY), seq=meta.get(SEQ_KEY))
        lose, self.lose_after = self.lose_after, None

        def stream():
            try:
                for n, answer in enumerate(answers):
                    if call.cancelled.is_set():
                        raise WorkerUnavailableError("worker:0: the call was cancelled",
                                                     task="worker:0")
                    if lose is not None and n >= lose:
                        raise WorkerUnavailableError("worker:0: connection lost",
                                                     task="worker:0")
                    yield answer
            finally:
                answers.close()

        return stream()


def _worker(client: InProcessClient, queue: ClosureQueue) -> tuple[wt.WorkerThread,
                                                                     threading.Event]:
    stopping = threading.Event()
    state = WorkerState(0, "worker:0")
    state.up.set()
    return wt.WorkerThread(state, queue, client, PerWorkerResources(), SETTINGS,
                           stopping), stopping


def _stop(w: wt.WorkerThread, queue: ClosureQueue, stopping: threading.Event) -> None:
    stopping.set()
    queue.stop()
    w.join(time.monotonic() + 10.0)
    assert not w.is_alive()


def _until(predicate, what: str, timeout: float = 10.0) -> None:
    """Waits (polling, with a deadline) until ``predicate()``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _private_reads(tree: ast.AST) -> list[str]:
    """``x._name`` in ``tree`` where ``x`` is not ``self`` (dunders left out)."""
    return [f"line {node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id == "self")]


def _schedule(queue: ClosureQueue, fn, *args) -> list[Closure]:
    out = []
    for i, a in enumerate(args):
        out.append(Closure(i, fn, (a,), {}, RemoteValue(f"c{i}", default_timeout=10.0)))
        queue.put(out[-1])
    return out


def _square(x):
    return np.int64(x * x)


# Module-level, so that the pickled functions refer to these very events (pickled by name).
GATE, STARTED = threading.Event(), threading.Event()


def _fail(_):
    raise ValueError("the first closure failed")


def _wait_for_gate(_):
    STARTED.set()
    assert GATE.wait(10.0)
    return 1


def test_a_worker_thread_runs_the_queued_closures_and_settles_their_values():
    queue, client = ClosureQueue(), InProcessClient()
    closures = _schedule(queue, _square, *range(6))
    w, stopping = _worker(client, queue)
    w.start()
    try:
        assert queue.wait(10.0)
        assert [int(c.remote_value.fetch()) for c in closures] == [i * i for i in range(6)]
        assert {c.remote_value.worker for c in closures} == {"worker:0"}
        assert w.functions_run == client.service.functions_run == 6
        # The function went to the worker once or twice (both senders may race for the
        # first send); afterwards by digest only.
        with_fn = [m for m, a in client.requests if any(k.startswith("fn.") for k in a)]
        assert 1 <= len(with_fn) <= 2 and len(client.requests) >= 1
        _until(lambda: w.current is None and w.state.current_call is None, "the senders idle")
        assert all(b == [] for b in w.batches()) and w.state.downs == 0
    finally:
        _stop(w, queue, stopping)


def test_a_lost_call_puts_back_only_the_closures_it_did_not_answer():
    queue, client = ClosureQueue(), InProcessClient(lose_after=1)
    closures = _schedule(queue, _square, *range(4))   # the first call takes 4 // 2 = 2
    w, stopping = _worker(client, queue)
    w.start()
    try:
        _until(lambda: w.state.downs > 0, "worker:0 marked down")
        assert w.state.downs == 1 and not w.state.up.is_set()   # lost: marked down
        first_meta, _ = client.requests[0]
        assert [c["closure_id"] for c in first_meta["closures"]] == [0, 1]
        assert closures[0].remote_value.fetch() == 0   # answered before the loss: settled
        assert not closures[1].remote_value.done()     # not answered: back in the queue
        w.state.up.set()                                # the heartbeats see it again
        assert queue.wait(10.0)
        assert [int(c.remote_value.fetch()) for c in closures] == [0, 1, 4, 9]
        # Closure 1 ran on the worker before its answer was lost, and again: at-least-once;
        # each closure was settled exactly once.
        assert client.service.functions_run == 5 and w.functions_run == 4
    finally:
        _stop(w, queue, stopping)


def test_an_earlier_failure_cancels_the_call_in_flight_and_its_closures():
    GATE.clear()
    STARTED.clear()
    queue, client = ClosureQueue(), InProcessClient()
    w, stopping = _worker(client, queue)
    queue.on_cancel = w.cancel
    closures = [Closure(0, _fail, (0,), {}, RemoteValue("c0", default_timeout=10.0)),
                Closure(1, _wait_for_gate, (1,), {}, RemoteValue("c1", default_timeout=10.0)),
                Closure(2, _square, (2,), {}, RemoteValue("c2", default_timeout=10.0)),
                Closure(3, _square, (3,), {}, RemoteValue("c3", default_timeout=10.0))]
    for c in closures:
        queue.put(c)

    def open_gate_once_cancelled():
        try:
            if STARTED.wait(10.0):
                client.calls[0].cancelled.wait(10.0)
        finally:
            GATE.set()

    opener = threading.Thread(target=open_gate_once_cancelled, daemon=True)
    opener.start()
    w.start()
    try:
        with pytest.raises(ValueError, match="the first closure failed"):
            queue.wait(10.0)
        opener.join(10.0)
        assert client.calls[0].cancelled.is_set()       # w.cancel() cancelled the call
        for c in closures[1:]:                          # in flight or queued: cancelled
            with pytest.raises(CancelledError):
                c.remote_value.fetch(1.0)
        assert w.state.downs == 0 and w.state.up.is_set()   # a cancelled call is no failure
        # New closures run after the error was raised once.
        again = _schedule(queue, _square, 7)
        assert queue.wait(10.0) and again[0].remote_value.fetch() == 49
    finally:
        GATE.set()
        _stop(w, queue, stopping)


def test_the_worker_thread_reads_no_private_attribute_of_another_object():
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(repo, "jaxdist", "_src", "coordinator", "worker_thread.py")
    with open(path, encoding="utf-8") as f:
        bad = _private_reads(ast.parse(f.read()))
    assert not bad, "private attributes read across the WorkerThread's interface:\n" + \
        "\n".join(bad)


def test_the_private_attribute_check_can_fail():
    tree = ast.parse("def f(self, c):\n    return self._ok, c._queue, c.__class__, c.ok\n")
    assert _private_reads(tree) == ["line 2: c._queue"]
