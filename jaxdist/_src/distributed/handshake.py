"""The authenticated handshake every process of a sync group does with process 0 before
``jax.distributed`` starts.

JAX's coordination service and gloo authenticate nobody: whoever reaches the service's port
can register as a task. So before process 0 starts the service, it listens on the service's
own port (on the interface the cluster spec names) and every other process proves it holds
the cluster token, and process 0 proves it to them, by HMAC-SHA256 challenge-response over a
short TCP exchange (inside mutual TLS when the task has TLS material, see
``jaxdist._src.security.tls``):

1. joiner -> chief: ``MAGIC``, its process id, a fresh 32-byte nonce;
2. chief -> joiner: its nonce and ``HMAC(token, "chief" | group | pid | n_joiner | n_chief)``;
3. joiner checks it (else: ``ClusterAuthenticationError``, the chief does not hold the
   token), answers ``HMAC(token, "joiner" | group | pid | n_chief | n_joiner)``;
4. chief checks it: a wrong answer is refused (``NO``) and the chief keeps waiting for the
   real process; a right one is kept open;
5. once every process has proven itself, the chief closes the listener and sends ``GO`` to
   each; the service then starts on that port.

``group`` is a digest of the group's members and coordinator address, so a process with
another cluster spec is refused too. The token never travels.

Example:
    >>> serve_handshake(group, token, timeout=60)      # process 0  # doctest: +SKIP
    >>> join_handshake(group, token, timeout=60)       # every other process  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import selectors
import socket
import ssl
import struct
import time
from typing import Any

from jaxdist._src.cluster.errors import ClusterError, ClusterTimeoutError

log = logging.getLogger(__name__)

MAGIC = b"JAXDIST-HS1"
_NONCE = 32
_MAC = 32
_IO_SECONDS = 5.0


class ClusterAuthenticationError(ClusterError):
    """A process failed the cluster handshake: wrong cluster token or another cluster spec.

    Attributes:
        tasks: the task names involved (this process, or the one refused).
    """

    def __init__(self, message: str, tasks: tuple[str, ...] = ()):
        super().__init__(message)
        self.tasks = tuple(tasks)


def group_digest(group: Any) -> bytes:
    """A digest of the group's members and coordinator address (both sides compute it).

    Example:
        >>> from jaxdist._src.distributed.handshake import group_digest
        >>> from jaxdist._src.distributed.process_group import process_group
        >>> from jaxdist.cluster_resolver import SimpleClusterResolver
        >>> group = process_group(SimpleClusterResolver(
        ...     {"worker": ["w:1", "w:2"]}, task_type="worker", task_id=0))
        >>> len(group_digest(group))
        32
    """
    text = repr((tuple(group.tasks), group.coordination_address))
    return hashlib.sha256(text.encode()).digest()


def _mac(token: bytes, role: bytes, group: bytes, pid: int, first: bytes,
         second: bytes) -> bytes:
    msg = role + b"|" + group + struct.pack(">I", pid) + first + second
    return hmac.new(token, msg, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("the peer closed the connection")
        buf += part
    return buf


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _tls_material() -> Any:
    """The task's TLS identity if it has one (the handshake then runs inside mutual TLS)."""
    from jaxdist._src.security import tls

    try:
        return tls.resolve_tls(None, "the handshake", environ=dict(os.environ,
                                                                   **{tls.INSECURE_ENV: "1"}))
    except tls.TLSConfigError:
        return None


