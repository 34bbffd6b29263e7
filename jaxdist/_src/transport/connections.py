"""Connection limits of every listening port: handshake deadline, caps, idle timeout.

A connection costs a server a file descriptor (and, before its TLS handshake ends, a
handshaker) whether or not it ever authenticates. ``ConnectionLimits`` bounds what
connections that never authenticate, or go quiet, may hold on a port, in the way OpenSSH's
``LoginGraceTime`` / ``MaxStartups`` / ``PerSourceMaxStartups`` and gRPC's server hardening
options do:

* ``handshake_seconds``: a connection must finish its TLS handshake (on the gRPC ports: TLS and
  the HTTP/2 preface; on the direct and handshake ports: TLS and its credential) within this
  long of its accept, else it is closed (gRPC: ``grpc.server_handshake_timeout_ms``).
* ``idle_seconds``: an authenticated gRPC connection with no call for this long is closed
  (``grpc.max_connection_idle_ms``, with a GOAWAY: its client reconnects on its next call).
* ``max_connections``: connections a gRPC port holds at once (gRPC refuses more:
  ``grpc.max_allowed_incoming_connections``); never more than half the open-files limit left
  after a reserve, so a flood cannot run the process out of file descriptors. Past three
  quarters of it, ``ConnectionGate`` closes the connections idle the longest, so a new client
  finds room (OpenSSH's early drop).
* ``max_connections_per_peer``: connections one peer address holds on a gRPC port (more: the
  ones of that address idle the longest are closed), and connections one address may have
  authenticating at once on a direct or handshake port (more: its oldest is closed).

The gRPC ports also enforce keepalive pings (a client may ping at most every 60 s with no
call in flight, two strikes and its connection is closed: ``grpc.http2.max_ping_strikes``)
and, while a call is in flight, ping the client every 60 s, closing the connection when it
does not answer within 20 s (a host that vanished).

gRPC has no per-address cap, and no choice of which connection to close when full:
``ConnectionGate`` is one daemon thread per process that, every ``GATE_SECONDS``, lists the
process's sockets of each watched port (``/proc/self/fd``), reads how long each has been
silent (``TCP_INFO``: last data received or sent) and shuts down (``shutdown(2)`` on a
duplicate of the descriptor; gRPC then closes it as a peer's close) the most idle ones past a
cap. It exists only on Linux; elsewhere the gRPC limits above still hold.

Each limit has an environment variable: ``JAXDIST_HANDSHAKE_SECONDS``,
``JAXDIST_CONNECTION_IDLE_SECONDS``, ``JAXDIST_MAX_CONNECTIONS``,
``JAXDIST_MAX_CONNECTIONS_PER_PEER``.

Example:
    >>> from jaxdist._src.transport.connections import ConnectionLimits, grpc_options
    >>> limits = ConnectionLimits.from_env(handshake_seconds=5.0)
    >>> ("grpc.server_handshake_timeout_ms", 5000) in grpc_options(limits)
    True
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import socket
import stat
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from jaxdist._src.transport.limits import parse_positive

log = logging.getLogger(__name__)

ENV_HANDSHAKE_SECONDS = "JAXDIST_HANDSHAKE_SECONDS"
ENV_IDLE_SECONDS = "JAXDIST_CONNECTION_IDLE_SECONDS"
ENV_MAX_CONNECTIONS = "JAXDIST_MAX_CONNECTIONS"
ENV_MAX_CONNECTIONS_PER_PEER = "JAXDIST_MAX_CONNECTIONS_PER_PEER"

DEFAULT_HANDSHAKE_SECONDS = 10.0
DEFAULT_IDLE_SECONDS = 120.0
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_MAX_CONNECTIONS_PER_PEER = 128

#: File descriptors kept out of the connection cap (checkpoints, channels, the direct port).
FD_RESERVE = 128
#: How often ``ConnectionGate`` looks at the watched ports.
GATE_SECONDS = 0.25
#: The soft open-files limit is raised to the hard one, but not past this.
MAX_NOFILE = 1 << 20

KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 60_000),  # ping a silent client every minute ...
    ("grpc.keepalive_timeout_ms", 20_000),  # ... and close it when it does not answer
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 60_000),
    ("grpc.http2.max_ping_strikes", 2),
]


@dataclass(frozen=True)
class ConnectionLimits:
    """What connections may hold on a listening port (see the module's docstring).

    Args:
        handshake_seconds: seconds from accept to a finished TLS handshake (and credential).
        idle_seconds: seconds an authenticated gRPC connection may carry no call.
        max_connections: connections one gRPC port holds at once (bounded by the open-files
            limit, see ``effective_max_connections``).
        max_connections_per_peer: connections of one peer address on a gRPC port; connections
            of one address authenticating at once on a direct or handshake port.

    Example:
        >>> from jaxdist._src.transport.connections import ConnectionLimits
        >>> ConnectionLimits(handshake_seconds=2.0).max_connections
        1024
    """

    handshake_seconds: float = DEFAULT_HANDSHAKE_SECONDS
    idle_seconds: float = DEFAULT_IDLE_SECONDS
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_peer: int = DEFAULT_MAX_CONNECTIONS_PER_PEER

    def __post_init__(self):
        for name in ("handshake_seconds", "idle_seconds", "max_connections",
                     "max_connections_per_peer"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ConnectionLimits.{name}={value!r}: expected a positive "
                                 f"number")

    @classmethod
    def from_env(cls, handshake_seconds: float | None = None,
                 idle_seconds: float | None = None, max_connections: int | None = None,
                 max_connections_per_peer: int | None = None) -> ConnectionLimits:
        """Limits from the arguments, else the environment, else the defaults.

        Raises:
            ValueError: an environment variable is not a positive number (it is named).

        Example:
            >>> from jaxdist._src.transport.connections import ConnectionLimits
            >>> ConnectionLimits.from_env(idle_seconds=30.0).idle_seconds
            30.0
        """
        env = os.environ

        def pick(value: Any, name: str, kind: type, default: Any) -> Any:
            if value is not None:
                return kind(value)
            text = env.get(name)
            return parse_positive(name, text, kind) if text else default

        return cls(pick(handshake_seconds, ENV_HANDSHAKE_SECONDS, float,
                        DEFAULT_HANDSHAKE_SECONDS),
                   pick(idle_seconds, ENV_IDLE_SECONDS, float, DEFAULT_IDLE_SECONDS),
                   pick(max_connections, ENV_MAX_CONNECTIONS, int, DEFAULT_MAX_CONNECTIONS),
                   pick(max_connections_per_peer, ENV_MAX_CONNECTIONS_PER_PEER, int,
                        DEFAULT_MAX_CONNECTIONS_PER_PEER))

    def effective_max_connections(self) -> int:
        """``max_connections``, but at most half of the open-files limit left after
        ``FD_RESERVE`` (never below 16).

        Example:
            >>> from jaxdist._src.transport.connections import ConnectionLimits
            >>> ConnectionLimits(max_connections=100).effective_max_connections()
            100
        """
        soft = _nofile()[0]
        if soft is None:
            return self.max_connections
        return max(16, min(self.max_connections, (soft - FD_RESERVE) // 2))


def _nofile() -> tuple[int | None, int | None]:
    try:
        import resource
    except ImportError:  # not on POSIX
        return None, None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    inf = resource.RLIM_INFINITY
    return (None if soft == inf else soft), (None if hard == inf else hard)


_raised = False


def raise_open_files_limit() -> None:
    """Raises the soft open-files limit to the hard one (at most ``MAX_NOFILE``), once per
    process, silently (a limit that cannot be raised stays as it is).

    Example:
        >>> from jaxdist._src.transport.connections import raise_open_files_limit
        >>> raise_open_files_limit()   # bind_server calls it
    """
    global _raised
    if _raised:
        return
    _raised = True
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = MAX_NOFILE if hard == resource.RLIM_INFINITY else min(hard, MAX_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):
        pass


def grpc_options(limits: ConnectionLimits) -> list[tuple[str, Any]]:
    """The gRPC server options that enforce ``limits`` (and the keepalive policy).

    Example:
        >>> from jaxdist._src.transport.connections import ConnectionLimits, grpc_options
        >>> dict(grpc_options(ConnectionLimits(idle_seconds=60.0)))["grpc.max_connection_idle_ms"]
        60000
    """
    return [
        ("grpc.server_handshake_timeout_ms", int(limits.handshake_seconds * 1000)),
        ("grpc.max_connection_idle_ms", int(limits.idle_seconds * 1000)),
        ("grpc.max_allowed_incoming_connections", limits.effective_max_connections()),
        *KEEPALIVE_OPTIONS,
    ]


# ---------------------------------------------------------------------- the gate
_TCP_INFO_LEN = 136  # through tcpi_bytes_received (Linux 4.1)
#: A connection that has received this many bytes has, as far as the gate can tell, finished
#: its TLS handshake (a client's side of a mutual-TLS handshake is about 2 KiB: its hello, its
#: certificate, its proof; an idle or half-TLS connection has received 0 or 5 bytes): it is
#: closed after every connection that has not, whatever their idle times. (A plaintext
#: connection has received about 460 bytes after its first call: the idle time alone ranks it
#: until it has received more.)
ESTABLISHED_BYTES = 1024
_TCP_ESTABLISHED = 1


@dataclass
class _Watched:
    name: str
    limits: ConnectionLimits
    cap: int  # gRPC's own cap for the port
    closed: int = 0  # connections the gate shut down


def _socket_fds() -> dict[int, int]:
    """The process's socket descriptors: fd -> the socket's inode."""
    out = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        fd = int(name)
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if stat.S_ISSOCK(st.st_mode):
            out[fd] = st.st_ino
    return out


def _classify(fd: int) -> tuple[int, str] | None:
    """``(local port, peer address)`` of a connected TCP socket; None for anything else."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if dup.type != socket.SOCK_STREAM or dup.family not in (socket.AF_INET,
                                                                socket.AF_INET6):
            return None
        return dup.getsockname()[1], dup.getpeername()[0]
    except OSError:
        return None
    finally:
        dup.close()


