"""ClusterCoordinator pieces without processes: closure queue, RemoteValue, pickling, worker
service, argument checks."""

import threading
import time

import numpy as np
import pytest

import jaxdist
import jaxdist.ps
from jaxdist._src.cluster.task_info import TaskInfo
from jaxdist._src.coordinator import answer_codec, closure_pickle
from jaxdist._src.coordinator.closure_queue import Closure, ClosureQueue
from jaxdist._src.coordinator.cluster_coordinator import ClusterCoordinator
from jaxdist._src.coordinator.errors import CancelledError, JoinTimeoutError
from jaxdist._src.coordinator.remote_value import PerWorkerValues, RemoteValue
from jaxdist._src.coordinator.worker_runtime import WorkerRuntime, set_current
from jaxdist._src.coordinator.worker_service import (
    WorkerService,
    answer_value,
    from_bytes_array,
    to_bytes_array,
)


def _closure(i, fn=lambda: None):
    return Closure(i, fn, (), {}, RemoteValue(f"f{i}"))


def test_queue_first_error_cancels_pending_and_is_raised_once():
    q = ClosureQueue()
    closures = [_closure(i) for i in range(4)]
    for c in closures:
        q.put(c)
    a, b = q.get(0.1), q.get(0.1)
    q.mark_failed(ValueError("first"))
    q.mark_failed(KeyError("second"))  # only the first error is kept
    assert len(q) == 2  # TF: the queue is cancelled when the error is raised
    with pytest.raises(ValueError, match="first"):
        q.wait(1.0, lambda: AssertionError("timeout"))
    assert len(q) == 0
    for c in closures[2:]:
        with pytest.raises(CancelledError, match="cancelled"):
            c.remote_value.fetch(0.1)
    q.wait(1.0, lambda: AssertionError("timeout"))  # raised once, then cleared
    q.put(_closure(9))  # new schedules work
    assert len(q) == 1 and a.closure_id == 0 and b.closure_id == 1


def test_queue_put_back_requeues_at_front_and_wait_times_out_without_progress():
    q = ClosureQueue()
    q.put(_closure(0))
    q.put(_closure(1))
    c = q.get(0.1)
    q.put_back(c)
    assert q.get(0.1).closure_id == 0 and q.inflight == 1
    t0 = time.monotonic()
    with pytest.raises(JoinTimeoutError):
        q.wait(0.3, lambda: JoinTimeoutError("stalled"))
    assert time.monotonic() - t0 < 30  # a hang guard: the 0.3 s wait ended with the error


def test_queue_sticky_cluster_error_until_cleared():
    q = ClosureQueue()
    q.put(_closure(0))
    q.set_cluster_error(jaxdist.ps.PSUnavailableError("ps:0 down", task="ps:0"))
    with pytest.raises(jaxdist.ps.PSUnavailableError, match="ps:0"):
        q.put(_closure(1))
    with pytest.raises(jaxdist.ps.PSUnavailableError):
        q.wait(1.0, lambda: AssertionError())
    q.set_cluster_error(None)
    q.put(_closure(2))


def test_remote_value_fetch_timeout_and_value_from_other_thread():
    rv = RemoteValue("f")
    with pytest.raises(JoinTimeoutError, match="not ready within 0.1 s"):
        rv.fetch(0.1)
    threading.Timer(0.05, rv._set_value, args=(np.arange(3), "worker:1")).start()
    np.testing.assert_array_equal(rv.fetch(5.0), np.arange(3))
    assert rv.worker == "worker:1" and rv.done()
    assert rv.get().shape == (3,)


def test_pickle_swaps_per_worker_values_and_checks_parts():
    pw = PerWorkerValues(["a", "b"])
    assert closure_pickle.loads(closure_pickle.dumps((pw, 1), worker_index=1)) == ("b", 1)
    with pytest.raises(ValueError, match="2 parts, but worker 2"):
        closure_pickle.dumps(pw, worker_index=2)
    rv = RemoteValue("x")
    rv._set_value(7)
    assert closure_pickle.loads(closure_pickle.dumps([rv])) == [7]


def _runtime():
    info = TaskInfo({"worker": ["127.0.0.1:1"], "ps": []}, "worker", 0, "t")
    rt = WorkerRuntime(info, strategy_factory=lambda info, timeout: "the-worker-strategy")
    set_current(rt)
    return rt


