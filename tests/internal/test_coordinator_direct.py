"""The workers' direct transport for ``RunClosures`` (``jaxdist._src.transport.direct`` frames on a
second port): the same answers and MACs as gRPC, the chief's signed credential checked on connect,
cancellation seen by the worker, malformed requests refused, and the switch to turn it off.

The worker runs in this process (a ``WorkerServer`` on 127.0.0.1 with the test PKI), so the
closures are module-level functions pickled by reference.
"""

from __future__ import annotations

import hashlib
import json
import socket
import ssl
import threading
import time

import pytest
from coordinator_util import in_process_worker

from jaxdist._src.coordinator import closure_pickle
from jaxdist._src.coordinator.errors import (
    CoordinatorError,
    WorkerAuthenticationError,
    WorkerUnavailableError,
)
from jaxdist._src.coordinator.signing import CONNECT_METHOD, RequestSigner, body_digest
from jaxdist._src.coordinator.worker_client import WorkerClient
from jaxdist._src.coordinator.worker_service import (
    ENV_DIRECT,
    GROUP_KEY,
    answer_value,
    to_bytes_array,
)
from jaxdist._src.security.credentials import CoordinatorKeys
from jaxdist._src.transport import direct
from jaxdist.testing.tls import process_pki

RAN: list[int] = []


def times_ten(i: int) -> int:
    return i * 10


def slow(i: int) -> int:
    time.sleep(0.3)
    RAN.append(i)
    return i


def jax_results(i: int):
    import jax.numpy as jnp

    x = jnp.arange(3, dtype=jnp.float32) * i
    return x.sum() if i == 0 else {"sum": x.sum(), "x": x, "n": i}


def fails(i: int) -> int:
    raise ValueError(f"closure {i} failed on purpose")


@pytest.fixture()
def worker():
    server, token = in_process_worker()
    yield server, token
    server.stop(0)


def _client(server, token, **kwargs) -> WorkerClient:
    return WorkerClient([server.address], token, tls=process_pki().identities["client"],
                        **kwargs)


@pytest.fixture()
def client(worker):
    """A client of ``worker`` over the default transports."""
    c = _client(*worker)
    yield c
    c.close()


def _run(client: WorkerClient, fn, args: list[int], timeout: float = 30.0) -> list:
    """The values (or failure kinds) of ``fn(a)`` for each ``a``, in one RunClosures call."""
    meta, arrays = _batch(fn, args)
    return _values(client.call_stream(0, "RunClosures", meta, arrays, timeout=timeout))


def _batch(fn, args: list[int]) -> tuple[dict, dict]:
    raw = closure_pickle.dumps(fn)
    digest = hashlib.sha256(raw).hexdigest()
    arrays = {"fn.0": to_bytes_array(raw)}
    for i, a in enumerate(args):
        arrays[f"args.{i}"] = to_bytes_array(closure_pickle.dumps(((a,), {})))
    meta = {"closures": [{"closure_id": i, "fn_digest": digest} for i in range(len(args))]}
    return meta, arrays


def _values(answers) -> list:
    return [answer_value(a) if m["ok"] else m["kind"] for m, a in answers]


@pytest.mark.parametrize("use_direct", [True, False], ids=["direct", "grpc"])
def test_run_closures_answers_the_same_on_both_transports(worker, use_direct):
    server, token = worker
    client = _client(server, token, direct_transport=use_direct)
    try:
        meta, arrays = _batch(times_ten, [1, 2, 3])
        answers = list(client.call_stream(0, "RunClosures", meta, arrays, timeout=30.0))
        assert _values(answers) == [10, 20, 30]
        assert all("mac" not in m for m, _ in answers)  # checked and removed by the client
        assert client.direct_calls == (1 if use_direct else 0)
        # A failing closure fails alone, with its typed answer, on either transport.
        meta, arrays = _batch(fails, [7, 8])
        answers = list(client.call_stream(0, "RunClosures", meta, arrays, timeout=30.0))
        assert [m["kind"] for m, _ in answers] == ["user", "user"]
        assert "closure 7 failed on purpose" in answers[0][0]["message"]
        # The connection is reused: one connection served both calls.
        if use_direct:
            assert client.direct_calls == 2 and len(client._direct._idle[0]) == 1
    finally:
        client.close()