def _server_context(material: Any) -> ssl.SSLContext | None:
    if material is None:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(material.cert, material.key)
    ctx.load_verify_locations(material.ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _client_context(material: Any) -> ssl.SSLContext | None:
    if material is None:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_cert_chain(material.cert, material.key)
    ctx.load_verify_locations(material.ca)
    return ctx


def serve_handshake(group: Any, token: str, timeout: float, bind_address: str | None = None,
                    tls_material: Any = "auto") -> None:
    """Process 0: waits until every other process of ``group`` has proven the token.

    Every connection is served at once, by one event loop over non-blocking sockets, and must
    finish its TLS handshake and its proof within ``HANDSHAKE_SECONDS`` of being accepted
    (``JAXDIST_HANDSHAKE_SECONDS`` when set; else it is closed): a connection that never
    sends, or sends slowly, holds nothing but its own socket, and a real process is answered
    as soon as its bytes arrive. At most ``MAX_PENDING`` connections wait at once, and at most
    ``MAX_PENDING_PER_PEER`` of one address (or ``JAXDIST_MAX_CONNECTIONS_PER_PEER``, if
    smaller); past either the oldest of them is closed (a real process reconnects), so a flood
    from one address pushes out only its own connections.

    Args:
        group: the ``ProcessGroup`` (``tasks``, ``num_processes``, ``coordination_address``).
        token: the cluster token.
        timeout: seconds to wait for every process.
        bind_address: where to listen (default ``group.coordination_bind_address``).
        tls_material: a ``TLSConfig``, ``None`` for plain TCP, or ``"auto"`` (the task's own,
            if it has one).

    Raises:
        ClusterTimeoutError: not every process proved itself in time (it names them).

    Example:
        >>> serve_handshake(group, token, timeout=60)   # doctest: +SKIP
    """
    material = _tls_material() if tls_material == "auto" else tls_material
    ctx = _server_context(material)
    seconds = _env_limit(HANDSHAKE_SECONDS_ENV, float) or HANDSHAKE_SECONDS
    per_peer = min(MAX_PENDING_PER_PEER, _env_limit(PER_PEER_ENV, int) or MAX_PENDING_PER_PEER)
    key, gdig = token.encode(), group_digest(group)
    host, port = _split(bind_address or group.coordination_bind_address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host or "", port))
    listener.listen(128)
    listener.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, None)
    pending: dict[int, _Joiner] = {}  # by file descriptor
    joined: dict[int, socket.socket] = {}
    expected = set(range(1, group.num_processes))
    deadline = time.monotonic() + timeout

    def drop(j: _Joiner) -> None:
        if pending.get(j.fd) is j:  # its descriptor may already be another connection's
            del pending[j.fd]
        try:
            sel.unregister(j.sock)
        except (KeyError, ValueError):
            pass
        j.sock.close()

    try:
        while set(joined) != expected:
            now = time.monotonic()
            if now >= deadline:
                missing = tuple(group.task_name(i) for i in sorted(expected - set(joined)))
                raise ClusterTimeoutError(
                    f"{group.name} could not join the cluster within {timeout:g} s: the "
                    f"tasks {list(missing)} must all start and prove the cluster token in the "
                    f"handshake with {group.name} at {group.coordination_address} (none did, "
                    f"or with another token)",
                    tasks=missing, timeout_seconds=timeout)
            for j in [j for j in pending.values() if j.deadline <= now]:
                log.info("%s: closed the handshake with %s: it did not finish within %g s",
                         group.name, j.who, seconds)
                drop(j)
            wake = min([deadline, now + 1.0, *(j.deadline for j in pending.values())])
            for sk, _ in sel.select(max(0.0, wake - now)):
                if sk.data is None:
                    _accept(listener, ctx, sel, pending, drop, seconds, per_peer)
                    continue
                j = sk.data
                if pending.get(j.fd) is not j:
                    # dropped earlier in this batch (pushed out by a connection accepted
                    # above): its descriptor may now be that new connection's, which must
                    # keep its place under the caps and its deadline
                    continue
                try:
                    done = j.advance(key, gdig, group)
                except (OSError, ConnectionError, ssl.SSLError) as e:
                    log.warning("%s: handshake with %s failed: %s", group.name, j.who, e)
                    drop(j)
                    continue
                if done is None:
                    sel.modify(j.sock, j.events, j)
                    continue
                pending.pop(j.fd, None)
                sel.unregister(j.sock)
                if done is False:
                    j.sock.close()
                    continue
                j.sock.settimeout(None)
                old = joined.pop(j.pid, None)
                if old is not None:
                    old.close()
                joined[j.pid] = j.sock
        listener.close()  # before GO: the service binds this port next
        for conn in joined.values():
            try:
                conn.sendall(b"GO")
                conn.settimeout(2.0)
                conn.recv(1)  # the joiner closes first (no TIME_WAIT on the service's port)
            except OSError:
                pass
    finally:
        listener.close()
        for j in list(pending.values()):
            j.sock.close()
        for conn in joined.values():
            conn.close()
        sel.close()


HANDSHAKE_SECONDS = 10.0  # a connection's whole handshake (TLS and proof) must fit in this
MAX_PENDING = 256  # connections waiting at once in the handshake (past it: the oldest closes)
MAX_PENDING_PER_PEER = 64  # ... of them from one address (past it: its oldest closes)
# The variables of jaxdist._src.transport.connections.ConnectionLimits (the other ports').
HANDSHAKE_SECONDS_ENV = "JAXDIST_HANDSHAKE_SECONDS"
PER_PEER_ENV = "JAXDIST_MAX_CONNECTIONS_PER_PEER"