def test_worker_service_runs_functions_and_reports_errors():
    svc = WorkerService(_runtime())
    try:
        def add(a, b):
            return np.asarray(a) + b

        def run(fn, *args):
            meta, arrays = svc.run_closure(
                {"closure_id": 0},
                {"fn": to_bytes_array(closure_pickle.dumps(fn)),
                 "args": to_bytes_array(closure_pickle.dumps((args, {})))})
            return meta, arrays

        meta, arrays = run(add, 2, 3)
        assert meta["ok"] and answer_value(arrays) == 5

        def bad():
            raise KeyError("nope")

        meta, arrays = run(bad)
        assert not meta["ok"] and meta["kind"] == "user" and meta["type"] == "KeyError"
        assert isinstance(answer_codec.decode(from_bytes_array(arrays["error"])), KeyError)
        meta, _ = run(lambda r: r, closure_pickle.WorkerResource(5, 0))
        assert meta["kind"] == "missing_resource"
        assert svc.functions_run == 1
    finally:
        set_current(None)


def test_strategy_reference_resolves_to_the_workers_strategy():
    _runtime()
    try:
        strategy = jaxdist.ParameterServerStrategy()  # local: no cluster
        fn = closure_pickle.loads(closure_pickle.dumps(lambda: strategy))
        assert fn() == "the-worker-strategy"
    finally:
        set_current(None)


def test_coordinator_rejects_bad_strategies():
    with pytest.raises(TypeError, match="needs a ParameterServerStrategy, got MirroredStrategy"):
        ClusterCoordinator(jaxdist.MirroredStrategy())
    with pytest.raises(ValueError, match="'worker' job"):
        ClusterCoordinator(jaxdist.ParameterServerStrategy())


def test_worker_service_runs_a_function_sent_once_by_its_digest():
    import hashlib

    svc = WorkerService(_runtime())
    try:
        payload = closure_pickle.dumps(lambda a: a * 3)
        digest = hashlib.sha256(payload).hexdigest()
        args = to_bytes_array(closure_pickle.dumps(((4,), {})))
        meta, arrays = svc.run_closure({"closure_id": 0, "fn_digest": digest},
                                       {"fn": to_bytes_array(payload), "args": args})
        assert meta["ok"] and answer_value(arrays) == 12
        meta, arrays = svc.run_closure({"closure_id": 1, "fn_digest": digest}, {"args": args})
        assert meta["ok"] and answer_value(arrays) == 12
        meta, _ = svc.run_closure({"closure_id": 2, "fn_digest": "0" * 64}, {"args": args})
        assert meta == {**meta, "ok": False, "kind": "missing_function"}
        meta, _ = svc.run_closure({"closure_id": 3, "fn_digest": "1" * 64},
                                  {"fn": to_bytes_array(payload), "args": args})
        assert meta["kind"] == "user" and "not the SHA-256" in meta["message"]
        meta, _ = svc.run_closure({"closure_id": 4}, {"args": args})
        assert meta["kind"] == "user" and "fn_digest" in meta["message"]
        meta, _ = svc.run_closure({"closure_id": 5, "fn_digest": digest}, {"args": args},
                                  active=lambda: False)
        assert meta["kind"] == "cancelled"  # the coordinator gave up on it while it waited
        assert svc.functions_run == 2
    finally:
        set_current(None)


GLOBAL_SCALE = 2.0


def test_function_fingerprints_change_when_what_they_refer_to_is_rebound():
    from jaxdist._src.coordinator.worker_thread import _fingerprint, _same

    global GLOBAL_SCALE
    lr = 0.1

    def step(x):
        return x * lr * GLOBAL_SCALE

    first = _fingerprint(step)
    assert _same(first, _fingerprint(step))
    lr = 0.2  # rebinding a captured variable
    assert not _same(first, _fingerprint(step))
    second = _fingerprint(step)
    GLOBAL_SCALE = 3.0  # rebinding a global the function reads
    try:
        assert not _same(second, _fingerprint(step))
    finally:
        GLOBAL_SCALE = 2.0
    assert _fingerprint(print) is None and _fingerprint(np.add) is None
    assert _fingerprint(lambda: lr) is not None


