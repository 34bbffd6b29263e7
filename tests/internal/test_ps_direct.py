"""The ps direct transport (a second, socket port beside gRPC): same answers and typed errors
as gRPC, mutual TLS, the cluster token before anything else, request limits checked before
allocating, deadlines on stalled connections, and a gRPC fallback when it is unavailable."""

import json
import socket
import struct
import threading
import time

import ml_dtypes
import numpy as np
import pytest
from devutil import PRECISE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxdist._src.ps.client import PSClient
from jaxdist._src.ps.errors import PSAuthenticationError, PSInvalidArgumentError, PSNotFoundError
from jaxdist._src.ps.server import ParameterServer
from jaxdist._src.ps.service import ParameterService
from jaxdist._src.transport import direct
from jaxdist._src.transport.limits import ServerLimits
from jaxdist._src.transport.memory import RECEIVE_POOL

TOKEN = "direct-Secret-91b2"
MiB = 1 << 20


@pytest.fixture(autouse=True)
def _plaintext_on_loopback(plaintext_on_loopback, monkeypatch):
    monkeypatch.delenv("JAXDIST_PS_DIRECT", raising=False)


def _serve(**limits):
    kwargs = {"limits": ServerLimits.from_env(**limits)} if limits else {}
    return ParameterServer(ParameterService("ps:0"), "127.0.0.1:0", token=TOKEN,
                           **kwargs).start()


@pytest.fixture
def served():
    server = _serve()
    client = PSClient([server.address], TOKEN, timeout=10)
    client.call(0, "Create", {"specs": {"w": {}}}, {"w": np.zeros(4, np.float32)})
    yield server, client
    client.close()
    server.stop(0)


def _connect(server, token=TOKEN):
    """A raw socket to the direct port, past the hello and (when token) authenticated."""
    sock = socket.create_connection(("127.0.0.1", server.direct.port), timeout=10)
    hello, _ = direct.recv_frame(sock, direct.HELLO, 4096, 0, time.monotonic() + 10, None)
    assert hello["task"] == "ps:0"
    if token is not None:
        direct.send_frame(sock, direct.AUTH, {"token": token})
        reply, _ = direct.recv_frame(sock, direct.RESPONSE, 4096, 0, time.monotonic() + 10,
                                     None)
        assert reply["code"] == "OK", reply
    return sock


def _reply(sock):
    header, arrays = direct.recv_frame(sock, direct.RESPONSE, 1 << 20, None,
                                       time.monotonic() + 10, None)
    return header, arrays


def _closed(sock, within=10.0):
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionError:
        return True


