"""Only the chief can run code on a worker, and a worker cannot answer in another's name
(issue 27, point 1).

Two worker services run in this process (``worker:0`` and ``worker:1`` on 127.0.0.1, test
PKI); the test plays the chief, and an attacker that holds everything ``worker:1`` holds: its
public key and answer key, the cluster token, a certificate of the cluster CA, and every
request the chief sent it (captured off the wire, as the worker process sees them).
No JAX, no devices: the closures are plain Python.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time

import cloudpickle
import grpc
import numpy as np
import pytest
from coordinator_util import in_process_worker

from jaxdist._src.coordinator.errors import WorkerAuthenticationError, WorkerUnavailableError
from jaxdist._src.coordinator.signing import (
    AUTH_METADATA_KEY,
    ENV_CLOCK_SKEW,
    ENV_MAX_AGE,
    MAC_KEY,
    ReplayGuard,
    RequestSigner,
    RequestVerifier,
    answer_mac,
    body_digest,
)
from jaxdist._src.coordinator.worker_client import WorkerClient
from jaxdist._src.coordinator.worker_service import SERVICE_NAME, answer_value, to_bytes_array
from jaxdist._src.security.credentials import CoordinatorKeys, new_coordinator_token
from jaxdist._src.transport import direct, wire
from jaxdist._src.transport.grpc_util import CHANNEL_OPTIONS, ChunkStubs, open_channels
from jaxdist.testing.tls import process_pki

TOKEN = new_coordinator_token()


def add_one(x: int) -> int:
    return x + 1


@pytest.fixture()
def workers():
    servers = [in_process_worker(index=i, token=TOKEN, direct_transport=False)[0]
               for i in range(2)]
    yield servers
    for s in servers:
        s.stop(0)


def _chief(servers, **kwargs) -> WorkerClient:
    kwargs.setdefault("direct_transport", False)
    return WorkerClient([s.address for s in servers], TOKEN,
                        tls=process_pki().identities["client"], **kwargs)


class _Wire:
    """What crosses the wire from the chief: every gRPC request's chunks and metadata."""

    def __init__(self, client: WorkerClient):
        self.sent: list[tuple[int, str, list[bytes], tuple]] = []
        real = client._stubs

        def spy(task, method, chunks, **kwargs):
            chunks = list(chunks)
            self.sent.append((task, method, chunks, kwargs.get("metadata", ())))
            return real(task, method, iter(chunks), **kwargs)

        client._stubs = spy

    def last(self, task: int, method: str):
        return [s for s in self.sent if s[0] == task and s[1] == method][-1]


def _batch(fn, x) -> tuple[dict, dict]:
    return ({"closures": [{"closure_id": 0}]},
            {"args.0": to_bytes_array(cloudpickle.dumps(((x,), {}))),
             "fn.0": to_bytes_array(cloudpickle.dumps(fn))})


def _run(client: WorkerClient, task: int, x: int) -> int:
    (meta, arrays), = client.call_stream(task, "RunClosures", *_batch(add_one, x), timeout=10)
    assert meta["ok"], meta
    return answer_value(arrays)


def _send_as_attacker(server, method: str, chunks: list[bytes], metadata) -> list[bytes]:
    """Sends raw request bytes to ``server`` with a certificate of the cluster CA."""
    channels = open_channels([server.address], process_pki().identities["task"], "worker",
                             CHANNEL_OPTIONS)
    try:
        return list(ChunkStubs(channels, SERVICE_NAME)(0, method, iter(chunks), timeout=10,
                                                       metadata=metadata))
    finally:
        channels[0].close()


def _refused(server, method, chunks, metadata) -> grpc.RpcError:
    before = server.service.functions_run
    with pytest.raises(grpc.RpcError) as err:
        _send_as_attacker(server, method, chunks, metadata)
    assert server.service.functions_run == before  # nothing ran
    return err.value