def test_worker_service_runs_a_batch_in_order_each_closure_answered_alone():
    import hashlib
    import time

    svc = WorkerService(_runtime())
    try:
        def step(i):
            if i == 1:
                raise ValueError(f"closure {i} failed")
            return i * 10, time.monotonic_ns()

        raw = closure_pickle.dumps(step)
        digest = hashlib.sha256(raw).hexdigest()
        payload = to_bytes_array(raw)
        arrays = {"fn.0": payload}  # sent once, with the first closure; the others by digest
        for i in range(4):
            arrays[f"args.{i}"] = to_bytes_array(closure_pickle.dumps(((i,), {})))
        meta = {"closures": [{"closure_id": i, "fn_digest": digest} for i in range(4)]}
        answers = list(svc.run_closures(svc.batch_items(meta, arrays)))
        # In order; the error fails only its own closure, the ones after it still run.
        assert [m["ok"] for m, _ in answers] == [True, False, True, True]
        values = [answer_value(a) for m, a in answers
                  if m["ok"]]
        assert [v for v, _ in values] == [0, 20, 30]
        assert [t for _, t in values] == sorted(t for _, t in values)
        assert answers[1][0]["kind"] == "user" and "closure 1 failed" in answers[1][0]["message"]
        assert svc.functions_run == 3
        # A closure without its function (unknown digest) is refused alone, not the batch.
        meta = {"closures": [{"closure_id": 4, "fn_digest": "0" * 64},
                             {"closure_id": 5, "fn_digest": digest}]}
        answers = list(svc.run_closures(svc.batch_items(
            meta, {"args.0": arrays["args.0"], "args.1": arrays["args.2"]})))
        assert [m.get("kind") for m, _ in answers] == ["missing_function", None]
        # A cancelled call starts nothing more (and answers nothing: nobody is listening).
        for checks, ran in (([True, False], 0), ([True, True, False], 1)):
            state, before = iter(checks), svc.functions_run  # its turn, then each closure's
            answers = list(svc.run_closures(svc.batch_items(
                {"closures": [{"closure_id": 6, "fn_digest": digest}] * 2},
                {"args.0": arrays["args.0"], "args.1": arrays["args.2"]}),
                active=lambda state=state: next(state, False)))
            assert len(answers) == ran and svc.functions_run == before + ran
        for bad in ({"closures": []}, {"closures": "x"}, {"closures": [{"closure_id": 0}]},
                    {}, {"closures": [{}] * 65}):
            with pytest.raises(ValueError, match="RunClosures"):
                svc.batch_items(bad, {})
    finally:
        set_current(None)


def test_results_that_are_not_data_travel_pickled_only_for_a_trusting_chief(monkeypatch):
    from jaxdist._src.coordinator.answer_codec import TRUST_ENV, UntrustedPickleError
    from jaxdist._src.coordinator.worker_service import answer_value, value_arrays

    plain = {"loss": np.float32(1.5), "xs": [np.arange(3), (1, "a", None)], "b": b"x"}
    assert sorted(value_arrays(plain)) == ["data"]  # no pickle at all
    out = answer_value(value_arrays(plain))
    assert out["loss"] == 1.5 and out["xs"][0].tolist() == [0, 1, 2] and out["b"] == b"x"
    fn = lambda x: x + 1  # noqa: E731 - by value: only cloudpickle can send it
    monkeypatch.delenv(TRUST_ENV, raising=False)
    for value in ({"f": fn}, np.array([fn], dtype=object)):
        arrays = value_arrays(value)
        assert sorted(arrays) == ["data", "pickle"]
        with pytest.raises(UntrustedPickleError, match="worker:2"):
            answer_value(arrays, "worker:2")
    monkeypatch.setenv(TRUST_ENV, "1")
    assert answer_value(value_arrays({"f": fn}))["f"](1) == 2
    assert answer_value(value_arrays(np.array([fn], dtype=object)))[0](2) == 3


