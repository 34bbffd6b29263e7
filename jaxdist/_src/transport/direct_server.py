"""The server side of the direct transport (``jaxdist._src.transport.direct``): the second port.

One thread accepts connections; each connection gets its own thread. A connection must finish
its TLS handshake and present the credential within ``handshake_seconds``
(``ConnectionLimits``, ``HANDSHAKE_SECONDS`` by default); at most ``MAX_HANDSHAKES``
connections may be in that phase at once, and at most ``max_pending_per_peer`` of one peer
address (past either, the oldest of them is closed: a flood from one address pushes out only
its own), and none of them takes one of the ``max_connections`` serving slots: a connection
takes a slot only once it has authenticated, so connections that never authenticate cannot keep
a client off the port. An authenticated peer (its TLS certificate; in plaintext, each
connection) holds at most ``max_connections_per_peer`` slots. When every slot is taken, a
connection idle for longer than ``EVICT_IDLE_SECONDS`` (longer than a client reuses a pooled
connection, so no client is about to send on it) is closed to make room; if none is, the
newcomer is refused with ``RESOURCE_EXHAUSTED`` and its client uses gRPC. A connection idle for
``IDLE_SECONDS`` is closed. Each call is bounded by ``ServerLimits.max_call_seconds`` from the
first byte of its request to the last byte of its response. Malformed frames, a payload over
``max_request_bytes`` (checked before allocation) or a wrong token get an error frame with the
gRPC path's status and message, then the connection is closed.

A server can also stream: a method in ``stream_methods`` answers with any number of
``{"code": "OK", "meta", "more": true}`` frames and then one ``{"code": "OK", "end": true}``
(the worker tasks' ``RunClosures``, one frame per closure as it ends). Its handler gets an
``active()`` that turns ``False`` once the client closed the connection (it gave up on the
call), as gRPC's ``context.is_active``.

Example:
    >>> direct = DirectServer(  # doctest: +SKIP
    ...     "ps:0", "127.0.0.1", token, tls, limits, run).start()
    >>> direct.port  # doctest: +SKIP
    40123
"""

from __future__ import annotations

import errno
import functools
import hmac
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from jaxdist._src.security.tls import TLSConfig, check_plaintext_allowed
from jaxdist._src.transport import direct, wire
from jaxdist._src.transport.connections import ConnectionLimits
from jaxdist._src.transport.grpc_util import TOKEN_METADATA_KEY
from jaxdist._src.transport.limits import ServerLimits, certificate_identity

log = logging.getLogger(__name__)

HANDSHAKE_SECONDS = 10.0
MAX_HANDSHAKES = 128  # connections authenticating at once (past it: the oldest is closed)
IDLE_SECONDS = 90.0  # an authenticated connection idle this long is closed
EVICT_IDLE_SECONDS = direct.IDLE_REUSE_S + 15.0  # ... and this long, closed to make room


