"""The direct transport: calls over one authenticated socket, no gRPC per call (ps and workers).

gRPC Python costs a fixed ~0.6-1 ms per call and copies every received byte twice before our
code sees it (see docs/parameter_server.md). Each ``ParameterServer`` therefore also listens on
a second port (same host, advertised in its ``Ping`` answer) that speaks the same requests as
length-prefixed frames over a plain socket: mutual TLS with the same certificates as the gRPC
port (plaintext only where gRPC would allow it: loopback, explicitly asked for), then the
cluster token, then any number of calls, one at a time per connection. Arrays go from the
numpy buffer to the socket and from the socket into a ``RECEIVE_POOL`` buffer with no copy
in between; on a plaintext socket a frame's header and arrays leave in one ``sendmsg``.

Frames: a 16-byte prefix ``<4sIQ`` (magic, JSON header length, payload length), the JSON
header, then the payload (arrays at 64-byte aligned offsets, as ``jaxdist._src.transport.wire``).

* server -> client on connect: ``JDH1`` ``{"task", "incarnation"}``;
* client -> server: ``JDA1`` ``{"token"}`` (the cluster token; on a worker's direct port the
  chief's signed connection credential); the server answers a response frame (``OK`` or
  ``UNAUTHENTICATED``, then it closes);
* request: ``JDQ1`` ``{"method", "meta", "arrays"}`` + payload;
* response: ``JDR1`` ``{"code", "details", "meta", "arrays"}`` + payload (``code`` is a
  ``grpc.StatusCode`` name, so errors are the gRPC path's typed errors).

Every length is checked before anything is allocated (header at most ``MAX_HEADER_BYTES``,
payload at most the server's ``max_request_bytes``); every array spec goes through the checks
of ``jaxdist._src.transport.wire``. ``JAXDIST_PS_DIRECT=0`` turns the transport off (server and
client).

Example:
    >>> pool = DirectPool(["127.0.0.1:2222"], token, tls, ping, translate)  # doctest: +SKIP
    >>> meta, arrays = pool.call(0, "Pull", {"keys": ["w"]}, {}, deadline, 5.0)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from jaxdist._src.security.tls import TLSConfig, check_plaintext_allowed
from jaxdist._src.transport import wire
from jaxdist._src.transport.memory import ALIGNMENT, RECEIVE_POOL, BufferPool, aligned_empty

ENV_DIRECT = "JAXDIST_PS_DIRECT"
PREFIX = struct.Struct("<4sIQ")
HELLO, AUTH, REQUEST, RESPONSE = b"JDH1", b"JDA1", b"JDQ1", b"JDR1"
MAX_HEADER_BYTES = 64 << 20
MAX_HANDSHAKE_BYTES = 4096
#: Methods never sent over the direct transport (``Stop`` ends the server: keep it on gRPC).
GRPC_ONLY = frozenset({"Stop"})
_SMALL = 256 << 10  # arrays below this are joined into one send with the header
IDLE_REUSE_S = 60.0  # a pooled connection idle for longer is not reused
_MAX_IOV = 64  # buffers per sendmsg call (the kernel accepts up to IOV_MAX = 1024)
#: A new connection's TCP connect, TLS handshake, hello and token must be done within this
#: (or the call's deadline, if sooner): a hung task is left to gRPC, whose calls can be
#: cancelled, instead of holding the caller for the whole call's deadline.
CONNECT_SECONDS = 10.0
_TIMEOUT_SLACK_S = 0.05  # see _set_timeout
#: A frame whose payload is at most this many bytes is read with its header in one read.
_ONE_READ_BYTES = 64 << 10


def enabled(env: str = ENV_DIRECT) -> bool:
    """False when the environment variable ``env`` (default ``JAXDIST_PS_DIRECT``) is
    ``0``/``false``/``no``.

    Example:
        >>> from jaxdist._src.transport.direct import enabled
        >>> enabled()
        True
    """
    return os.environ.get(env, "1").strip().lower() not in ("0", "false", "no")


def readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has something to read now (or is broken). On a connection where the
    peer sends nothing until it is answered, that means the peer closed it."""
    try:
        ready, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(ready)