@pytest.mark.parametrize("use_direct", [True, False], ids=["direct", "grpc"])
def test_a_batch_asked_to_group_its_answers_sends_fewer_messages(worker, use_direct,
                                                                monkeypatch):
    import numpy as np

    from jaxdist._src.coordinator import worker_service

    # Timing aside (the hold rule has its unit test): every answer may wait for the next.
    monkeypatch.setattr(worker_service, "GROUP_HOLD_SECONDS", 60.0)
    server, token = worker
    client = _client(server, token, direct_transport=use_direct)
    messages = []
    split = client._split

    def counting(task, method, index, meta, arrays):
        messages.append(index)
        return split(task, method, index, meta, arrays)

    client._split = counting
    try:
        meta, arrays = _batch(times_ten, [1, 2, 3, 4])
        meta[GROUP_KEY] = 4
        assert _values(client.call_stream(0, "RunClosures", meta, arrays, timeout=30.0)) == [
            10, 20, 30, 40]
        assert messages == [0]  # one message, one MAC, four answers
        # Losses (0-d float32 arrays) travel stacked and come back as they were.
        messages.clear()
        meta, arrays = _batch(jax_results, [0, 0, 0])
        meta[GROUP_KEY] = 3
        losses = _values(client.call_stream(0, "RunClosures", meta, arrays, timeout=30.0))
        assert messages == [0] and len(losses) == 3
        assert all(type(x) is np.ndarray and x.shape == () and x.dtype == np.float32
                   for x in losses)
        # Without the key: one message per closure, as before.
        messages.clear()
        meta, arrays = _batch(times_ten, [1, 2])
        assert _values(client.call_stream(0, "RunClosures", meta, arrays, timeout=30.0)) == [
            10, 20]
        assert messages == [0, 1]
        # An error goes out at once with the answers before it; the rest follow.
        messages.clear()
        meta, arrays = _batch(fails, [1, 2])
        meta[GROUP_KEY] = 2
        assert _values(client.call_stream(0, "RunClosures", meta, arrays, timeout=30.0)) == [
            "user", "user"]
        assert messages == [0, 1]
        for bad in (0, 65, "2", True):
            meta, arrays = _batch(times_ten, [1])
            meta[GROUP_KEY] = bad
            with pytest.raises(CoordinatorError, match="INVALID_ARGUMENT.*group"):
                list(client.call_stream(0, "RunClosures", meta, arrays, timeout=5.0))
        # A message that does not split into the batch's answers is refused.
        with pytest.raises(WorkerUnavailableError, match="not a well-formed group"):
            client._split(0, "RunClosures", 0, {"answers": [{}]}, {"7.array": None})
    finally:
        client.close()


@pytest.mark.parametrize("use_direct", [True, False], ids=["direct", "grpc"])
def test_jax_results_come_back_as_numpy_arrays(worker, use_direct):
    import numpy as np

    client = _client(*worker, direct_transport=use_direct)
    try:
        scalar, tree = _run(client, jax_results, [0, 2])
        assert client.direct_calls == (1 if use_direct else 0)
    finally:
        client.close()
    assert type(scalar) is np.ndarray and scalar.shape == () and scalar.dtype == np.float32
    assert float(scalar) == 0.0
    assert type(tree["sum"]) is np.ndarray and float(tree["sum"]) == 6.0
    np.testing.assert_array_equal(tree["x"], np.array([0.0, 2.0, 4.0], np.float32))
    assert tree["n"] == 2


def test_the_ping_answer_names_the_direct_port(worker, client):
    server = worker[0]
    meta, _ = client.call(0, "Ping", timeout=5.0)
    assert meta["direct_port"] == server.direct.port != int(server.address.split(":")[1])


def _raw_direct(server) -> ssl.SSLSocket:
    tls = process_pki().identities["client"]
    sock = socket.create_connection(("127.0.0.1", server.direct.port), timeout=5.0)
    return direct.client_context(tls).wrap_socket(sock, server_hostname="127.0.0.1")


