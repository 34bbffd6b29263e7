"""Connections that never authenticate cannot stall the bring-up handshake (issue 27, point 2):
process 0 serves every handshake at once with a per-connection deadline, so stallers (idle
TCP, a half-sent hello, a TLS connection that never sends its ClientHello, reconnecting as
soon as they are closed) cost nothing but their own sockets. Threads in one process; no
devices needed."""

import socket
import threading
import time

import pytest
from test_handshake import _group, _run  # the handshake tests' own helpers

from jaxdist._src.distributed import handshake
from jaxdist._src.distributed.handshake import join_handshake, serve_handshake
from jaxdist._src.launch.local import pick_free_ports
from jaxdist.testing.tls import process_pki


class Stallers:
    """``n`` connections to ``port`` that never finish a handshake; each reconnects as soon as
    the server closes it (unless ``reconnect=False``), until ``stop()`` (at most 60 s)."""

    def __init__(self, port, n, send=b"", reconnect=True):
        self.port, self.send, self.reconnect = port, send, reconnect
        self.stop_event = threading.Event()
        self.connected = threading.Semaphore(0)
        self.closed_by_server = 0
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _loop(self):
        end = time.monotonic() + 60
        while not self.stop_event.is_set() and time.monotonic() < end:
            try:
                s = socket.create_connection(("127.0.0.1", self.port), timeout=2)
            except OSError:
                self.stop_event.wait(0.05)
                continue
            with s:
                if self.send:
                    s.sendall(self.send)
                self.connected.release()
                s.settimeout(0.2)
                while not self.stop_event.is_set() and time.monotonic() < end:
                    try:
                        if s.recv(1) == b"":
                            self.closed_by_server += 1
                            break
                    except TimeoutError:
                        continue
                    except OSError:
                        self.closed_by_server += 1
                        break
            if not self.reconnect:
                return

    def wait_connected(self, n, timeout=20):
        for _ in range(n):
            assert self.connected.acquire(timeout=timeout), "a staller could not connect"

    def stop(self):
        self.stop_event.set()
        for t in self.threads:
            t.join(5)


@pytest.mark.parametrize("tls", [False, True])
@pytest.mark.parametrize("send", [b"", handshake.MAGIC + b"\0\0"], ids=["idle", "half-hello"])
def test_stalled_connections_do_not_delay_the_real_processes(tls, send):
    port = pick_free_ports(1)[0]
    chief_tls = process_pki().identities["task"] if tls else None
    joiner_tls = process_pki().identities["client"] if tls else None
    chief, c_out = _run(serve_handshake, _group(0, port), "s3cret", 40, tls_material=chief_tls)
    stallers = None
    try:
        # The stallers connect first and hold their sockets (reconnecting when closed), for
        # longer than the joiners' 20 s: a server that serves one connection at a time, each
        # for up to 5 s, would never reach the real processes.
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the chief never listened"
                time.sleep(0.05)
        stallers = Stallers(port, 8, send if not tls else b"")
        stallers.wait_connected(8)
        joiners = [_run(join_handshake, _group(i, port), "s3cret", 20, tls_material=joiner_tls)
                   for i in (1, 2)]
        for t, _ in joiners:
            t.join(30)
        chief.join(30)
    finally:
        if stallers is not None:
            stallers.stop()
    assert [o for _, o in joiners] == [{"ok": True}, {"ok": True}], joiners
    assert c_out == {"ok": True}, c_out


def test_a_staller_is_closed_at_its_deadline_and_many_cost_only_sockets(monkeypatch):
    monkeypatch.setattr(handshake, "HANDSHAKE_SECONDS", 1.0)
    port = pick_free_ports(1)[0]
    chief, c_out = _run(serve_handshake, _group(0, port), "s3cret", 40, tls_material=None)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "the chief never listened"
            time.sleep(0.05)
    threads_before = threading.active_count()
    stallers = Stallers(port, 64)
    try:
        stallers.wait_connected(64)
        # The server closes each staller once its 1 s deadline passes (they reconnect).
        wait_until = time.monotonic() + 20
        while stallers.closed_by_server < 64 and time.monotonic() < wait_until:
            time.sleep(0.1)
        assert stallers.closed_by_server >= 64, stallers.closed_by_server
        # The server spends no thread per connection (only the stallers' own 64 exist).
        assert threading.active_count() <= threads_before + 64
        joiners = [_run(join_handshake, _group(i, port), "s3cret", 20, tls_material=None)
                   for i in (1, 2)]
        for t, _ in joiners:
            t.join(30)
        chief.join(30)
    finally:
        stallers.stop()
    assert [o for _, o in joiners] == [{"ok": True}, {"ok": True}], joiners
    assert c_out == {"ok": True}, c_out


def test_more_waiting_connections_than_the_cap_close_the_oldest(monkeypatch):
    monkeypatch.setattr(handshake, "MAX_PENDING", 4)
    monkeypatch.setattr(handshake, "HANDSHAKE_SECONDS", 60.0)  # only the cap closes them
    port = pick_free_ports(1)[0]
    chief, c_out = _run(serve_handshake, _group(0, port), "s3cret", 40, tls_material=None)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "the chief never listened"
            time.sleep(0.05)
    stallers = Stallers(port, 12, reconnect=False)
    try:
        stallers.wait_connected(12)
        wait_until = time.monotonic() + 20
        while stallers.closed_by_server < 8 and time.monotonic() < wait_until:
            time.sleep(0.1)
        assert stallers.closed_by_server == 8, stallers.closed_by_server
        joiners = [_run(join_handshake, _group(i, port), "s3cret", 20, tls_material=None)
                   for i in (1, 2)]
        for t, _ in joiners:
            t.join(30)
        chief.join(30)
    finally:
        stallers.stop()
    assert [o for _, o in joiners] == [{"ok": True}, {"ok": True}], joiners
    assert c_out == {"ok": True}, c_out