class FrameError(wire.WireError):
    """A frame that is malformed, too large, or of the wrong kind."""


# ---------------------------------------------------------------------- frames
def _set_timeout(sock: socket.socket, left: float) -> None:
    """Bounds the next blocking socket operation by ``left`` seconds.

    ``settimeout`` is a system call; a frame's reads and writes come microseconds apart, so
    the timeout already set is kept while it lies within ``_TIMEOUT_SLACK_S`` above ``left``
    (a wait may end that much after the deadline, never before it).
    """
    cur = sock.gettimeout()
    if cur is None or cur < left or cur > left + _TIMEOUT_SLACK_S:
        sock.settimeout(left)


#: A read of at least this many bytes over TCP waits for ``_LOWAT_BYTES`` to arrive before
#: it wakes (``_recv_exact``).
_LOWAT_MIN_READ = 512 << 10
_LOWAT_BYTES = 256 << 10
#: What may already be off the socket but not yet read (TLS: a partial record in OpenSSL's
#: buffer and a decrypted one), so a low-water mark never waits for bytes that will not come.
_LOWAT_SLACK = 40 << 10
#: Below this, the mark goes back to 1 byte.
_LOWAT_FLOOR = 32 << 10
_SO_RCVLOWAT = getattr(socket, "SO_RCVLOWAT", None)


def _set_lowat(sock: socket.socket, nbytes: int) -> bool:
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_RCVLOWAT, nbytes)
        return True
    except (OSError, ValueError, TypeError):
        return False


def _start_lowat(sock: socket.socket, nbytes: int) -> int:
    """The low-water mark set for a read of ``nbytes`` (0: none). TCP only: there ``poll``
    honours it (an AF_UNIX socket, in tests, would report data it then refuses to wait for)."""
    if (_SO_RCVLOWAT is None or nbytes < _LOWAT_MIN_READ
            or getattr(sock, "family", None) not in (socket.AF_INET, socket.AF_INET6)):
        return 0
    return _LOWAT_BYTES if _set_lowat(sock, _LOWAT_BYTES) else 0


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
    """Reads exactly ``len(view)`` bytes by ``deadline``.

    A large read (a parameter pull, a gradient push) sets the socket's ``SO_RCVLOWAT`` so
    that a wait for data ends once ``_LOWAT_BYTES`` have arrived, not at every TCP segment:
    otherwise the reader wakes (and, on a busy machine, preempts the sender) a dozen times
    for one 1 MiB frame. The mark stays ``_LOWAT_SLACK`` below the bytes still to come (it is
    halved as the frame's end nears), and is set back to 1 at the end, whatever happens.
    """
    got, n = 0, len(view)
    lowat = _start_lowat(sock, n)
    try:
        while got < n:
            if lowat > 1 and lowat > n - got - _LOWAT_SLACK:
                half = (n - got - _LOWAT_SLACK) // 2
                lowat = half if half >= _LOWAT_FLOOR else 1
                _set_lowat(sock, lowat)
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("deadline passed")
                _set_timeout(sock, left)
            k = sock.recv_into(view[got:])
            if not k:
                raise ConnectionError("the peer closed the connection")
            got += k
    finally:
        if lowat > 1:
            _set_lowat(sock, 1)


def _specs(arrays: Mapping[str, Any]) -> tuple[list, list[Any], int]:
    specs, views, offset = [], [], 0
    for name, x in arrays.items():
        arr = wire.as_wire_array(x)
        pad = (-offset) % ALIGNMENT
        if pad and arr.nbytes:
            views.append(bytes(pad))
            offset += pad
        specs.append([name, wire.dtype_name(arr.dtype), list(arr.shape), offset, arr.nbytes])
        offset += arr.nbytes
        if arr.nbytes:
            views.append(memoryview(arr.reshape(-1).view(np.uint8)))
    return specs, views, offset