def _connect_credential(server, token: str, task: str = "worker:0") -> dict:
    signer = RequestSigner(CoordinatorKeys(token), [task])
    return signer.sign_digest(0, server.service.incarnation, CONNECT_METHOD, body_digest({}, {}))


@pytest.mark.parametrize("presented", ["s3cr3t-guess", "", None, "t0k", "the-token",
                                       "other-key", "other-task", "run-closures"],
                         ids=["wrong", "empty", "missing", "cluster-token", "coordinator-token",
                              "other-key", "other-task", "not-connect"])
def test_the_direct_port_wants_the_chiefs_signed_credential(worker, presented):
    server, token = worker
    if presented == "the-token":  # the raw token is not a credential (and is never sent)
        presented = token
    elif presented == "other-key":
        presented = _connect_credential(server, "another chief's token")
    elif presented == "other-task":  # what the chief gave worker:1, presented to worker:0
        presented = _connect_credential(server, token, "worker:1")
    elif presented == "run-closures":
        presented = RequestSigner(CoordinatorKeys(token), ["worker:0"]).sign_digest(
            0, server.service.incarnation, "RunClosures", body_digest({}, {}))
    sock = _raw_direct(server)
    try:
        direct.recv_frame(sock, direct.HELLO, direct.MAX_HANDSHAKE_BYTES, 0,
                          time.monotonic() + 5, None)
        direct.send_frame(sock, direct.AUTH, {} if presented is None else {"token": presented})
        reply, _ = direct.recv_frame(sock, direct.RESPONSE, direct.MAX_HANDSHAKE_BYTES, 0,
                                     time.monotonic() + 5, None)
        assert reply["code"] == "UNAUTHENTICATED" and reply.get("close")
        assert "coordinator credential" in reply["details"] or \
            "coordinator signature" in reply["details"], reply
        if isinstance(presented, str) and presented:
            assert presented not in reply["details"]  # never echoed
        assert sock.recv(1) == b""  # and the connection is closed
    finally:
        sock.close()


def test_a_connection_credential_is_used_once(worker):
    server, token = worker
    credential = _connect_credential(server, token)
    _authenticated(server, credential).close()
    sock = _raw_direct(server)
    try:  # the same credential again (captured and replayed): refused
        direct.recv_frame(sock, direct.HELLO, direct.MAX_HANDSHAKE_BYTES, 0,
                          time.monotonic() + 5, None)
        direct.send_frame(sock, direct.AUTH, {"token": credential})
        reply, _ = direct.recv_frame(sock, direct.RESPONSE, direct.MAX_HANDSHAKE_BYTES, 0,
                                     time.monotonic() + 5, None)
        assert reply["code"] == "UNAUTHENTICATED" and "already used" in reply["details"]
    finally:
        sock.close()


def _authenticated(server, credential) -> ssl.SSLSocket:
    if isinstance(credential, str):  # the coordinator token: sign a fresh credential
        credential = _connect_credential(server, credential)
    sock = _raw_direct(server)
    direct.recv_frame(sock, direct.HELLO, direct.MAX_HANDSHAKE_BYTES, 0, time.monotonic() + 5,
                      None)
    direct.send_frame(sock, direct.AUTH, {"token": credential})
    reply, _ = direct.recv_frame(sock, direct.RESPONSE, direct.MAX_HANDSHAKE_BYTES, 0,
                                 time.monotonic() + 5, None)
    assert reply["code"] == "OK", reply
    return sock