def test_a_request_captured_at_one_worker_is_refused_by_another(workers):
    chief = _chief(workers)
    spy = _Wire(chief)
    assert _run(chief, 1, 41) == 42  # the chief runs a closure on worker:1
    _, _, chunks, metadata = spy.last(1, "RunClosures")
    err = _refused(workers[0], "RunClosures", chunks, metadata)  # worker:1 replays it
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "signature does not match" in err.details()
    # Neither the captured Ping nor a signed request with another body (the signature
    # covers the body) gets through.
    _, _, ping, ping_meta = spy.last(1, "Ping")
    assert _refused(workers[0], "Ping", ping, ping_meta).code() == \
        grpc.StatusCode.UNAUTHENTICATED
    meta, _ = wire.decode(iter(chunks))
    evil = list(wire.encode(meta, _batch(print, "pwned")[1]))
    err = _refused(workers[1], "RunClosures", evil, metadata)
    assert "signature does not match" in err.details()
    assert _run(chief, 0, 1) == 2 and _run(chief, 1, 2) == 3  # the chief still can
    chief.close()


def test_a_replayed_request_is_refused(workers):
    chief = _chief(workers)
    spy = _Wire(chief)
    assert _run(chief, 1, 41) == 42
    _, _, chunks, metadata = spy.last(1, "RunClosures")
    err = _refused(workers[1], "RunClosures", chunks, metadata)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "already used (a replayed request)" in err.details()
    chief.close()


def test_a_request_signed_for_a_previous_incarnation_is_refused(workers):
    chief = _chief(workers)
    spy = _Wire(chief)
    assert _run(chief, 1, 41) == 42
    _, _, chunks, metadata = spy.last(1, "RunClosures")
    port = workers[1].address.rsplit(":", 1)[1]
    workers[1].stop(0)  # worker:1 restarts on the same port: it forgot every counter
    workers[1] = in_process_worker(index=1, token=TOKEN, direct_transport=False,
                                   address=f"127.0.0.1:{port}")[0]
    err = _refused(workers[1], "RunClosures", chunks, metadata)
    assert err.code() == grpc.StatusCode.ABORTED and "worker restarted" in err.details()
    # The chief's next call fails the same way (it did not know); the one after pings first.
    with pytest.raises(WorkerUnavailableError, match="worker:1 .* restarted"):
        _run(chief, 1, 1)
    assert _run(chief, 1, 5) == 6
    chief.close()


def test_nothing_a_worker_holds_lets_it_run_code_on_another(workers):
    keys = CoordinatorKeys(TOKEN)
    held = {"public key": keys.public_key, "its answer key": keys.answer_key("worker:1").hex(),
            "cluster token": "t0k"}  # what worker:1's process holds (and its certificate)
    for what, secret in held.items():
        attacker = WorkerClient([workers[0].address], secret,
                                tls=process_pki().identities["task"], direct_transport=False)
        with pytest.raises(WorkerAuthenticationError, match="signature does not match"):
            print("worker:1 signs with", what)
            _run(attacker, 0, 1)
        attacker.close()
    # Nor a request "signed" with its answer key in place of the chief's signature.
    meta, arrays = _batch(add_one, 1)
    forged = {"s": "x", "t": time.time_ns(), "n": 1, "at": time.time_ns(),
              "i": workers[0].service.incarnation,
              "sig": hmac.new(keys.answer_key("worker:1"), b"RunClosures",
                              hashlib.sha512).hexdigest()}
    err = _refused(workers[0], "RunClosures", list(wire.encode({**meta, "nonce": "n"}, arrays)),
                   ((AUTH_METADATA_KEY, json.dumps(forged)),))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "signature does not match" in err.details()
    assert workers[0].service.functions_run == 0


def test_the_coordinator_token_never_reaches_a_worker(workers, monkeypatch):
    frames = []
    real_send = direct.send_frame
    monkeypatch.setattr(direct, "send_frame", lambda sock, kind, header, *a, **k: (
        frames.append(json.dumps(header)), real_send(sock, kind, header, *a, **k))[1])
    for use_direct in (False, True):
        for s in workers:
            s.stop(0)
        workers[:] = [in_process_worker(index=i, token=TOKEN, direct_transport=use_direct)[0]
                      for i in range(2)]
        chief = _chief(workers, direct_transport=use_direct)
        spy = _Wire(chief)
        assert [_run(chief, t, 1) for t in (0, 1)] == [2, 2]
        assert chief.direct_calls == (2 if use_direct else 0)
        chief.close()
        sent = b"".join(b"".join(c) + repr(m).encode() for _, _, c, m in spy.sent)
        sent += "".join(frames).encode()
        for secret in (TOKEN, hashlib.sha256(TOKEN.encode()).hexdigest()):
            assert secret.encode() not in sent