def _gather(sock: socket.socket, buffers: list[Any], deadline: float | None) -> None:
    """Sends ``buffers`` in order with ``sendmsg`` (a plain socket): the header and the
    arrays leave in one system call, so the receiver wakes once for them, not once for the
    header and again for the payload."""
    buffers = [memoryview(b).cast("B") for b in buffers if len(b)]
    while buffers:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            _set_timeout(sock, left)
        sent = sock.sendmsg(buffers[:_MAX_IOV])
        while sent:
            if sent >= len(buffers[0]):
                sent -= len(buffers.pop(0))
            else:
                buffers[0] = buffers[0][sent:]
                sent = 0


def send_frame(sock: socket.socket, magic: bytes, header: Mapping[str, Any],
               arrays: Mapping[str, Any] | None = None, deadline: float | None = None) -> None:
    """Sends one frame: prefix, JSON ``header`` (plus the arrays' specs), payload."""
    specs, views, total = _specs(arrays or {})
    head = json.dumps({**header, "arrays": specs}).encode()
    pending: list[Any] = [PREFIX.pack(magic, len(head), total), head]
    gather = views and not isinstance(sock, ssl.SSLSocket) and hasattr(sock, "sendmsg")
    out: list[Any] = []

    def send(data: Any) -> None:
        if gather:
            out.append(data)
            return
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            _set_timeout(sock, left)
        sock.sendall(data)

    for view in views:
        if len(view) < _SMALL:
            pending.append(view)
            continue
        send(b"".join(pending))
        pending = []
        send(view)
    if pending:
        send(b"".join(pending))
    if out:
        _gather(sock, out, deadline)