def _env_limit(name: str, kind: type) -> Any:
    """A positive number from the environment variable ``name``; None when unset."""
    text = os.environ.get(name)
    if not text:
        return None
    try:
        value = kind(text)
    except ValueError:
        value = 0
    if not value > 0:
        raise ValueError(f"{name}={text!r}: expected a positive {kind.__name__}")
    return value


def _accept(listener: socket.socket, ctx: ssl.SSLContext | None, sel: Any,
            pending: dict[int, _Joiner], drop: Any, seconds: float, per_peer: int) -> None:
    """Accepts every connection waiting on ``listener`` into the event loop."""
    while True:
        try:
            conn, peer = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:  # out of file descriptors, say: the oldest waiter gives way
            log.warning("handshake listener: accept failed: %s", e)
            if pending:
                drop(min(pending.values(), key=lambda j: j.deadline))
            return
        conn.setblocking(False)
        mine = [j for j in pending.values() if j.host == peer[0]]
        if len(mine) >= per_peer:
            drop(min(mine, key=lambda j: j.deadline))
        elif len(pending) >= MAX_PENDING:
            drop(min(pending.values(), key=lambda j: j.deadline))
        try:
            if ctx is not None:
                conn = ctx.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        except (OSError, ssl.SSLError):
            conn.close()
            continue
        j = _Joiner(conn, peer[0], peer[1], ctx is not None, seconds)
        pending[j.fd] = j
        sel.register(conn, j.events, j)


class _Joiner:
    """One connection's place in process 0's side of the handshake (a small state machine).

    ``advance`` runs as far as the bytes at hand allow and says how it ended: ``None`` (wait
    for ``events`` on the socket), ``True`` (the process proved the token: ``pid``) or
    ``False`` (refused; already told ``NO``).
    """

    __slots__ = ("sock", "fd", "host", "who", "deadline", "stage", "inbuf", "out", "pid",
                 "theirs", "mine", "events", "after_send")

    def __init__(self, sock: socket.socket, host: str, port: int, tls: bool, seconds: float):
        self.sock, self.fd, self.host, self.who = sock, sock.fileno(), host, f"{host}:{port}"
        self.deadline = time.monotonic() + seconds
        self.stage = "tls" if tls else "hello"
        self.inbuf, self.out = b"", b""
        self.pid, self.theirs, self.mine = 0, b"", b""
        self.events = selectors.EVENT_READ
        self.after_send: bool | None = None

    def _want(self, n: int) -> bool:
        """Reads until ``n`` bytes are buffered; False: wait for more."""
        while len(self.inbuf) < n:
            try:
                part = self.sock.recv(n - len(self.inbuf))
            except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
                self.events = selectors.EVENT_READ
                return False
            except ssl.SSLWantWriteError:
                self.events = selectors.EVENT_WRITE
                return False
            if not part:
                raise ConnectionError("the peer closed the connection")
            self.inbuf += part
        return True

    def _flush(self) -> bool:
        """Sends what is queued; False: wait until the socket is writable."""
        while self.out:
            try:
                n = self.sock.send(self.out)
            except (ssl.SSLWantWriteError, BlockingIOError, InterruptedError):
                self.events = selectors.EVENT_WRITE
                return False
            except ssl.SSLWantReadError:
                self.events = selectors.EVENT_READ
                return False
            self.out = self.out[n:]
        return True

    def _take(self, n: int) -> bytes:
        data, self.inbuf = self.inbuf[:n], self.inbuf[n:]
        return data

    def advance(self, key: bytes, gdig: bytes, group: Any) -> bool | None:
        while True:
            if not self._flush():
                return None
            if self.after_send is not None:
                return self.after_send
            if self.stage == "tls":
                try:
                    self.sock.do_handshake()  # type: ignore[attr-defined]
                except ssl.SSLWantReadError:
                    self.events = selectors.EVENT_READ
                    return None
                except ssl.SSLWantWriteError:
                    self.events = selectors.EVENT_WRITE
                    return None
                self.stage = "hello"
            elif self.stage == "hello":
                if not self._want(len(MAGIC) + 4 + _NONCE):
                    return None
                hello = self._take(len(MAGIC) + 4 + _NONCE)
                if not hello.startswith(MAGIC):
                    raise ConnectionError("not a jaxdist handshake")
                self.pid = struct.unpack(">I", hello[len(MAGIC):len(MAGIC) + 4])[0]
                self.theirs = hello[-_NONCE:]
                if not 0 < self.pid < group.num_processes:
                    log.warning("%s refused %s: process id %d is not in the group",
                                group.name, self.who, self.pid)
                    self.out, self.after_send = b"NO", False
                    continue
                self.mine = secrets.token_bytes(_NONCE)
                self.out = self.mine + _mac(key, b"chief", gdig, self.pid, self.theirs,
                                            self.mine)
                self.stage = "answer"
            elif self.stage == "answer":
                if not self._want(_MAC):
                    return None
                answer = self._take(_MAC)
                if not hmac.compare_digest(answer, _mac(key, b"joiner", gdig, self.pid,
                                                        self.mine, self.theirs)):
                    log.warning("%s refused a process at %s claiming to be %s: wrong cluster "
                                "token or another cluster spec", group.name, self.who,
                                group.task_name(self.pid))
                    self.out, self.after_send = b"NO", False
                    continue
                self.out, self.after_send = b"OK", True