def test_a_forged_or_altered_answer_is_refused(workers):
    chief = _chief(workers)
    chief.call(0, "Ping", timeout=5)
    keys = CoordinatorKeys(TOKEN)
    meta = {"ok": True, "task": "worker:0", "incarnation": workers[0].service.incarnation}
    arrays = {"scalar": np.array(42, np.int64)}

    def check(meta, arrays, key=None, nonce="n/0"):
        key = key or keys.answer_key("worker:0")
        macd = {**meta, MAC_KEY: answer_mac(key, "worker:0", "RunClosures", nonce, meta,
                                            arrays)}
        chief._check_mac(0, "RunClosures", "n/0", macd, dict(arrays))

    check(meta, arrays)  # the real worker:0's answer passes
    with pytest.raises(WorkerAuthenticationError, match="worker:0's MAC"):
        check(meta, arrays, key=keys.answer_key("worker:1"))  # worker:1 answering for it
    with pytest.raises(WorkerAuthenticationError):
        check(meta, arrays, nonce="n/1")  # another message's (or call's) answer
    # Every field is covered: an answer MAC'd as one thing and delivered as another fails.
    for altered in ({**meta, "ok": False}, {**meta, "kind": "user"},
                    {**meta, "incarnation": "x"}, {**meta, "task": "worker:1"},
                    {k: v for k, v in meta.items() if k != "task"}):
        macd = {**meta, MAC_KEY: answer_mac(keys.answer_key("worker:0"), "worker:0",
                                            "RunClosures", "n/0", meta, arrays)}
        macd.update(altered)
        for key in set(meta) - set(altered):
            macd.pop(key)
        with pytest.raises(WorkerAuthenticationError):
            chief._check_mac(0, "RunClosures", "n/0", macd, dict(arrays))
    good = {**meta, MAC_KEY: answer_mac(keys.answer_key("worker:0"), "worker:0",
                                        "RunClosures", "n/0", meta, arrays)}
    with pytest.raises(WorkerAuthenticationError):
        chief._check_mac(0, "RunClosures", "n/0", dict(good),
                         {"scalar": np.array(43, np.int64)})
    with pytest.raises(WorkerAuthenticationError):  # another worker's method/answer
        chief._check_mac(0, "Ping", "n/0", dict(good), dict(arrays))
    chief.close()


def test_the_replay_guard_accepts_each_counter_once_within_its_window():
    g = ReplayGuard(window=8, max_sessions=2)
    assert [g.admit("a", 10, n) for n in (1, 3, 2)] == [None] * 3  # out of order is fine
    assert "already used" in g.admit("a", 10, 2)
    assert g.admit("a", 10, 20) is None
    assert "too old" in g.admit("a", 10, 5)  # below the window: it may have been used
    assert "another start time" in g.admit("a", 11, 21)
    assert g.admit("b", 12, 1) is None and g.admit("c", 13, 1) is None  # "a" is forgotten
    assert "forgotten" in g.admit("a", 10, 21)  # and cannot come back
    assert "forgotten" in g.admit("z", 9, 1)  # nor an older session
    assert g.admit("b", 12, 2) is None  # the kept ones go on


# ------------------------------------------------------------ signed requests expire
SECOND = 10**9


def _captured(chief: WorkerClient, task: int, x: int):
    """A ``RunClosures`` request the chief signed for worker ``task`` now and that an attacker
    took off the wire before it arrived: ``(chunks, metadata)``."""
    chief.call(task, "Ping", timeout=5)  # the chief learns the worker's incarnation
    meta, arrays = _batch(add_one, x)
    signed = {**meta, "nonce": "n"}
    auth = chief._signer.sign(task, chief._incarnations[task], "RunClosures", signed, arrays)
    return list(wire.encode(signed, arrays)), ((AUTH_METADATA_KEY, json.dumps(auth)),)


def _later(verifier, seconds: float):
    """The worker's clock as if ``seconds`` had passed since now."""
    verifier.clock = lambda: time.time_ns() + int(seconds * SECOND)