def test_a_20_gib_request_is_refused_before_allocating(worker, monkeypatch):
    from jaxdist._src.transport.memory import RECEIVE_POOL

    server, token = worker
    taken = []
    real = RECEIVE_POOL.take
    monkeypatch.setattr(RECEIVE_POOL, "take", lambda n: (taken.append(n), real(n))[1])
    sock = _authenticated(server, token)
    try:
        head = json.dumps({"method": "RunClosures", "meta": {}, "arrays": []}).encode()
        sock.sendall(direct.PREFIX.pack(direct.REQUEST, len(head), 20 << 30) + head)
        reply, _ = direct.recv_frame(sock, direct.RESPONSE, direct.MAX_HANDSHAKE_BYTES, 0,
                                     time.monotonic() + 5, None)
        assert reply["code"] == "RESOURCE_EXHAUSTED", reply
        assert "21474836480 payload bytes" in reply["details"]
        assert sock.recv(1) == b""
        assert all(n < 1 << 20 for n in taken), taken
    finally:
        sock.close()


@pytest.mark.parametrize("method", ["Ping", "Stop", "CreateResource", "Nope"])
def test_only_run_closures_is_served_on_the_direct_port(worker, method):
    server, token = worker
    sock = _authenticated(server, token)
    try:
        direct.send_frame(sock, direct.REQUEST, {"method": method, "meta": {}})
        reply, _ = direct.recv_frame(sock, direct.RESPONSE, direct.MAX_HANDSHAKE_BYTES, 0,
                                     time.monotonic() + 5, None)
        assert reply["code"] == "UNIMPLEMENTED", reply
        assert not server.service.stopped.is_set()
    finally:
        sock.close()


def test_a_client_with_the_wrong_token_is_refused_on_both_ports(worker):
    server, token = worker
    bad = _client(server, "not the coordinator token")
    try:
        meta, arrays = _batch(times_ten, [1])
        with pytest.raises(WorkerAuthenticationError, match="signature does not match"):
            list(bad.call_stream(0, "RunClosures", meta, arrays, timeout=5.0))
    finally:
        bad.close()


@pytest.mark.parametrize("bad", [{"closures": "x"}, {"closures": []}, {}],
                         ids=["not-a-list", "empty", "missing"])
def test_a_malformed_batch_is_invalid_argument(client, bad):
    with pytest.raises(CoordinatorError, match="INVALID_ARGUMENT.*RunClosures"):
        list(client.call_stream(0, "RunClosures", bad, {}, timeout=5.0))
    assert client.direct_calls == 0  # the failed call did not count
    assert _run(client, times_ten, [4]) == [40]  # and the worker still serves
    assert client.direct_calls == 1


def test_a_cancelled_call_starts_no_further_closure_and_frees_the_worker(client):
    RAN.clear()
    calls = []
    meta, arrays = _batch(slow, [0, 1, 2, 3])
    answers = client.call_stream(0, "RunClosures", meta, arrays, timeout=30.0,
                                 on_start=calls.append)
    assert len(calls) == 1
    with pytest.raises(WorkerUnavailableError, match="cancelled"):
        for m, _ in answers:
            assert m["ok"]
            calls[0].cancel()  # after the first answer; the second closure is running
    time.sleep(1.0)
    # The closure running at the cancel (the second, unless the cancel came before the
    # worker started it) ends; none after it starts.
    assert RAN in ([0], [0, 1]), RAN
    # The batch's turn ended with the call: the next call runs at once.
    assert _run(client, times_ten, [5]) == [50]


def test_a_deadline_passes_as_worker_unavailable(client):
    meta, arrays = _batch(slow, [0, 1])
    t0 = time.monotonic()
    with pytest.raises(WorkerUnavailableError, match="did not answer RunClosures within"):
        list(client.call_stream(0, "RunClosures", meta, arrays, timeout=0.45))
    assert time.monotonic() - t0 < 20  # a hang guard (without the deadline: two answers)