def test_numeric_results_go_as_raw_arrays_and_come_back_with_their_type():
    import ml_dtypes

    from jaxdist._src.coordinator.worker_service import RAW_VALUE_BYTES, answer_value, value_arrays

    fortran = np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3))
    raw = [np.asarray(np.float32(1.5)), fortran, np.arange(3)[::-1], np.float32(0.25),
           np.int64(-3), np.bool_(True), np.complex64(1 + 2j)]
    for value in raw:
        arrays = value_arrays(value)
        assert list(arrays) == ["scalar" if isinstance(value, np.generic) else "array"]
        got = answer_value({k: v.copy() for k, v in arrays.items()})
        assert type(got) is type(value) and got.dtype == value.dtype
        assert np.shape(got) == np.shape(value) and np.array_equal(got, value)
    # Everything else is pickled, and comes back as it was.
    pickled = [3, {"a": np.float32(1)}, np.zeros(2, ">f4"), np.array(["x"]),
               np.zeros(2, ml_dtypes.bfloat16), np.zeros(RAW_VALUE_BYTES // 8 + 1),
               np.ma.masked_array([1.0, 2.0], mask=[0, 1])]
    for value in pickled:
        arrays = value_arrays(value)
        assert list(arrays) == ["data"], type(value)
        got = answer_value(arrays)
        assert type(got) is type(value)
        if isinstance(value, np.ndarray):
            assert got.dtype == value.dtype.newbyteorder("<") and np.array_equal(got, value)
    # A raw value is copied out of the receive buffer (which is reused).
    buf = np.arange(4, dtype=np.float32)
    got = answer_value({"array": buf})
    buf[:] = 0
    assert got.tolist() == [0.0, 1.0, 2.0, 3.0] and got.flags.writeable


def test_the_answer_mac_covers_the_shape_of_each_array():
    from jaxdist._src.coordinator.signing import answer_mac

    def mac(arrays):
        return answer_mac(b"k" * 32, "worker:0", "RunClosures", "n/0", {"ok": True}, arrays)

    a = mac({"array": np.zeros((2, 3), np.float32)})
    assert a != mac({"array": np.zeros((3, 2), np.float32)})
    assert a != mac({"array": np.zeros(6, np.float32)})
    assert a == mac({"array": np.zeros((2, 3), np.float32)})


class _Clock:
    """A fake ``time.monotonic`` that closures advance."""

    def __init__(self):
        self.now = 100.0

    def monotonic(self):
        return self.now


def _timed_answers(clock, spec, wait=0.0, starts=None):
    """Answers of closures that take ``seconds`` each: ``(seconds, ok, nbytes)`` per one,
    after ``wait`` (the batch queued behind another); each start time goes to ``starts``."""
    clock.now += wait
    for i, (seconds, ok, nbytes) in enumerate(spec):
        if starts is not None:
            starts.append(clock.now)
        clock.now += seconds
        yield ({"ok": ok, "i": i}, {"array": np.full(nbytes // 4, i, np.float32)})


def test_answers_of_a_batch_share_messages_while_the_next_ones_end_soon(monkeypatch):
    from jaxdist._src.coordinator import worker_service as ws

    clock = _Clock()
    monkeypatch.setattr(ws, "time", clock)

    def frames(spec, group=8, hold=0.05, count=None):
        out = list(ws.group_answers(_timed_answers(clock, spec), count or len(spec), group,
                                    hold))
        for meta, arrays in out:  # each message splits back into its answers, in order
            split = ws.split_answers(meta, arrays, 64)
            assert [m for m, _ in split] == meta[ws.ANSWERS_KEY]
        return [[m["i"] for m in meta[ws.ANSWERS_KEY]] for meta, _ in out]

    fast = (0.005, True, 4)
    # Five 5 ms closures: one message; at most ``group`` answers to a message.
    assert frames([fast] * 5) == [[0, 1, 2, 3, 4]]
    assert frames([fast] * 5, group=2) == [[0, 1], [2, 3], [4]]
    # An error goes out at once, with the answers held before it.
    assert frames([fast, fast, (0.005, False, 0), fast, fast]) == [[0, 1, 2], [3, 4]]
    # So does a large result.
    assert frames([fast, (0.005, True, ws.GROUP_MAX_BYTES + 4), fast]) == [[0, 1], [2]]
    # Held only while the next closure, if it takes as long as the last, ends in time:
    # 20 ms closures and a 50 ms hold: three to a message (the first answer waits 40 ms,
    # a fourth would make it 60); 60 ms closures: each alone.
    assert frames([(0.02, True, 4)] * 5) == [[0, 1, 2], [3, 4]]
    assert frames([(0.06, True, 4)] * 3) == [[0], [1], [2]]
    assert frames([fast] * 4, hold=0.0) == [[0], [1], [2], [3]]
    # A batch that waited behind another: the wait is not its first closure's duration.
    starts: list[float] = []
    out = list(ws.group_answers(_timed_answers(clock, [fast] * 4, 0.5, starts), 4, 8, 0.05,
                                started=lambda: starts[-1]))
    assert [[m["i"] for m in meta[ws.ANSWERS_KEY]] for meta, _ in out] == [[0, 1, 2, 3]]
    out = list(ws.group_answers(_timed_answers(clock, [fast] * 4, 0.5), 4, 8, 0.05))  # no starts
    assert [[m["i"] for m in meta[ws.ANSWERS_KEY]] for meta, _ in out] == [[0], [1, 2, 3]]
    # The caller went away mid-batch (the batch stops): what ran is still answered.
    assert frames([fast] * 3, count=8) == [[0, 1, 2]]
    # Closing the messages closes the batch (its turn on the worker ends).
    closed = []

    def batch():
        try:
            yield from _timed_answers(clock, [fast] * 4)
        finally:
            closed.append(True)

    grouped = ws.group_answers(batch(), 4, 2, 0.05)
    next(grouped)
    grouped.close()
    assert closed == [True]
    # Answers of one array each, alike (a loss per closure): one stacked array "*.<name>".
    meta, arrays = next(ws.group_answers(_timed_answers(clock, [fast] * 3), 3, 8, 0.05))
    assert list(arrays) == ["*.array"] and arrays["*.array"].tolist() == [[0.0], [1.0], [2.0]]
    assert [a["array"].tolist() for _, a in ws.split_answers(meta, arrays, 3)] == [
        [0.0], [1.0], [2.0]]
    # Otherwise the arrays of answer j travel as "<j>.<name>".
    meta, arrays = next(ws.group_answers(_timed_answers(clock, [fast, (0.005, True, 8)]), 2,
                                         8, 0.05))
    assert sorted(arrays) == ["0.array", "1.array"] and arrays["1.array"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("meta, arrays", [
    ({}, {}),
    ({"answers": "x"}, {}),
    ({"answers": []}, {}),
    ({"answers": [{"ok": True}] * 3}, {}),  # more than the batch holds (2)
    ({"answers": [{"ok": True}, 5]}, {}),
    ({"answers": [{"ok": True}]}, {"1.array": np.zeros(1)}),
    ({"answers": [{"ok": True}]}, {"array": np.zeros(1)}),
    ({"answers": [{"ok": True}]}, {"x.array": np.zeros(1)}),
    ({"answers": [{"ok": True}] * 2}, {"*.array": np.zeros(3)}),
    ({"answers": [{"ok": True}]}, {"*.array": np.zeros(())}),
])
def test_a_malformed_group_of_answers_is_refused(meta, arrays):
    from jaxdist._src.coordinator.worker_service import split_answers

    with pytest.raises(ValueError, match="answers"):
        split_answers(meta, arrays, 2)


def test_arguments_of_per_worker_resources_go_as_ids_and_are_never_pickled(monkeypatch):
    import threading

    from jaxdist._src.coordinator.closure_queue import Closure, ClosureQueue
    from jaxdist._src.coordinator.health import WorkerState
    from jaxdist._src.coordinator.remote_value import PerWorkerValues
    from jaxdist._src.coordinator.resources import PerWorkerResources
    from jaxdist._src.coordinator.worker_thread import SenderSettings, WorkerThread

    settings = SenderSettings(num_workers=2, rpc_timeout=1.0, closure_timeout=1.0,
                              ps_rpc_timeout=1.0, join_timeout=1.0)
    w = WorkerThread(WorkerState(1, "worker:1"), ClosureQueue(), None, PerWorkerResources(),
                     settings, threading.Event())   # built, not started: no thread runs
    real, pickled = closure_pickle.dumps, []
    monkeypatch.setattr(closure_pickle, "dumps",
                        lambda obj, *a, **k: pickled.append(obj) or real(obj, *a, **k))

    def closure(*args, **kwargs):
        return Closure(len(pickled), abs, args, kwargs, RemoteValue())

    def parts(rid):
        return PerWorkerValues([closure_pickle.WorkerResource(rid + i, i) for i in range(2)])

    # Worker 1's part of each argument, by id: nothing pickled.
    assert w._arguments(closure(parts(3)), True) == (4,)
    assert w._arguments(closure(parts(3), closure_pickle.WorkerResource(9, 1)), True) == (4, 9)
    assert pickled == []
    # Anything else is pickled every time (a part missing for this worker: pickling raises).
    for args, kwargs in (((parts(3), 5), {}), ((), {}), ((parts(3),), {"x": parts(3)}),
                         ((PerWorkerValues([1, 2]),), {}),
                         ((closure_pickle.WorkerResource(0, 1),) * 17, {})):
        n = len(pickled)
        assert type(w._arguments(closure(*args, **kwargs), True)) is bytes
        assert len(pickled) == n + 1
    with pytest.raises(ValueError, match="PerWorkerValues has 1 parts, but worker 1"):
        w._arguments(closure(PerWorkerValues([closure_pickle.WorkerResource(0, 0)])), True)


def test_a_closure_whose_arguments_are_resources_looks_them_up_on_the_worker():
    import hashlib

    runtime = _runtime()
    svc = WorkerService(runtime)
    try:
        runtime.resources[3] = iter([10, 20])
        runtime.resources[5] = 7

        def step(it, k):
            return next(it) + k

        raw = closure_pickle.dumps(step)
        digest = hashlib.sha256(raw).hexdigest()
        meta = {"closures": [{"closure_id": i, "fn_digest": digest, "resources": [3, 5]}
                             for i in range(2)]}
        answers = list(svc.run_closures(svc.batch_items(meta, {"fn.0": to_bytes_array(raw)})))
        assert [answer_value(a) for _, a in answers] == [17, 27]
        # A resource this worker does not hold: missing_resource (the coordinator rebuilds).
        meta = {"closures": [{"closure_id": 2, "fn_digest": digest, "resources": [4, 5]}]}
        (answer, _), = svc.run_closures(svc.batch_items(meta, {}))
        assert answer["kind"] == "missing_resource"
        for bad in ([], "3", [3.0], [True], [1] * 17, None):
            meta = {"closures": [{"closure_id": 0, "fn_digest": digest, "resources": bad}]}
            with pytest.raises(ValueError, match="'resources' must be a list"):
                svc.batch_items(meta, {})
    finally:
        set_current(None)


def test_a_second_batch_waits_for_the_whole_first_one():
    import threading

    svc = WorkerService(_runtime())
    try:
        payload = to_bytes_array(closure_pickle.dumps(lambda i: i))
        args = [to_bytes_array(closure_pickle.dumps(((i,), {}))) for i in range(4)]

        def batch(first):
            return svc.batch_items({"closures": [{"closure_id": first}, {"closure_id": first + 1}]},
                                   {"fn.0": payload, "fn.1": payload,
                                    "args.0": args[first], "args.1": args[first + 1]})

        a = svc.run_closures(batch(0))
        assert next(a)[0]["ok"]  # the first batch is between its two closures
        got = []
        b = threading.Thread(target=lambda: got.extend(svc.run_closures(batch(2))))
        b.start()
        b.join(0.3)
        assert b.is_alive() and not got  # the second batch does not cut in
        assert next(a)[0]["ok"] and next(a, None) is None
        b.join(10)
        assert len(got) == 2 and svc.functions_run == 4
        # A batch whose caller went away while it waited starts nothing.
        c = svc.run_closures(batch(0))
        next(c)
        assert list(svc.run_closures(batch(2), active=lambda: False)) == []
        c.close()  # closing a batch mid-way (gRPC drops the call) lets the next one run
        assert len(list(svc.run_closures(batch(2)))) == 2
    finally:
        set_current(None)


def test_numbered_batches_of_a_session_run_in_their_order():
    import threading
    import time

    from jaxdist._src.coordinator import worker_service

    svc = WorkerService(_runtime())
    try:
        payload = to_bytes_array(closure_pickle.dumps(lambda i: (i, time.monotonic_ns())))

        def batch(i):
            return svc.batch_items({"closures": [{"closure_id": i}]},
                                   {"fn.0": payload,
                                    "args.0": to_bytes_array(closure_pickle.dumps(((i,), {})))})

        got = {}

        def run(i, seq, session="s1"):
            got[i] = [answer_value(a)
                      for _, a in svc.run_closures(batch(i), session=session, seq=seq)]

        assert run(0, 0) is None and got[0][0][0] == 0
        # Call 2 arrives before call 1: it waits for it, then runs after it.
        late = threading.Thread(target=run, args=(2, 2))
        late.start()
        time.sleep(0.1)
        assert late.is_alive() and 2 not in got
        run(1, 1)
        late.join(10)
        assert got[1][0][1] < got[2][0][1]
        # Another session is not held up by this one's numbering; a number whose
        # predecessor never comes runs after the grace period.
        run(3, 7, session="s2")
        t0 = time.monotonic()
        run(4, 9, session="s2")
        assert time.monotonic() - t0 >= worker_service.ORDER_GRACE_SECONDS * 0.9
        assert [got[i][0][0] for i in range(5)] == [0, 1, 2, 3, 4]
    finally:
        set_current(None)