def test_a_request_relayed_after_its_max_age_is_refused_and_inside_it_accepted(workers):
    chief = _chief(workers)
    chunks, metadata = _captured(chief, 1, 41)
    verifier = workers[1]._verifier
    assert (verifier.max_age, verifier.clock_skew) == (300.0, 30.0)  # the defaults
    _later(verifier, 300 + 30 + 2)  # relayed 332 s after the chief signed it
    err = _refused(workers[1], "RunClosures", chunks, metadata)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "signed 332." in err.details() and "before it arrived" in err.details()
    assert "a delayed or relayed request" in err.details()
    _later(verifier, 300 + 30 - 5)  # the same bytes, delivered within the max age + skew
    out = wire.decode(iter(_send_as_attacker(workers[1], "RunClosures", chunks, metadata)))
    assert out[0]["ok"] and answer_value(out[1]) == 42
    chief.close()


def test_a_request_from_the_future_beyond_the_clock_skew_is_refused(workers):
    chief = _chief(workers)
    chief.call(0, "Ping", timeout=5)
    chief._signer.clock = lambda: time.time_ns() + 20 * SECOND  # the chief's clock is ahead
    assert _run(chief, 0, 1) == 2  # within the 30 s skew
    chief._signer.clock = lambda: time.time_ns() + 45 * SECOND
    before = workers[0].service.functions_run
    with pytest.raises(WorkerAuthenticationError, match=r"signed 4\d\.\d s in the future"):
        _run(chief, 0, 1)
    assert workers[0].service.functions_run == before
    chief._signer.clock = time.time_ns
    assert _run(chief, 0, 3) == 4  # the chief goes on once its clock is right
    chief.close()


def test_the_max_age_and_skew_come_from_the_environment(workers, monkeypatch):
    monkeypatch.setenv(ENV_MAX_AGE, "5")
    monkeypatch.setenv(ENV_CLOCK_SKEW, "1")
    server = in_process_worker(index=1, token=TOKEN, direct_transport=False)[0]
    try:
        chief = _chief([workers[0], server])
        chunks, metadata = _captured(chief, 1, 1)
        _later(server._verifier, 7)
        err = _refused(server, "RunClosures", chunks, metadata)
        assert "more than the 5 s a request may take (+ 1 s clock skew)" in err.details()
        _later(server._verifier, 5.5)
        out = wire.decode(iter(_send_as_attacker(server, "RunClosures", chunks, metadata)))
        assert answer_value(out[1]) == 2
        chief.close()
    finally:
        server.stop(0)
    monkeypatch.setenv(ENV_MAX_AGE, "soon")
    with pytest.raises(ValueError, match=f"{ENV_MAX_AGE}='soon': expected a number of seconds"):
        in_process_worker(index=1, token=TOKEN, direct_transport=False)


def test_the_age_bound_is_exact_and_covers_every_signed_method():
    keys = CoordinatorKeys(TOKEN)
    signer = RequestSigner(keys, ["worker:0"])
    verifier = RequestVerifier(keys.worker_credential("worker:0"), "worker:0", "inc",
                               max_age=10, clock_skew=2)
    now = time.time_ns()
    signer.clock = lambda: now
    digest = body_digest({}, {})
    for method in ("RunClosures", "Connect", "Ping", "CreateResource", "Stop"):
        at_bound = signer.sign_digest(0, "inc", method, digest)
        assert verifier.check(method, at_bound, digest, arrived=now + 12 * SECOND) is None
        late = signer.sign_digest(0, "inc", method, digest)
        refusal = verifier.check(method, late, digest, arrived=now + 12 * SECOND + 1)
        assert refusal.code == "UNAUTHENTICATED" and "before it arrived" in refusal.details
        early = signer.sign_digest(0, "inc", method, digest)
        refusal = verifier.check(method, early, digest, arrived=now - 2 * SECOND - 1)
        assert "in the future" in refusal.details
    # The issue time is signed: moving it into the window breaks the signature.
    late = signer.sign_digest(0, "inc", "RunClosures", digest)
    moved = {**late, "at": now + 11 * SECOND}
    refusal = verifier.check("RunClosures", moved, digest, arrived=now + 20 * SECOND)
    assert "signature does not match" in refusal.details
    without = {k: v for k, v in late.items() if k != "at"}
    assert "no well-formed" in verifier.check("RunClosures", without, digest).details


# ------------------------------------------------------------ nor through its own answers
CALLS: list[str] = []


def _record(what: str) -> str:
    CALLS.append(what)
    return what


class _Evil:
    """What a compromised worker returns: a pickle that calls a function when loaded."""

    def __reduce__(self):
        return _record, ("code ran on the chief",)


