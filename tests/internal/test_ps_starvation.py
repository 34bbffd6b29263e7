"""One client cannot starve a parameter server (issue 27, point 3), attacked in-process on
127.0.0.1 with mutual TLS: limits count per certificate (not per connection), stalled streams
end on an idle deadline far below the call deadline, and the direct port gives a slot only to
an authenticated connection, at most ``max_connections_per_peer`` per certificate, closing
idle ones when full. No devices needed."""

import json
import select
import socket
import ssl
import struct
import threading
import time

import grpc
import numpy as np
import pytest

from jaxdist._src.ps import protocol
from jaxdist._src.ps.client import PSClient
from jaxdist._src.ps.server import ParameterServer
from jaxdist._src.ps.service import ParameterService
from jaxdist._src.security.pki import local_pki
from jaxdist._src.security.tls import open_channel
from jaxdist._src.transport import direct, direct_server, wire
from jaxdist._src.transport.direct_server import DirectServer
from jaxdist._src.transport.grpc_util import TOKEN_METADATA_KEY, method_path
from jaxdist._src.transport.limits import ServerLimits

TOKEN = "starvation-Secret-9d1e"


@pytest.fixture(scope="module")
def pki():
    p = local_pki(["ps", "client", "attacker"])
    yield p
    p.cleanup()


def _server(pki, **limits):
    return ParameterServer(ParameterService("ps:0"), "127.0.0.1:0", token=TOKEN,
                           tls=pki.identities["ps"],
                           limits=ServerLimits.from_env(**limits)).start()


def _stalled_pushes(pki, address, connections, per_connection, release):
    """``connections`` separate TLS connections with the attacker's certificate, each with
    ``per_connection`` Push streams that send a frame prefix declaring 1 MiB and then stall."""
    header = json.dumps({"meta": {"versions": {}}, "arrays": []}).encode()
    first = struct.pack("<4sQQ", wire.MAGIC, len(header), 1 << 20) + header

    def stalled():
        yield first
        release.wait(60)

    channels, calls = [], []
    for i in range(connections):
        ch = open_channel(address, pki.identities["attacker"], "attacker",
                          [("grpc.use_local_subchannel_pool", 1), ("jaxdist.test.conn", i)])
        channels.append(ch)
        push = ch.stream_stream(method_path(protocol.SERVICE_NAME, "Push"))
        md = [(TOKEN_METADATA_KEY, TOKEN)]
        calls += [push(stalled(), timeout=120, metadata=md) for _ in range(per_connection)]
    return channels, calls


def _codes(calls, timeout):
    """Every call's final status code, each waited for at most ``timeout`` seconds."""
    out = []
    for c in calls:
        done = threading.Event()
        c.add_done_callback(lambda _, done=done: done.set())
        assert done.wait(timeout), "a stalled stream was neither refused nor cancelled"
        out.append(c.code())
    return out


def test_three_connections_of_one_certificate_share_one_allowance(pki):
    server = _server(pki, max_idle_seconds=3.0)  # max_call_seconds stays 300
    release = threading.Event()
    channels, calls = [], []
    try:
        channels, calls = _stalled_pushes(pki, server.address, 3, 8, release)
        # 16 of the 24 streams are refused at once: the certificate's allowance is 8.
        deadline = time.monotonic() + 30
        while (sum(c.done() for c in calls) < 16 and time.monotonic() < deadline):
            time.sleep(0.05)
        assert sum(c.done() for c in calls) == 16
        assert {c.code() for c in calls if c.done()} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        details = next(c.details() for c in calls if c.done())
        assert "client cert attacker " in details and "max_calls_per_client=8" in details
        # Another client (its own certificate) is served while the attacker holds 8 threads.
        healthy = PSClient([server.address], TOKEN, timeout=5.0, tls=pki.identities["client"],
                           direct_transport=False)
        try:
            assert healthy.call(0, "Ping")[0]["task"] == "ps:0"
            assert healthy.call(0, "Status")[0]["task"] == "ps:0"
            held = sum(not c.done() for c in calls)  # the attacker's streams still admitted
        finally:
            healthy.close()
        # The 8 admitted streams end on the 3 s idle deadline, not the 300 s call deadline.
        codes = _codes(calls, timeout=60)
    finally:
        release.set()
        for c in calls:
            c.cancel()
        for ch in channels:
            ch.close()
        server.stop(0)
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 16, codes
    assert codes.count(grpc.StatusCode.CANCELLED) == 8, codes
    assert server._guard.idle_cancelled == 8 and server._guard.cancelled == 0
    # The healthy client was served while the attacker held its 8 threads, not after the 3 s
    # idle deadline freed them.
    assert held == 8, f"the healthy client was served only once {8 - held} streams ended"


def test_time_the_server_spends_on_a_call_is_not_idle(pki):
    server = _server(pki, max_idle_seconds=0.5)
    client = PSClient([server.address], TOKEN, timeout=30, tls=pki.identities["client"],
                      direct_transport=False)
    try:
        t0 = time.monotonic()
        meta, _ = client.call(0, "Clock", {"worker": 0, "clock": 5, "num_workers": 2,
                                           "max_staleness": 0, "wait_s": 2.0})
        assert meta["ok"] is False and time.monotonic() - t0 >= 2.0  # waited, not cancelled
        x = np.arange(4 << 20, dtype=np.float32)  # a 16 MiB push streams in many chunks
        client.call(0, "Create", {"specs": {"x": {}}}, {"x": np.zeros_like(x)})
        client.call(0, "Push", {"versions": {"x": 0}}, {"x": x})
        assert server._guard.idle_cancelled == 0
    finally:
        client.close()
        server.stop(0)