def test_calls_from_two_threads_use_two_connections(client):
    results: dict[int, list] = {}

    def send(k: int) -> None:
        results[k] = _run(client, times_ten, [k, k + 1])

    threads = [threading.Thread(target=send, args=(k,)) for k in (10, 20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {10: [100, 110], 20: [200, 210]}
    assert client.direct_calls == 2


def test_the_direct_transport_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(ENV_DIRECT, "0")
    server, token = in_process_worker()
    client = _client(server, token)
    try:
        assert server.direct is None and client._direct is None
        assert "direct_port" not in client.call(0, "Ping", timeout=5.0)[0]
        assert _run(client, times_ten, [6]) == [60]
        assert client.direct_calls == 0
    finally:
        client.close()
        server.stop(0)


def test_a_request_over_the_direct_ports_limit_goes_over_grpc(monkeypatch):
    import numpy as np

    monkeypatch.setenv("JAXDIST_PS_MAX_REQUEST_BYTES", str(64 << 10))
    server, token = in_process_worker()
    client = _client(server, token)
    try:
        assert client.call(0, "Ping", timeout=5.0)[0]["max_request_bytes"] == 64 << 10
        meta, arrays = _batch(np.sum, [1])
        arrays["args.0"] = to_bytes_array(closure_pickle.dumps(((np.ones(1 << 15),), {})))
        assert _values(client.call_stream(0, "RunClosures", meta, arrays, timeout=30.0)) == [
            float(1 << 15)]
        assert client.direct_calls == 0  # 256 KiB of arguments: over gRPC, not refused
        assert _run(client, times_ten, [3]) == [30]
        assert client.direct_calls == 1
    finally:
        client.close()
        server.stop(0)


def test_a_worker_without_a_direct_port_is_served_over_grpc(worker, client):
    server = worker[0]
    server.direct.stop()  # the port goes away: the next call falls back to gRPC
    assert _run(client, times_ten, [7]) == [70]
    assert client.direct_calls == 0


def test_a_silent_direct_port_is_given_up_on_in_connect_seconds(monkeypatch):
    # A hung worker: its kernel accepts the TCP connection, nothing answers the handshake.
    # The caller falls back to gRPC (whose calls heartbeats can cancel) within
    # CONNECT_SECONDS, not after the call's whole deadline.
    monkeypatch.setattr(direct, "CONNECT_SECONDS", 0.5)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    pool = direct.DirectPool(
        ["127.0.0.1:1"], "token", process_pki().identities["client"],
        ping=lambda task, timeout: {"direct_port": silent.getsockname()[1],
                                    "incarnation": "i"},
        error=lambda *a: AssertionError(a), job="worker")
    try:
        t0 = time.monotonic()
        with pytest.raises(direct.Unavailable):
            pool.call_stream(0, "RunClosures", {}, {}, time.monotonic() + 60.0, 60.0)
        assert time.monotonic() - t0 < 30  # far from the call's 60 s: CONNECT_SECONDS ended it
    finally:
        pool.close()
        silent.close()


class _Call:
    cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


@pytest.mark.parametrize("up", [True, False], ids=["up", "down"])
def test_a_call_that_starts_on_a_worker_already_down_is_cancelled(up):
    # Heartbeats cancel the calls in flight once, when the worker goes down; a call whose
    # start came later (its connection hung) must not wait for the whole closure timeout.
    from jaxdist._src.coordinator.closure_queue import ClosureQueue
    from jaxdist._src.coordinator.health import WorkerState
    from jaxdist._src.coordinator.resources import PerWorkerResources
    from jaxdist._src.coordinator.worker_thread import SenderSettings, WorkerThread, _Slot

    settings = SenderSettings(num_workers=1, rpc_timeout=1.0, closure_timeout=1.0,
                              ps_rpc_timeout=1.0, join_timeout=1.0)
    sender = WorkerThread(WorkerState(0, "worker:0"), ClosureQueue(), None,
                          PerWorkerResources(), settings, threading.Event())  # not started
    if up:
        sender.state.up.set()
    call = _Call()
    sender._on_start(_Slot(0), call)
    assert call.cancelled is (not up)
    assert sender.state.current_call is call  # registered either way (heartbeats see it)


def test_plaintext_on_loopback_uses_the_direct_port_too():
    server, token = in_process_worker("insecure")
    client = WorkerClient([server.address], token, tls="insecure")
    try:
        assert _run(client, times_ten, [8, 9]) == [
            80, 90]
        assert client.direct_calls == 1
        # A TLS client cannot talk to the plaintext port (nothing is sent in the clear).
        with pytest.raises(ssl.SSLError):
            _raw_direct(server)
    finally:
        client.close()
        server.stop(0)