def evil(_: int) -> _Evil:
    return _Evil()


def test_a_workers_answer_cannot_run_code_on_the_chief(workers, monkeypatch):
    from jaxdist._src.coordinator.answer_codec import TRUST_ENV, UntrustedPickleError

    monkeypatch.delenv(TRUST_ENV, raising=False)
    CALLS.clear()
    chief = _chief(workers)
    (meta, arrays), = chief.call_stream(0, "RunClosures", *_batch(evil, 0), timeout=10)
    assert meta["ok"] and "pickle" in arrays  # the worker's own, correctly MAC'd answer
    with pytest.raises(UntrustedPickleError, match=r"worker:0.*test_coordinator_signing\._Evil"):
        answer_value(arrays, "worker:0")
    assert CALLS == []
    monkeypatch.setenv(TRUST_ENV, "1")  # trusting every worker: the same bytes run code
    assert answer_value(arrays) == "code ran on the chief" and CALLS == [
        "code ran on the chief"]
    chief.close()


def test_an_exception_from_a_worker_is_built_only_from_data(monkeypatch):
    import pickle

    from jaxdist._src.coordinator.answer_codec import TRUST_ENV
    from jaxdist._src.coordinator.errors import RemoteError
    from jaxdist._src.coordinator.worker_service import error_arrays
    from jaxdist._src.coordinator.worker_thread import remote_exception

    monkeypatch.delenv(TRUST_ENV, raising=False)
    CALLS.clear()
    meta = {"task": "worker:1", "type": "ValueError", "message": "m", "traceback": "tb"}
    for arrays in ({"error": to_bytes_array(pickle.dumps(_Evil()))},  # a pickle: not decoded
                   {"error_pickle": to_bytes_array(pickle.dumps(_Evil()))}):  # not trusted
        error = remote_exception(meta, arrays, "worker:1")
        assert isinstance(error, RemoteError) and CALLS == []
        assert error.task == "worker:1"
    error = remote_exception(meta, error_arrays(KeyError("k")), "worker:1")
    assert type(error) is KeyError and error.args == ("k",)
    error = remote_exception(meta, error_arrays(FileNotFoundError(2, "gone", "/f")))
    assert type(error) is FileNotFoundError and error.filename == "/f"
    # Neither SystemExit nor a type of another module is rebuilt on the chief.
    for e in (SystemExit(3), _Bad("x")):
        error = remote_exception(meta, error_arrays(e), "worker:1")
        assert type(error) is RemoteError and type(e).__name__ in str(error)


class _Bad(Exception):
    pass


def test_plain_results_come_back_unchanged():
    import collections

    import ml_dtypes

    from jaxdist._src.coordinator.answer_codec import UntrustedPickleError
    from jaxdist._src.coordinator.worker_service import value_arrays

    values = [np.arange(6, dtype=np.float32).reshape(2, 3), np.float16(1.5), np.int64(-3),
              np.zeros(2, ml_dtypes.bfloat16), np.array(["ab"]), np.array([b"xy"]),
              np.datetime64("2020-01-02"), np.dtype("float16"),
              np.zeros((0, 3)), collections.OrderedDict(a=1),
              {"x": [1, (2.5, 3j)], "s": {1}, "b": b"\0", 7: None}, 10**40, frozenset({1}),
              bytearray(b"x"), slice(1, 2), range(3), None, True, "s"]
    for value in values:
        got = answer_value(value_arrays(value), "worker:0")
        assert type(got) is type(value) and repr(got) == repr(value)
    big = answer_value(value_arrays(np.arange(3).astype(">i4")))  # arrives little-endian
    assert big.dtype == np.dtype("<i4") and big.tolist() == [0, 1, 2]
    masked = np.ma.masked_array([1.0, 2.0], mask=[0, 1])
    got = answer_value(value_arrays(masked))
    assert type(got) is np.ma.MaskedArray and got.mask.tolist() == [False, True]
    # Pointer-bearing and structured dtypes have no form: refused, naming the worker.
    for value in (np.array([1, "a", None], object), np.dtype([("a", "<f4")]),
                  np.rec.fromrecords([(1, 2.0)], names="a,b")):
        with pytest.raises(UntrustedPickleError, match="worker:1"):
            answer_value(value_arrays(value), "worker:1")