def _port_sockets(ports: set[int]) -> Iterator[tuple[int, socket.socket]]:
    """``(port, duplicate)`` for each connected TCP socket of this process whose local port
    is in ``ports`` (the caller closes each duplicate)."""
    for fd in _socket_fds():
        got = _classify(fd)
        if got is None or got[0] not in ports:
            continue
        try:
            yield got[0], socket.socket(fileno=os.dup(fd))
        except OSError:
            continue


def _peer_and_idle(sock: socket.socket) -> tuple[str, tuple[int, float]] | None:
    """The peer's address and the connection's place in the order of closing: ``(0 if it has
    received ``ESTABLISHED_BYTES`` else 1, seconds since data last went either way)``, the
    largest closed first; None: not an established connection (the listener, one closing)."""
    try:
        host = sock.getpeername()[0]
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except OSError:
        return None
    if info[0] != _TCP_ESTABLISHED:
        return None
    last_sent, _, last_recv = struct.unpack_from("<III", info, 44)
    received = struct.unpack_from("<Q", info, 128)[0] if len(info) >= 136 else 0
    return host, (0 if received >= ESTABLISHED_BYTES else 1, min(last_sent, last_recv) / 1000)


class ConnectionGate:
    """Keeps each watched port's connections under its caps, closing the most idle first.

    One per process (``ConnectionGate.shared()``); a server ``watch``es its port when it
    starts and ``unwatch``es it when it stops. Per port: a peer address holding more than
    ``max_connections_per_peer`` loses its most idle connections; more than three quarters
    of the port's cap, and the most idle connections of the port are closed down to that.
    Connections that look unauthenticated (fewer than ``ESTABLISHED_BYTES`` received) go
    before the others.

    Example:
        >>> from jaxdist._src.transport.connections import ConnectionGate
        >>> gate = ConnectionGate.shared()
        >>> gate.watch(40123, "ps:0 gRPC", ConnectionLimits())  # doctest: +SKIP
        >>> gate.unwatch(40123)  # doctest: +SKIP
    """

    _shared: ConnectionGate | None = None
    _shared_lock = threading.Lock()

    def __init__(self, interval: float = GATE_SECONDS):
        self.interval = interval
        self._ports: dict[int, _Watched] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # a socket's inode -> (local port, peer address), or None: not a TCP connection
        self._known: dict[int, tuple[int, str] | None] = {}

    @classmethod
    def shared(cls) -> ConnectionGate:
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls()
            return cls._shared

    @staticmethod
    def available() -> bool:
        """Whether this platform lets the gate see its sockets (Linux)."""
        return os.path.isdir("/proc/self/fd") and hasattr(socket, "TCP_INFO")

    def watch(self, port: int, name: str, limits: ConnectionLimits) -> None:
        if not self.available():
            return
        with self._lock:
            self._ports[port] = _Watched(name, limits, limits.effective_max_connections())
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="jaxdist-connection-gate")
                self._thread.start()

    def unwatch(self, port: int) -> None:
        with self._lock:
            self._ports.pop(port, None)

    def closed(self, port: int) -> int:
        """Connections of ``port`` the gate has shut down so far."""
        with self._lock:
            w = self._ports.get(port)
            return 0 if w is None else w.closed

    def _run(self) -> None:
        while True:
            self._wake.wait(self.interval)
            with self._lock:
                ports = dict(self._ports)
            if ports:
                try:
                    self.sweep(ports)
                except Exception:  # noqa: BLE001 - the gate must outlive a surprise
                    log.exception("connection gate: sweep failed")

    def sweep(self, ports: dict[int, _Watched]) -> None:
        """One look at ``ports``: shuts down the connections past their caps.

        A socket's port and peer are read once (cached by its inode); its idle time is read
        only when its port is over a cap, so a sweep below the caps costs an ``fstat`` per
        descriptor.
        """
        fds = _socket_fds()
        known = self._known
        seen: dict[int, tuple[int, str] | None] = {}
        by_port: dict[int, list[int]] = {p: [] for p in ports}
        for fd, inode in fds.items():
            if inode in known:
                got = known[inode]
            else:
                got = _classify(fd)
                if got is not None and got[0] == 0:
                    continue  # not bound yet: look again next time
            seen[inode] = got
            if got is not None and got[0] in by_port:
                by_port[got[0]].append(fd)
        self._known = seen  # forgets the sockets that are gone
        for port, port_fds in by_port.items():
            w = ports[port]
            if len(port_fds) <= min(w.limits.max_connections_per_peer, w.cap * 3 // 4):
                continue  # under every cap, whatever the addresses
            self._trim(w, port_fds)

    def _trim(self, w: _Watched, port_fds: list[int]) -> None:
        socks, items = [], []
        try:
            for fd in port_fds:
                try:
                    dup = socket.socket(fileno=os.dup(fd))
                except OSError:
                    continue
                socks.append(dup)
                got = _peer_and_idle(dup)
                if got is not None:
                    items.append((got[1], got[0], dup))
            victims = self._victims(items, w)
            for *_, dup in victims:
                with contextlib.suppress(OSError):
                    dup.shutdown(socket.SHUT_RDWR)
            if victims:
                with self._lock:
                    w.closed += len(victims)
                log.info("%s: closed %d idle connections past the connection caps "
                         "(max_connections_per_peer=%d, max_connections=%d)", w.name,
                         len(victims), w.limits.max_connections_per_peer, w.cap)
        finally:
            for s in socks:
                s.close()

    @staticmethod
    def _victims(items: list[tuple[Any, str, Any]], w: _Watched) -> list[tuple[Any, str, Any]]:
        """Which of ``items`` (``(order, peer, socket)``, ``_peer_and_idle``'s order: the
        largest first) to close."""
        per_peer: dict[str, list[tuple[Any, str, Any]]] = {}
        for item in items:
            per_peer.setdefault(item[1], []).append(item)
        victims, kept = [], []
        cap = w.limits.max_connections_per_peer
        for group in per_peer.values():
            if len(group) > cap:
                group.sort(key=lambda x: x[0], reverse=True)  # most idle first
                victims += group[:len(group) - cap]
                kept += group[len(group) - cap:]
            else:
                kept += group
        room = w.cap * 3 // 4
        if len(kept) > room:
            victims += heapq.nlargest(len(kept) - room, kept, key=lambda x: x[0])
        return victims


__all__ = [
    "ENV_HANDSHAKE_SECONDS",
    "ENV_IDLE_SECONDS",
    "ENV_MAX_CONNECTIONS",
    "ENV_MAX_CONNECTIONS_PER_PEER",
    "ConnectionGate",
    "ConnectionLimits",
    "grpc_options",
    "raise_open_files_limit",
]