def join_handshake(group: Any, token: str, timeout: float, tls_material: Any = "auto") -> None:
    """A process other than 0: proves the token to process 0 and waits for its ``GO``.

    Raises:
        ClusterAuthenticationError: process 0 refused this process (wrong token or another
            cluster spec), or process 0 could not prove the token itself.
        ClusterTimeoutError: process 0 did not answer (or not every process joined) in time.

    Example:
        >>> join_handshake(group, token, timeout=60)   # doctest: +SKIP
    """
    material = _tls_material() if tls_material == "auto" else tls_material
    ctx = _client_context(material)
    key, gdig, pid = token.encode(), group_digest(group), group.process_id
    host, port = _split(group.coordination_address)
    chief = f"{group.task_name(0)} at {group.coordination_address}"
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            raw = socket.create_connection((host, port), timeout=_IO_SECONDS)
        except OSError as e:
            last = e
            time.sleep(0.2)
            continue
        try:
            sock = raw
            if ctx is not None:
                server_name = getattr(material, "server_name", None) or host
                sock = ctx.wrap_socket(raw, server_hostname=server_name)
            mine = secrets.token_bytes(_NONCE)
            sock.sendall(MAGIC + struct.pack(">I", pid) + mine)
            reply = _recv_exact(sock, _NONCE + _MAC)
            theirs, proof = reply[:_NONCE], reply[_NONCE:]
            if not hmac.compare_digest(proof, _mac(key, b"chief", gdig, pid, mine, theirs)):
                sock.sendall(bytes(_MAC))  # a wrong answer: the chief logs the refusal
                raise ClusterAuthenticationError(
                    f"{group.name}: the cluster handshake with {chief} failed: this process "
                    f"and the chief hold different cluster tokens (TF_CONFIG \"token\" / "
                    f"JAXDIST_CLUSTER_TOKEN) or cluster specs; the cluster refused this "
                    f"process", tasks=(group.name,))
            sock.sendall(_mac(key, b"joiner", gdig, pid, theirs, mine))
            verdict = _recv_exact(sock, 2)
            if verdict != b"OK":
                raise ClusterAuthenticationError(
                    f"{group.name}: {chief} refused this process in the cluster handshake: "
                    f"wrong cluster token (TF_CONFIG \"token\" / JAXDIST_CLUSTER_TOKEN) or "
                    f"another cluster spec", tasks=(group.name,))
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                go = _recv_exact(sock, 2)
            except TimeoutError:
                raise ClusterTimeoutError(
                    f"{group.name}: passed the cluster handshake, but not every process joined "
                    f"{chief} within {timeout:g} s", tasks=(group.task_name(0),),
                    timeout_seconds=timeout) from None
            if go != b"GO":
                raise ConnectionError(f"unexpected handshake reply {go!r}")
            return
        except ClusterError:
            raise
        except ssl.SSLCertVerificationError as e:
            raise ClusterAuthenticationError(
                f"{group.name}: {chief} presented a certificate this process's CA does not "
                f"accept ({e.verify_message}); refusing to join it",
                tasks=(group.task_name(0),)) from None
        except (ConnectionError, OSError) as e:  # the chief not up yet, or restarting
            last = e
            time.sleep(0.2)
        finally:
            raw.close()
    raise ClusterTimeoutError(
        f"{group.name} could not join the cluster within {timeout:g} s: the coordinator "
        f"{chief} did not answer the cluster handshake ({last}); start it with the same "
        f"cluster spec and token",
        tasks=(group.task_name(0),), timeout_seconds=timeout)


__all__ = ["ClusterAuthenticationError", "group_digest", "join_handshake", "serve_handshake"]