def recv_frame(sock: socket.socket, magic: bytes, max_header: int, max_bytes: int | None,
               deadline: float | None, pool: BufferPool | None = RECEIVE_POOL,
               first_deadline: float | None = None, call_seconds: float | None = None,
               started: list[float] | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """Receives one frame of kind ``magic``: returns its header (without ``arrays``) and arrays.

    Lengths are checked against ``max_header`` / ``max_bytes`` before anything is allocated.
    The prefix must arrive by ``first_deadline`` (default ``deadline``); the rest by
    ``deadline``, or within ``call_seconds`` of the prefix when that is given (the time the
    prefix arrived is appended to ``started``).

    Raises:
        wire.MessageTooLargeError: the payload is larger than ``max_bytes``.
        FrameError: bad magic, header or array specs.
        TimeoutError / ConnectionError / OSError: the socket failed or the deadline passed.
    """
    prefix = bytearray(PREFIX.size)
    _recv_exact(sock, memoryview(prefix), first_deadline if first_deadline else deadline)
    if started is not None:
        started.append(time.monotonic())
    if call_seconds is not None:
        deadline = time.monotonic() + call_seconds
    got_magic, hlen, total = PREFIX.unpack(prefix)
    if got_magic != magic:
        raise FrameError(f"bad frame magic {bytes(got_magic)!r}: expected {magic!r}")
    if hlen > max_header:
        raise FrameError(f"frame header of {hlen} bytes is larger than the {max_header} "
                         f"accepted")
    if max_bytes is not None and total > max_bytes:
        raise wire.MessageTooLargeError(
            f"message declares {total} payload bytes, more than the {max_bytes} this receiver "
            f"accepts (max_request_bytes)")
    if total <= _ONE_READ_BYTES and hlen <= _ONE_READ_BYTES:
        # A small frame (a ps answer, a closure's result): header and payload in one read,
        # into one buffer where the payload starts aligned.
        pad = (-hlen) % ALIGNMENT
        buf = aligned_empty(pad + hlen + total)
        _recv_exact(sock, memoryview(buf)[pad:], deadline)
        header = _parse(buf[pad:pad + hlen].tobytes())
        specs = wire.check_specs(header.pop("arrays"), total)
        payload = buf[pad + hlen:]
    else:
        raw = bytearray(hlen)
        _recv_exact(sock, memoryview(raw), deadline)
        header = _parse(raw)
        specs = wire.check_specs(header.pop("arrays"), total)
        try:
            payload = pool.take(total) if pool is not None else np.empty(total, np.uint8)
        except (MemoryError, ValueError):
            raise wire.MessageTooLargeError(
                f"message declares {total} payload bytes: cannot allocate them") from None
        if total:
            _recv_exact(sock, memoryview(payload), deadline)
    arrays = {name: payload[off:off + n].view(dt).reshape(shape)
              for name, dt, shape, off, n in specs}
    return header, arrays


def _parse(raw: bytes | bytearray) -> dict:
    try:
        header = wire.loads_header(raw)
    except wire.WireError as e:
        raise FrameError(f"bad frame header: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("arrays"), list):
        raise FrameError("bad frame header: expected a JSON object with an 'arrays' list")
    return header


# ---------------------------------------------------------------------- TLS
def server_context(tls: TLSConfig) -> ssl.SSLContext:
    """TLS context of a direct port: presents the task's certificate, requires a client
    certificate signed by the cluster CA (as the gRPC port)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(tls.ca)
    ctx.load_cert_chain(tls.cert, tls.key)
    return ctx


def client_context(tls: TLSConfig) -> ssl.SSLContext:
    """TLS context of a direct client: verifies the server against the cluster CA and its
    name (the host dialled, or ``tls.server_name``), presents this task's certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(tls.ca)
    ctx.load_cert_chain(tls.cert, tls.key)
    return ctx


# ---------------------------------------------------------------------- client
class _Conn:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.last_used = time.monotonic()

    def stale(self) -> bool:
        """True when the server closed it (readable with nothing asked) or it idled long."""
        return time.monotonic() - self.last_used > IDLE_REUSE_S or readable(self.sock)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Unavailable(Exception):
    """The direct transport cannot serve this call; use gRPC (nothing reached the server)."""


class DirectPool:
    """Connections of one client to the direct ports of the ps tasks.

    Args:
        addresses: the tasks' gRPC ``host:port`` (the direct port is on the same host).
        token: the cluster token, or ``token(task, hello) -> credential`` giving the
            credential for one new connection to ``task`` (``hello``: the server's hello,
            its incarnation already checked; the worker direct port wants the chief's signed
            credential for that task and incarnation).
        tls: the client's TLS identity (``None``: plaintext, loopback only).
        ping: ``ping(task, timeout) -> meta`` over gRPC (says the direct port).
        error: ``error(task, method, timeout, code_name, details) -> Exception``.
        max_idle: pooled idle connections per task.
        job: the tasks' job name (in messages).
    """

    def __init__(self, addresses: Sequence[str],
                 token: str | Callable[[int, dict], Any] | None, tls: TLSConfig | None,
                 ping: Callable[[int, float], dict], error: Callable[..., Exception],
                 max_idle: int = 4, job: str = "ps"):
        self.addresses = list(addresses)
        self.job = job
        self._token = token or ""
        self._ctx = client_context(tls) if tls is not None else None
        self._server_name = tls.server_name if tls is not None else None
        self._ping, self._error = ping, error
        self._max_idle = max_idle
        self._lock = threading.Lock()
        self._idle: list[list[_Conn]] = [[] for _ in self.addresses]
        # task -> {"port", "incarnation", "max_request_bytes"}, or {} when it has no port
        self._info: list[dict | None] = [None] * len(self.addresses)
        self.calls = 0

    def _discover(self, task: int, timeout: float) -> dict:
        info = self._info[task]
        if info is None:
            try:
                meta = self._ping(task, min(timeout, 10.0))
            except Exception:  # noqa: BLE001 - the gRPC path reports it
                raise Unavailable() from None
            port = meta.get("direct_port")
            info = ({"port": port, "incarnation": meta.get("incarnation"),
                     "max_request_bytes": meta.get("max_request_bytes")}
                    if isinstance(port, int) and 0 < port < 65536 else {})
            self._info[task] = info
        return info

    def forget(self, task: int) -> None:
        """Drops the task's connections and port (it restarted, or the transport failed)."""
        with self._lock:
            conns, self._idle[task] = self._idle[task], []
            self._info[task] = None
        for c in conns:
            c.close()

    def _connect(self, task: int, info: dict, deadline: float) -> _Conn:
        host = self.addresses[task].rsplit(":", 1)[0].strip("[]")
        deadline = min(deadline, time.monotonic() + CONNECT_SECONDS)
        try:
            wait = max(1e-3, deadline - time.monotonic())
            raw = socket.create_connection((host, info["port"]), timeout=wait)
        except OSError:
            self.forget(task)
            raise Unavailable() from None
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ctx is not None:
                sock = self._ctx.wrap_socket(raw, server_hostname=self._server_name or host)
            else:
                check_plaintext_allowed(f"{self.job}:{task}", self.addresses[task])
                sock = raw
            hello, _ = recv_frame(sock, HELLO, MAX_HANDSHAKE_BYTES, 0, deadline, None)
            if hello.get("incarnation") != info.get("incarnation"):
                raise ConnectionError("the task restarted")  # rediscover before sending the token
            credential = self._token(task, hello) if callable(self._token) else self._token
            send_frame(sock, AUTH, {"token": credential}, None, deadline)
            reply, _ = recv_frame(sock, RESPONSE, MAX_HANDSHAKE_BYTES, 0, deadline, None)
        except (OSError, wire.WireError, ssl.SSLError):
            raw.close()
            self.forget(task)
            raise Unavailable() from None
        if reply.get("code") == "RESOURCE_EXHAUSTED":  # no slot for this peer: use gRPC
            raw.close()
            raise Unavailable()
        if reply.get("code") != "OK":
            raw.close()
            raise self._error(task, "Connect", 0.0, reply.get("code"), reply.get("details"))
        return _Conn(sock)

    def _take(self, task: int, info: dict, deadline: float) -> _Conn:
        while True:
            with self._lock:
                conn = self._idle[task].pop() if self._idle[task] else None
            if conn is None:
                return self._connect(task, info, deadline)
            if not conn.stale():
                return conn
            conn.close()

    def _give(self, task: int, conn: _Conn) -> None:
        conn.last_used = time.monotonic()
        with self._lock:
            if len(self._idle[task]) < self._max_idle:
                self._idle[task].append(conn)
                return
        conn.close()

    def _open(self, task: int, arrays: dict, deadline: float) -> _Conn:
        """A connection to ``task`` for a request carrying ``arrays``.

        Raises:
            Unavailable: the task has no direct port, the request is over its limit (gRPC
                answers RESOURCE_EXHAUSTED with the usual message), or it cannot be reached.
        """
        info = self._discover(task, deadline - time.monotonic())
        if not info:
            raise Unavailable()
        limit = info.get("max_request_bytes")
        if isinstance(limit, int) and wire.message_nbytes(arrays) > limit:
            raise Unavailable()
        return self._take(task, info, deadline)

    def call(self, task: int, method: str, meta: dict, arrays: dict, deadline: float,
             timeout: float, idempotent: bool) -> tuple[dict, dict]:
        """One call over the direct transport.

        Raises:
            Unavailable: the task has no direct port or cannot be reached (nothing sent, or
                an idempotent call that failed): the caller uses gRPC.
            PSError: the server's typed error, or ``PSUnavailableError`` when a
                non-idempotent call was lost in flight or the deadline passed.
        """
        if method in GRPC_ONLY:
            raise Unavailable()
        conn = self._open(task, arrays, deadline)
        sent = False
        try:
            send_frame(conn.sock, REQUEST, {"method": method, "meta": meta}, arrays, deadline)
            sent = True
            header, out = recv_frame(conn.sock, RESPONSE, MAX_HEADER_BYTES, None, deadline)
        except TimeoutError:
            conn.close()
            raise self._error(task, method, timeout, "DEADLINE_EXCEEDED",
                              "deadline passed (direct transport)") from None
        except (OSError, wire.WireError, ssl.SSLError) as e:
            conn.close()
            self.forget(task)
            if idempotent or not sent:
                raise Unavailable() from None
            raise self._error(task, method, timeout, "UNAVAILABLE",
                              f"connection lost during the call ({type(e).__name__})") from None
        self.calls += 1
        code = header.get("code")
        if code != "OK":
            if header.get("close"):
                conn.close()
            else:
                self._give(task, conn)
            raise self._error(task, method, timeout, code, header.get("details", ""))
        self._give(task, conn)
        meta_out = header.get("meta")
        return (meta_out if isinstance(meta_out, dict) else {}), out

    def call_stream(self, task: int, method: str, meta: dict, arrays: dict, deadline: float,
                    timeout: float, on_start: Callable[[Any], None] | None = None
                    ) -> Iterator[tuple[dict, dict]]:
        """Starts one streaming call (a method the server answers with several frames); the
        request has been sent when this returns. The iterator yields each answer as it
        arrives; ``on_start`` gets the call (its ``cancel()`` closes the connection, which
        the server sees as the client giving up).

        Raises (here):
            Unavailable: no direct port, or nothing could be sent (the caller uses gRPC).
        Raises (while iterating):
            Exception: ``error(...)`` of the server's failure, of a lost connection
                (``UNAVAILABLE``), of a cancelled call (``CANCELLED``) or of the deadline
                (``DEADLINE_EXCEEDED``).
        """
        conn = self._open(task, arrays, deadline)
        try:
            send_frame(conn.sock, REQUEST, {"method": method, "meta": meta}, arrays, deadline)
        except (OSError, wire.WireError, ssl.SSLError):
            conn.close()
            self.forget(task)
            raise Unavailable() from None  # an incomplete frame: nothing can have run
        call = _StreamCall(conn)
        if on_start is not None:
            on_start(call)
        return self._stream_answers(task, method, timeout, deadline, call)

    def _stream_answers(self, task: int, method: str, timeout: float, deadline: float,
                        call: _StreamCall) -> Iterator[tuple[dict, dict]]:
        conn, done = call.conn, False
        try:
            while True:
                try:
                    header, out = recv_frame(conn.sock, RESPONSE, MAX_HEADER_BYTES, None,
                                             deadline)
                except TimeoutError:
                    raise self._error(task, method, timeout, "DEADLINE_EXCEEDED",
                                      "deadline passed (direct transport)") from None
                except (OSError, wire.WireError, ssl.SSLError) as e:
                    if call.cancelled:
                        raise self._error(task, method, timeout, "CANCELLED",
                                          "the call was cancelled") from None
                    self.forget(task)
                    raise self._error(task, method, timeout, "UNAVAILABLE",
                                      f"connection lost during the call ({type(e).__name__})"
                                      ) from None
                code = header.get("code")
                if code != "OK":
                    raise self._error(task, method, timeout, code, header.get("details", ""))
                if header.get("end"):
                    done = True
                    return
                meta_out = header.get("meta")
                yield (meta_out if isinstance(meta_out, dict) else {}), out
        finally:
            if done and not call.cancelled:
                self.calls += 1
                self._give(task, conn)
            else:  # failed, cancelled, or the caller stopped reading: the server sees it
                conn.close()

    def close(self) -> None:
        for task in range(len(self.addresses)):
            self.forget(task)


class _StreamCall:
    """A streaming call in flight: ``cancel()`` from any thread ends it."""

    def __init__(self, conn: _Conn):
        self.conn, self.cancelled = conn, False

    def cancel(self) -> None:
        self.cancelled = True
        try:  # the plain socket's shutdown: wakes a reader blocked in recv at once
            socket.socket.shutdown(self.conn.sock, socket.SHUT_RDWR)
        except OSError:
            pass


__all__ = ["ENV_DIRECT", "DirectPool", "FrameError", "enabled", "readable", "recv_frame",
           "send_frame"]