@pytest.mark.parametrize("dtype", [np.float32, np.int8, ml_dtypes.bfloat16])
def test_direct_calls_answer_as_grpc_bit_exact(served, dtype):
    server, client = served
    grpc_client = PSClient([server.address], TOKEN, timeout=10, direct_transport=False)
    x = (np.arange(3 * MiB // 8) % 97).astype(dtype).reshape(-1, 8)
    client.call(0, "Create", {"specs": {"x": {}}}, {"x": x})
    meta, got = client.call(0, "Pull", {"keys": ["x", "w"]})
    gmeta, ggot = grpc_client.call(0, "Pull", {"keys": ["x", "w"]})
    assert meta == gmeta and got.keys() == ggot.keys()
    for k in got:
        assert got[k].dtype == ggot[k].dtype and got[k].tobytes() == ggot[k].tobytes()
    assert got["x"].ctypes.data % 64 == 0
    res, _ = client.call(0, "Push", {"versions": {"x": 0}}, {"x": np.ones_like(x)})
    assert res["results"]["x"]["version"] == 1
    assert np.array_equal(grpc_client.call(0, "Pull", {"keys": ["x"]})[1]["x"], x + 1)
    assert client.direct_calls >= 4 and grpc_client.direct_calls == 0
    grpc_client.close()


def test_errors_are_the_grpc_paths_typed_errors(served):
    _, client = served
    with pytest.raises(PSNotFoundError, match="no variable 'nope'"):
        client.call(0, "Pull", {"keys": ["nope"]})
    with pytest.raises(PSInvalidArgumentError, match="shape"):
        client.call(0, "Push", {"versions": {"w": 0}}, {"w": np.ones(3, np.float32)})
    with pytest.raises(PSInvalidArgumentError, match="chunk_bytes"):
        client.call(0, "Pull", {"keys": ["w"], "chunk_bytes": -1})
    assert client.call(0, "Pull", {"keys": ["w"]})[1]["w"].shape == (4,)  # still usable
    assert client.direct_calls >= 4


def test_a_wrong_or_missing_token_is_refused_and_never_echoed(served):
    server, _ = served
    for token, expected in (("wrong-token-123", "wrong cluster token"), ("", "no cluster token")):
        sock = _connect(server, token=None)
        direct.send_frame(sock, direct.AUTH, {"token": token})
        reply, _ = _reply(sock)
        assert reply["code"] == "UNAUTHENTICATED" and expected in reply["details"]
        assert "wrong-token-123" not in reply["details"] and TOKEN not in reply["details"]
        assert _closed(sock)
        sock.close()
    bad = PSClient([server.address], "wrong-token-123", timeout=5)
    with pytest.raises(PSAuthenticationError):
        bad.call(0, "Pull", {"keys": ["w"]})
    bad.close()


def test_requests_before_the_token_are_refused(served):
    server, _ = served
    sock = _connect(server, token=None)
    direct.send_frame(sock, direct.REQUEST, {"method": "Pull", "meta": {"keys": ["w"]}})
    assert _closed(sock)  # a request frame is not an AUTH frame: no answer, closed
    sock.close()


def test_a_20_gib_request_is_refused_before_allocating(served, monkeypatch):
    server, _ = served
    taken = []
    real = RECEIVE_POOL.take
    monkeypatch.setattr(RECEIVE_POOL, "take", lambda n: (taken.append(n), real(n))[1])
    sock = _connect(server)
    head = json.dumps({"method": "Push", "meta": {"versions": {"w": 0}}, "arrays": []}).encode()
    sock.sendall(direct.PREFIX.pack(direct.REQUEST, len(head), 20 << 30) + head)
    reply, _ = _reply(sock)
    assert reply["code"] == "RESOURCE_EXHAUSTED", reply
    assert "21474836480 payload bytes" in reply["details"]
    assert "max_request_bytes" in reply["details"]
    assert _closed(sock)
    assert all(n < MiB for n in taken), taken


@pytest.mark.parametrize("frame", [
    b"XXXX" + bytes(12),                                             # bad magic
    direct.PREFIX.pack(direct.REQUEST, (64 << 20) + 1, 0),           # header too long
    direct.PREFIX.pack(direct.REQUEST, 5, 0) + b"{oops",             # bad JSON
    direct.PREFIX.pack(direct.REQUEST, 2, 0) + b"[]",                # not an object
])
def test_malformed_frames_get_an_error_and_the_connection_closes(served, frame):
    server, client = served
    sock = _connect(server)
    sock.sendall(frame)
    reply, _ = _reply(sock)
    assert reply["code"] == "INVALID_ARGUMENT", reply
    assert _closed(sock)
    sock.close()
    assert client.call(0, "Ping")[0]["task"] == "ps:0"


def test_bad_array_specs_are_invalid_argument(served):
    server, _ = served
    sock = _connect(server)
    for spec in (["w", "float32", [-1], 0, 4], ["w", "object", [1], 0, 8],
                 ["w", "float32", [4], 8, 16]):
        head = json.dumps({"method": "Push", "meta": {"versions": {"w": 0}},
                           "arrays": [spec]}).encode()
        sock.sendall(direct.PREFIX.pack(direct.REQUEST, len(head), 16) + head + bytes(16))
        reply, _ = _reply(sock)
        assert reply["code"] == "INVALID_ARGUMENT", (spec, reply)
        sock.close()
        sock = _connect(server)
    sock.close()


@pytest.mark.parametrize("precise", PRECISE)
def test_a_stalled_request_is_cut_after_max_call_seconds(precise):
    server = _serve(max_call_seconds=1.0)
    try:
        sock = _connect(server)
        head = json.dumps({"method": "Push", "meta": {"versions": {}}, "arrays": []}).encode()
        sock.sendall(direct.PREFIX.pack(direct.REQUEST, len(head), MiB) + head + b"x" * 100)
        t0 = time.monotonic()
        assert _closed(sock, within=15)  # closed by the server, before the read's 15 s
        assert not precise or time.monotonic() - t0 < 8  # max_call_seconds=1 (wall clock)
        sock.close()
    finally:
        server.stop(0)


@pytest.mark.parametrize("precise", PRECISE)
def test_a_silent_connection_is_closed_after_the_handshake_deadline(monkeypatch, precise):
    monkeypatch.setenv("JAXDIST_HANDSHAKE_SECONDS", "0.5")
    server = _serve()
    try:
        sock = _connect(server, token=None)
        t0 = time.monotonic()
        assert _closed(sock, within=10)  # closed by the server, before the read's 10 s
        assert not precise or time.monotonic() - t0 < 5  # the 0.5 s deadline (wall clock)
        sock.close()
    finally:
        server.stop(0)


def test_calls_fall_back_to_grpc_when_the_direct_port_goes_away(served):
    server, client = served
    assert client.call(0, "Pull", {"keys": ["w"]})[1]["w"].shape == (4,)
    before = client.direct_calls
    server.direct.stop()  # closes the listening socket and every connection before it returns
    assert client.call(0, "Pull", {"keys": ["w"]})[1]["w"].shape == (4,)
    res, _ = client.call(0, "Push", {"versions": {"w": 0}}, {"w": np.ones(4, np.float32)})
    assert res["results"]["w"]["version"] == 1  # applied once
    assert np.array_equal(client.call(0, "Pull", {"keys": ["w"]})[1]["w"], np.ones(4))
    assert client.direct_calls == before


def test_the_direct_transport_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("JAXDIST_PS_DIRECT", "0")
    server = _serve()
    client = PSClient([server.address], TOKEN, timeout=10)
    try:
        assert server.direct is None
        assert "direct_port" not in client.call(0, "Ping")[0]
        client.call(0, "Create", {"specs": {"w": {}}}, {"w": np.zeros(4, np.float32)})
        assert client.direct_calls == 0
    finally:
        client.close()
        server.stop(0)


def test_the_direct_port_speaks_mutual_tls_only(monkeypatch):
    from jaxdist._src.security.pki import local_pki

    pki = local_pki(["ps", "client"])
    other = local_pki(["intruder"])
    try:
        monkeypatch.delenv("JAXDIST_INSECURE")
        server = ParameterServer(ParameterService("ps:0"), "127.0.0.1:0", token=TOKEN,
                                 tls=pki.identities["ps"]).start()
        try:
            client = PSClient([server.address], TOKEN, timeout=10, tls=pki.identities["client"])
            client.call(0, "Create", {"specs": {"w": {}}}, {"w": np.arange(4, dtype=np.float32)})
            assert np.array_equal(client.call(0, "Pull", {"keys": ["w"]})[1]["w"], np.arange(4))
            assert client.direct_calls == 2
            client.close()
            # Plaintext gets no hello (the server waits for a TLS ClientHello, then closes).
            raw = socket.create_connection(("127.0.0.1", server.direct.port), timeout=10)
            raw.sendall(direct.PREFIX.pack(direct.AUTH, 2, 0) + b"{}")
            raw.settimeout(10)
            try:
                data = raw.recv(16)
            except ConnectionError:
                data = b""
            assert not data.startswith(direct.HELLO)
            raw.close()
            # A certificate from another CA is refused by the TLS handshake.
            ctx = direct.client_context(pki.identities["client"])
            ctx.load_cert_chain(other.identities["intruder"].cert,
                                other.identities["intruder"].key)
            raw = socket.create_connection(("127.0.0.1", server.direct.port), timeout=10)
            with pytest.raises((OSError, direct.FrameError)):
                sock = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
                direct.recv_frame(sock, direct.HELLO, 4096, 0, time.monotonic() + 10, None)
            raw.close()
        finally:
            server.stop(0)
    finally:
        pki.cleanup()
        other.cleanup()


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(min_size=1, max_size=200))
def test_random_bytes_after_the_token_never_hurt_the_server(served, data):
    server, client = served
    sock = _connect(server)
    sock.settimeout(10)
    try:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)  # the server may have answered and closed already
        while sock.recv(1 << 16):
            pass
    except OSError:
        pass
    sock.close()
    assert client.call(0, "Ping")[0]["task"] == "ps:0"