def test_limits_read_the_idle_deadline_from_the_environment(monkeypatch):
    monkeypatch.setenv("JAXDIST_PS_MAX_IDLE_SECONDS", "12.5")
    assert ServerLimits.from_env().max_idle_seconds == 12.5
    monkeypatch.setenv("JAXDIST_PS_MAX_IDLE_SECONDS", "soon")
    with pytest.raises(ValueError, match="JAXDIST_PS_MAX_IDLE_SECONDS='soon': expected a "
                                         "positive float"):
        ServerLimits.from_env()
    with pytest.raises(ValueError, match="max_idle_seconds=0"):
        ServerLimits(max_idle_seconds=0)


# ---------------------------------------------------------------------- the direct port
def _direct_auth(port, tls, token=TOKEN):
    """An authenticated direct connection's socket and the server's reply to AUTH."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock = raw
    if tls is not None:
        sock = direct.client_context(tls).wrap_socket(raw, server_hostname="127.0.0.1")
    deadline = time.monotonic() + 10
    direct.recv_frame(sock, direct.HELLO, 4096, 0, deadline, None)
    direct.send_frame(sock, direct.AUTH, {"token": token}, None, deadline)
    reply, _ = direct.recv_frame(sock, direct.RESPONSE, 4096, 0, deadline, None)
    return sock, reply


def _closed(sock, within=10.0):
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except (ConnectionError, ssl.SSLError):
        return True
    except TimeoutError:
        return False


def _one_closed(socks, within=10.0):
    """Whether one of ``socks`` is closed by the server within ``within`` seconds (the one
    the server judged longest idle: on a loaded machine either may be)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        ready, _, _ = select.select(socks, [], [], max(0.0, deadline - time.monotonic()))
        if any(_closed(s, 1.0) for s in ready):
            return True
    return False


def test_connections_that_never_authenticate_take_no_direct_slot(pki, monkeypatch):
    monkeypatch.setattr(direct_server, "MAX_HANDSHAKES", 32)
    monkeypatch.setenv("JAXDIST_HANDSHAKE_SECONDS", "120")  # only the cap closes them
    server = _server(pki)
    stallers = []
    healthy = PSClient([server.address], TOKEN, timeout=10, tls=pki.identities["client"])
    try:
        port = server.direct.port
        # More idle connections than slots (64) and than handshakes admitted at once (32).
        stallers = [socket.create_connection(("127.0.0.1", port), timeout=10)
                    for _ in range(80)]
        healthy.call(0, "Create", {"specs": {"w": {}}}, {"w": np.zeros(4, np.float32)})
        healthy.call(0, "Pull", {"keys": ["w"]})
        assert healthy.direct_calls >= 1
        # The oldest handshakes were closed to admit newer ones (80 + 1 - 32 of them).
        assert all(_closed(s, within=10) for s in stallers[:40])
    finally:
        for s in stallers:
            s.close()
        healthy.close()
        server.stop(0)


def test_one_certificate_holds_at_most_its_share_of_direct_slots(pki):
    server = _server(pki)  # max_calls_per_client 8 -> 8 direct connections per certificate
    socks = []
    healthy = PSClient([server.address], TOKEN, timeout=10, tls=pki.identities["client"])
    try:
        replies = []
        for _ in range(10):
            sock, reply = _direct_auth(server.direct.port, pki.identities["attacker"])
            socks.append(sock)
            replies.append(reply["code"])
        assert replies == ["OK"] * 8 + ["RESOURCE_EXHAUSTED"] * 2, replies
        assert "max_connections_per_peer=8" in _direct_auth(
            server.direct.port, pki.identities["attacker"])[1]["details"]
        healthy.call(0, "Ping")
        before = healthy.direct_calls
        healthy.call(0, "Status")
        assert healthy.direct_calls == before + 1  # the other certificate still gets a slot
    finally:
        for s in socks:
            s.close()
        healthy.close()
        server.stop(0)


def _plain_direct_server(max_connections):
    return DirectServer("ps:9", "127.0.0.1", TOKEN.encode(), None, ServerLimits(),
                        lambda method, meta, arrays: ({"pong": True}, {}), "inc-1",
                        max_connections=max_connections).start()


def test_when_every_slot_is_taken_an_idle_connection_gives_way(monkeypatch):
    monkeypatch.setenv("JAXDIST_INSECURE", "1")
    monkeypatch.setattr(direct_server, "EVICT_IDLE_SECONDS", 0.3)
    server = _plain_direct_server(max_connections=2)
    try:
        first, r1 = _direct_auth(server.port, None)
        second, r2 = _direct_auth(server.port, None)
        assert r1["code"] == r2["code"] == "OK"
        time.sleep(0.5)  # both idle longer than EVICT_IDLE_SECONDS
        third, r3 = _direct_auth(server.port, None)
        assert r3["code"] == "OK", r3
        assert _one_closed([first, second])  # an idle one was closed
        for s in (first, second, third):
            s.close()
    finally:
        server.stop()


def test_when_every_slot_is_busy_a_newcomer_is_told_to_use_grpc(monkeypatch):
    monkeypatch.setenv("JAXDIST_INSECURE", "1")
    server = _plain_direct_server(max_connections=2)  # EVICT_IDLE_SECONDS: 75 s
    socks = []
    try:
        socks = [_direct_auth(server.port, None)[0] for _ in range(2)]
        sock, reply = _direct_auth(server.port, None)
        socks.append(sock)
        assert reply["code"] == "RESOURCE_EXHAUSTED", reply
        assert "all 2 slots are busy; its calls use gRPC" in reply["details"]
        assert server.refused == 1
    finally:
        for s in socks:
            s.close()
        server.stop()