class CallFailed(Exception):
    """A call's failure as a gRPC status name and message (both transports send these)."""

    def __init__(self, code: str, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class DirectServer:
    """Accepts direct-transport connections for one ps task.

    Args:
        task: the task name, e.g. ``"ps:0"``.
        host: the host to bind (the gRPC address's host).
        token: the cluster token (bytes).
        tls: the task's TLS identity; ``None``: plaintext, loopback only.
        limits: the server's limits (request bytes, call seconds).
        run: ``run(method, meta, arrays) -> (meta, arrays)``; raises ``CallFailed``.
        incarnation: the service's incarnation (sent in the hello).
        max_connections: authenticated connections served at once.
        max_connections_per_peer: of those, how many one peer (TLS certificate) may hold
            (default: ``limits.max_calls_per_client``).
        authenticate: ``authenticate(presented) -> CallFailed | None`` checks the credential a
            connection presents (default: it must be ``token``, the cluster token).
        stream: ``stream(method, meta, arrays, active) -> iterator of (meta, arrays)`` serves
            the methods in ``stream_methods``; raises ``CallFailed``.
        stream_methods: the methods answered by ``stream``.
        connections: the handshake deadline and the per-address cap on connections
            authenticating at once (``max_connections_per_peer``, at most half of
            ``MAX_HANDSHAKES``); default ``ConnectionLimits.from_env()``.
    """

    def __init__(self, task: str, host: str, token: bytes, tls: TLSConfig | None,
                 limits: ServerLimits, run: Callable[[str, dict, dict], tuple[dict, dict]],
                 incarnation: str, max_connections: int = 64, *,
                 max_connections_per_peer: int | None = None,
                 authenticate: Callable[[Any], CallFailed | None] | None = None,
                 stream: Callable[[str, dict, dict, Callable[[], bool]],
                                  Iterator[tuple[dict, dict]]] | None = None,
                 stream_methods: frozenset[str] = frozenset(),
                 connections: ConnectionLimits | None = None):
        if tls is None:
            check_plaintext_allowed(task, f"{host}:0")
        self.task, self._token, self.limits, self._run = task, token, limits, run
        self._authenticate = authenticate or self._check_token
        self._stream, self._stream_methods = stream, frozenset(stream_methods)
        self._incarnation = incarnation
        connections = connections or ConnectionLimits.from_env()
        self.handshake_seconds = connections.handshake_seconds
        self.max_pending_per_peer = min(connections.max_connections_per_peer,
                                        MAX_HANDSHAKES // 2)
        self._ctx = direct.server_context(tls) if tls is not None else None
        bind_host = host.strip("[]")
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.bind((bind_host, 0))
        self._sock.listen(1024)
        self._sock.settimeout(0.5)
        self.port = self._sock.getsockname()[1]
        self.max_connections = max_connections
        self.max_connections_per_peer = (limits.max_calls_per_client
                                         if max_connections_per_peer is None
                                         else max_connections_per_peer)
        self._stopped = threading.Event()
        self._conns: dict[socket.socket, int] = {}  # raw socket -> its file descriptor
        # raw socket -> (accepted at, peer address) while it authenticates
        self._handshaking: dict[socket.socket, tuple[float, str]] = {}
        self._served: dict[socket.socket, list] = {}  # raw socket -> [peer, idle since|None]
        self.refused = 0  # authenticated connections refused for want of a slot
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"jaxdist-direct-{task}")

    def start(self) -> DirectServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops accepting and closes every connection (clients fall back to gRPC)."""
        self._stopped.set()
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            for fd in self._conns.values():
                _shutdown(fd)

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                raw, address = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._stopped.is_set() or e.errno not in (errno.EMFILE, errno.ENFILE):
                    return
                time.sleep(0.05)  # out of file descriptors: handshakes end or give way
                continue
            host = address[0]
            with self._lock:
                mine = [r for r, (_, h) in self._handshaking.items() if h == host]
                if len(mine) >= self.max_pending_per_peer:
                    self._drop_handshake(min(mine, key=lambda r: self._handshaking[r][0]))
                elif len(self._handshaking) >= MAX_HANDSHAKES:
                    self._drop_handshake(min(self._handshaking,
                                             key=lambda r: self._handshaking[r][0]))
                self._handshaking[raw] = (time.monotonic(), host)
                self._conns[raw] = raw.fileno()
            threading.Thread(target=self._serve, args=(raw,), daemon=True,
                             name=f"jaxdist-direct-conn-{self.task}").start()

    def _drop_handshake(self, raw: socket.socket) -> None:
        """Closes a connection still authenticating (under the lock); its thread ends."""
        del self._handshaking[raw]
        _shutdown(self._conns[raw])

    # ------------------------------------------------------------------ one connection
    def _serve(self, raw: socket.socket) -> None:
        sock: Any = raw
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            deadline = time.monotonic() + self.handshake_seconds
            raw.settimeout(self.handshake_seconds)
            if self._ctx is not None:
                sock = self._ctx.wrap_socket(raw, server_side=True)
            direct.send_frame(sock, direct.HELLO, {"task": self.task,
                                                   "incarnation": self._incarnation},
                              None, deadline)
            auth, _ = direct.recv_frame(sock, direct.AUTH, direct.MAX_HANDSHAKE_BYTES, 0,
                                        deadline, None)
            failure = self._authenticate(auth.get("token"))
            if failure is None:
                failure = self._admit(raw, self._peer(sock, raw))
            if failure is not None:
                self._reply_error(sock, failure, deadline)
                return
            direct.send_frame(sock, direct.RESPONSE, {"code": "OK"}, None, deadline)
            while not self._stopped.is_set():
                if not self._serve_call(sock, self._served[raw]):
                    return
        except (OSError, ssl.SSLError, wire.WireError, ValueError, KeyError):
            return  # the client left, stalled past a deadline, sent garbage, or was evicted
        finally:
            with self._lock:
                self._conns.pop(raw, None)
                self._handshaking.pop(raw, None)
                self._served.pop(raw, None)
            try:
                sock.close()
            except OSError:
                pass

    @staticmethod
    def _peer(sock: Any, raw: socket.socket) -> str:
        """The peer a connection counts against: its certificate, else the connection."""
        getpeercert = getattr(sock, "getpeercert", None)
        cert = getpeercert(binary_form=True) if getpeercert is not None else None
        if cert:
            return certificate_identity(cert)
        try:
            host, port = raw.getpeername()[:2]
            return f"conn {host}:{port}"
        except OSError:
            return "conn ?"

    def _admit(self, raw: socket.socket, peer: str) -> CallFailed | None:
        """Gives an authenticated connection a slot, or says why not."""
        now = time.monotonic()
        with self._lock:
            if raw not in self._handshaking:  # closed as the oldest of too many handshakes
                return CallFailed("UNAVAILABLE", f"{self.task}: handshake overtaken")
            del self._handshaking[raw]
            mine = sum(1 for p, _ in self._served.values() if p == peer)
            if mine >= self.max_connections_per_peer:
                self.refused += 1
                return CallFailed(
                    "RESOURCE_EXHAUSTED",
                    f"{self.task} refused a direct connection: peer {peer} already holds "
                    f"{mine} (max_connections_per_peer={self.max_connections_per_peer}); "
                    f"its calls use gRPC")
            if len(self._served) >= self.max_connections:
                idle = [(since, r) for r, (_, since) in self._served.items()
                        if since is not None and now - since > EVICT_IDLE_SECONDS]
                if not idle:
                    self.refused += 1
                    return CallFailed(
                        "RESOURCE_EXHAUSTED",
                        f"{self.task} refused a direct connection: all "
                        f"{self.max_connections} slots are busy; its calls use gRPC")
                victim = min(idle, key=lambda x: x[0])[1]
                self._served.pop(victim)[0] = None  # its thread serves nothing more
                _shutdown(self._conns[victim])
            self._served[raw] = [peer, now]
        return None

    def _check_token(self, presented: Any) -> CallFailed | None:
        if not isinstance(presented, str) or not presented:
            return CallFailed("UNAUTHENTICATED",
                              f"{self.task} refused the connection: it carries no cluster "
                              f"token (metadata {TOKEN_METADATA_KEY!r}); set "
                              f"JAXDIST_CLUSTER_TOKEN or TF_CONFIG 'token' on the caller")
        if not hmac.compare_digest(presented.encode(), self._token):
            return CallFailed("UNAUTHENTICATED",
                              f"{self.task} refused the connection: wrong cluster token")
        return None

    def _reply_error(self, sock: Any, failure: CallFailed, deadline: float) -> None:
        try:
            direct.send_frame(sock, direct.RESPONSE, {"code": failure.code,
                                                      "details": failure.details,
                                                      "close": True}, None, deadline)
        except OSError:
            pass

    def _serve_call(self, sock: Any, slot: list) -> bool:
        """Serves one call; False when the connection must close. ``slot[1]`` says since when
        the connection is idle (``None`` while a call runs)."""
        # The call's own deadline (max_call_seconds) starts when its prefix has arrived.
        started: list[float] = []
        slot[1] = time.monotonic()
        try:
            header, arrays = direct.recv_frame(
                sock, direct.REQUEST, direct.MAX_HEADER_BYTES, self.limits.max_request_bytes,
                None, first_deadline=time.monotonic() + IDLE_SECONDS,
                call_seconds=self.limits.max_call_seconds, started=started)
        except wire.MessageTooLargeError as e:
            self._reply_error(sock, CallFailed(
                "RESOURCE_EXHAUSTED", f"{self.task}: {e}; raise the server's max_request_bytes "
                f"or send smaller requests"), time.monotonic() + HANDSHAKE_SECONDS)
            return False
        except wire.WireError as e:
            self._reply_error(sock, CallFailed("INVALID_ARGUMENT", f"{self.task}: {e}"),
                              time.monotonic() + HANDSHAKE_SECONDS)
            return False
        with self._lock:
            if slot[0] is None:  # evicted while the request arrived: it is not served
                return False
            slot[1] = None
        call_deadline = started[0] + self.limits.max_call_seconds
        method, meta = header.get("method"), header.get("meta")
        if not isinstance(method, str) or method in direct.GRPC_ONLY or not isinstance(
                meta, dict):
            self._reply_error(sock, CallFailed(
                "UNIMPLEMENTED" if isinstance(meta, dict) else "INVALID_ARGUMENT",
                f"{self.task}: method {str(method)[:64]!r} is not served on the direct "
                f"transport"), call_deadline)
            return False
        if method in self._stream_methods:
            return self._serve_stream(sock, method, meta, arrays)
        try:
            out_meta, out_arrays = self._run(method, meta, arrays)
        except CallFailed as e:
            del arrays
            direct.send_frame(sock, direct.RESPONSE, {"code": e.code, "details": e.details},
                              None, call_deadline)
            return True
        del arrays
        direct.send_frame(sock, direct.RESPONSE, {"code": "OK", "meta": out_meta}, out_arrays,
                          call_deadline)
        return True

    def _serve_stream(self, sock: Any, method: str, meta: dict, arrays: dict) -> bool:
        """Serves one streaming call: an answer frame per item, then the end frame. Each
        frame must leave within ``max_call_seconds`` (the items themselves take as long as
        they take: the client's deadline bounds the call)."""
        answers = None
        try:
            answers = self._stream(method, meta, arrays, functools.partial(_peer_open, sock))
            for out_meta, out_arrays in answers:
                direct.send_frame(sock, direct.RESPONSE,
                                  {"code": "OK", "meta": out_meta, "more": True}, out_arrays,
                                  time.monotonic() + self.limits.max_call_seconds)
        except CallFailed as e:
            direct.send_frame(sock, direct.RESPONSE, {"code": e.code, "details": e.details},
                              None, time.monotonic() + self.limits.max_call_seconds)
            return True
        finally:
            close = getattr(answers, "close", None)
            if close is not None:
                close()  # ends its turn even when the client left mid-stream
            del arrays
        if not _peer_open(sock):
            return False  # the client gave up on the call: it closes this connection
        direct.send_frame(sock, direct.RESPONSE, {"code": "OK", "end": True}, None,
                          time.monotonic() + self.limits.max_call_seconds)
        return True


def _shutdown(fd: int) -> None:
    """Ends a connection another thread serves (its blocked read returns at once), by its
    file descriptor: the socket object may be wrapped in TLS by now. Called under the
    server's lock, while that thread has not closed the descriptor yet."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.close()


def _peer_open(sock: Any) -> bool:
    """False once the client closed the connection (it sends nothing while it waits for an
    answer, so a readable socket means it closed, or broke the protocol)."""
    return not direct.readable(sock)


__all__ = ["CallFailed", "DirectServer", "EVICT_IDLE_SECONDS", "HANDSHAKE_SECONDS",
           "IDLE_SECONDS", "MAX_HANDSHAKES"]