@pytest.mark.parametrize("size", ["large", "small"])
def test_frames_round_trip_with_aligned_arrays(size):
    a, b = socket.socketpair()
    try:
        arrays = {"x": np.arange(5, dtype=np.float64), "y": np.ones((300, 300), np.float32),
                  "e": np.zeros(0, np.int32)}
        if size == "small":  # header and payload come in one read (direct._ONE_READ_BYTES)
            arrays = {"x": np.arange(5, dtype=np.float64), "s": np.asarray(np.float32(2.5)),
                      "b": np.arange(3, dtype=np.int8), "c": np.ones(7, np.complex128)}
        sender = threading.Thread(target=direct.send_frame, args=(
            a, direct.REQUEST, {"method": "Push", "meta": {"k": 1}}, arrays,
            time.monotonic() + 30), daemon=True)
        sender.start()  # the frame is larger than the socket buffer
        header, got = direct.recv_frame(b, direct.REQUEST, 1 << 20, 1 << 30,
                                        time.monotonic() + 10)
        assert header == {"method": "Push", "meta": {"k": 1}}
        for k, v in arrays.items():
            assert got[k].dtype == v.dtype and np.array_equal(got[k], v)
            assert got[k].ctypes.data % 64 == 0 or v.nbytes == 0
        sender.join(10)
    finally:
        a.close()
        b.close()


def _frame_bytes(arrays) -> bytes:
    """The bytes of a RESPONSE frame carrying ``arrays`` (sent into a list, not a socket)."""
    parts = []

    class _Capture:
        def settimeout(self, t):
            pass

        def gettimeout(self):
            return None

        def sendall(self, data):
            parts.append(bytes(data))

    direct.send_frame(_Capture(), direct.RESPONSE, {"code": "OK"}, arrays)
    return b"".join(parts)


# The deadline tests check that a read times out, not before its deadline, and (a hang guard)
# within seconds; their `timing` case (devutil.PRECISE) also holds the timeout to its deadline
# plus slack, a wall-clock claim that a loaded machine can break (deselected by default).


def _check_took(took: float, deadline_s: float, slack_s: float, precise: bool) -> None:
    assert took >= deadline_s - 0.05, f"timed out after {took:.2f} s, before its deadline"
    assert took < (deadline_s + slack_s if precise else deadline_s + 20), took


@pytest.mark.parametrize("precise", PRECISE)
def test_a_small_frame_stalled_midway_times_out_at_its_deadline(precise):
    a, b = socket.socketpair()
    try:
        data = _frame_bytes({"v": np.arange(100, dtype=np.float32)})
        a.sendall(data[:len(data) // 2])  # the prefix and part of the rest; then nothing
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            direct.recv_frame(b, direct.RESPONSE, 1 << 20, None, t0 + 0.3)
        _check_took(time.monotonic() - t0, 0.3, direct._TIMEOUT_SLACK_S + 0.5, precise)
    finally:
        a.close()
        b.close()


class _Trickle:
    """A plain socket whose ``sendmsg`` sends at most ``step`` bytes per call."""

    def __init__(self, sock, step):
        self.sock, self.step, self.calls = sock, step, 0

    def settimeout(self, t):
        self.sock.settimeout(t)

    def gettimeout(self):
        return self.sock.gettimeout()

    def sendmsg(self, buffers):
        self.calls += 1
        assert len(buffers) <= direct._MAX_IOV
        data, want = [], self.step  # copy only the bytes this call sends (not every buffer)
        for b in buffers:
            view = memoryview(b).cast("B")[:want]
            data.append(bytes(view))
            want -= len(view)
            if not want:
                break
        data = b"".join(data)
        self.sock.sendall(data)
        return len(data)

    def sendall(self, data):
        raise AssertionError("a frame with arrays leaves through sendmsg on a plain socket")


@pytest.mark.parametrize("step", [1, 7, 1000, 1 << 30])
def test_gathered_sends_survive_partial_writes_and_many_arrays(step, monkeypatch):
    monkeypatch.setattr(direct, "_MAX_IOV", 2)  # several sendmsg calls even without partials
    # Arrays of _SMALL bytes and more leave as their own buffers (no copy); a 4 KiB threshold
    # takes that path with arrays small enough that 7-byte writes finish quickly.
    monkeypatch.setattr(direct, "_SMALL", 4 << 10)
    a, b = socket.socketpair()
    rng = np.random.default_rng(step)
    arrays = {f"a{i}": rng.normal(size=(i % 7) * 5).astype(np.float32) for i in range(150)}
    if step > 1:
        arrays["big"] = rng.normal(size=3_000).astype(np.float32)
        arrays["big16"] = rng.normal(size=(30, 150)).astype(ml_dtypes.bfloat16)
        arrays["big8"] = rng.integers(0, 255, 8_193).astype(np.uint8)
        arrays["z"] = np.zeros(3, np.int64)
    trickle = _Trickle(a, step)
    try:
        sender = threading.Thread(target=direct.send_frame, args=(
            trickle, direct.REQUEST, {"method": "Push", "meta": {}}, arrays,
            time.monotonic() + 60), daemon=True)
        sender.start()
        header, got = direct.recv_frame(b, direct.REQUEST, 1 << 20, 1 << 30,
                                        time.monotonic() + 60)
        sender.join(30)
        assert not sender.is_alive()
        assert header == {"method": "Push", "meta": {}} and set(got) == set(arrays)
        for k, v in arrays.items():
            assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes()
        assert trickle.calls >= 2
    finally:
        a.close()
        b.close()


def test_a_gathered_send_keeps_the_deadline():
    a, b = socket.socketpair()
    try:
        with pytest.raises(TimeoutError):  # nobody reads: the socket buffer fills up
            direct.send_frame(a, direct.REQUEST, {"method": "Push", "meta": {}},
                              {"x": np.ones(8 << 20, np.uint8)}, time.monotonic() + 0.3)
    finally:
        a.close()
        b.close()


def test_prefix_layout():
    assert direct.PREFIX.size == 16
    assert struct.unpack("<4sIQ", direct.PREFIX.pack(b"JDQ1", 3, 4)) == (b"JDQ1", 3, 4)


@pytest.mark.parametrize("precise", PRECISE)
def test_one_deadline_covers_discovery_and_the_call(monkeypatch, precise):
    from jaxdist._src.ps.errors import PSUnavailableError

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there
    client = PSClient([f"127.0.0.1:{port}"], TOKEN, timeout=1.0)
    deadlines = {}  # the absolute deadline each transport was given
    real_direct, real_grpc = client._direct.call, client._grpc_call

    def direct_call(task, method, meta, arrays, deadline, *rest):
        deadlines["direct"] = deadline
        return real_direct(task, method, meta, arrays, deadline, *rest)

    def grpc_call(task, method, meta, arrays, timeout, deadline=None):
        deadlines["grpc"] = deadline
        return real_grpc(task, method, meta, arrays, timeout, deadline)

    monkeypatch.setattr(client._direct, "call", direct_call)
    monkeypatch.setattr(client, "_grpc_call", grpc_call)
    t0 = time.monotonic()
    with pytest.raises(PSUnavailableError, match=r"ps:0 .* did not answer Pull within 1.0 s"):
        client.call(0, "Pull", {"keys": ["w"]})
    # The direct port's discovery ate part of the 1 s: gRPC got what was left of the same
    # deadline, not a new second.
    assert deadlines["grpc"] == deadlines["direct"] >= t0 + 1.0, deadlines
    _check_took(time.monotonic() - t0, 1.0, 0.8, precise)
    client.close()


# ---------------------------------------------------------------- SO_RCVLOWAT on large reads
def _tcp_pair(tls: bool):
    """A connected TCP pair on loopback (``SO_RCVLOWAT`` is only set on TCP), mutual TLS if
    asked."""
    srv = socket.create_server(("127.0.0.1", 0))
    try:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    finally:
        srv.close()
    if not tls:
        return a, b
    from jaxdist.testing.tls import process_pki

    ids = process_pki().identities
    wrapped = {}
    t = threading.Thread(target=lambda: wrapped.update(
        b=direct.server_context(ids["task"]).wrap_socket(b, server_side=True)), daemon=True)
    t.start()
    a = direct.client_context(ids["client"]).wrap_socket(a, server_hostname="127.0.0.1")
    t.join(10)
    return a, wrapped["b"]


def _lowat(sock) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


needs_lowat = pytest.mark.skipif(direct._SO_RCVLOWAT is None, reason="no SO_RCVLOWAT here")


@needs_lowat
@pytest.mark.parametrize("precise", PRECISE)
@pytest.mark.parametrize("tls", [False, True])
def test_a_large_frame_that_trickles_in_arrives_whole_and_on_time(tls, precise):
    """The low-water mark never waits for bytes that will not come: a 1.2 MB frame sent in
    10 KiB pieces, 1 ms apart, is read whole (its tail too) long before the deadline, and the
    socket's mark is back to 1 byte afterwards."""
    a, b = _tcp_pair(tls)
    try:
        arrays = {"w": np.random.default_rng(0).normal(size=300_003).astype(np.float32)}
        data = _frame_bytes(arrays)
        assert len(data) > direct._LOWAT_MIN_READ

        def trickle():
            for i in range(0, len(data), 10 << 10):
                a.sendall(data[i:i + (10 << 10)])
                time.sleep(0.001)

        sender = threading.Thread(target=trickle, daemon=True)
        t0 = time.monotonic()
        sender.start()
        header, got = direct.recv_frame(b, direct.RESPONSE, 1 << 20, 1 << 30, t0 + 30)
        took = time.monotonic() - t0
        sender.join(10)
        # whole, before the 30 s deadline (recv_frame raises at it)
        assert header == {"code": "OK"} and got["w"].tobytes() == arrays["w"].tobytes()
        assert not precise or took < 10, took  # long before it (a wall-clock claim)
        assert _lowat(b) == 1
    finally:
        a.close()
        b.close()


@needs_lowat
def test_a_large_read_waits_for_its_low_water_mark(monkeypatch):
    """While a large payload is read the socket's mark is _LOWAT_BYTES; small reads set none."""
    a, b = _tcp_pair(False)
    marks = []
    real = direct._set_lowat
    monkeypatch.setattr(direct, "_set_lowat", lambda s, n: marks.append(n) or real(s, n))
    try:
        arrays = {"w": np.ones(300_000, np.float32)}
        data = _frame_bytes(arrays)
        sender = threading.Thread(target=a.sendall, args=(data,), daemon=True)
        sender.start()
        direct.recv_frame(b, direct.RESPONSE, 1 << 20, 1 << 30, time.monotonic() + 30)
        sender.join(10)
        assert marks[0] == direct._LOWAT_BYTES and marks[-1] == 1
        assert all(m == 1 or direct._LOWAT_FLOOR <= m <= direct._LOWAT_BYTES for m in marks)
        assert len(marks) <= 6  # a few system calls per frame, not one per read
        marks.clear()
        a.sendall(_frame_bytes({"v": np.ones(1000, np.float32)}))
        direct.recv_frame(b, direct.RESPONSE, 1 << 20, 1 << 30, time.monotonic() + 30)
        assert marks == []
    finally:
        a.close()
        b.close()


@needs_lowat
@pytest.mark.parametrize("precise", PRECISE)
@pytest.mark.parametrize("tls", [False, True])
def test_a_large_frame_stalled_midway_times_out_and_clears_the_mark(tls, precise):
    a, b = _tcp_pair(tls)
    try:
        data = _frame_bytes({"w": np.ones(300_000, np.float32)})
        a.sendall(data[:700_000])  # then nothing
        t0 = time.monotonic()
        with pytest.raises((TimeoutError, socket.timeout)):
            direct.recv_frame(b, direct.RESPONSE, 1 << 20, 1 << 30, t0 + 0.5)
        _check_took(time.monotonic() - t0, 0.5, direct._TIMEOUT_SLACK_S + 1.0, precise)
        assert _lowat(b) == 1
    finally:
        a.close()
        b.close()
