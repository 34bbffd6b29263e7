"""The authenticated handshake every process of a sync group does with process 0 before
``jax.distributed`` starts.

JAX's coordination service and gloo authenticate nobody: whoever reaches the service's port
can register as a task. So before process 0 starts the service, it listens on the service's
own port (on the interface the cluster spec names) and every other process proves it holds
the cluster token, and process 0 proves it to them, by HMAC-SHA256 challenge-response over a
short TCP exchange (inside mutual TLS when the task has TLS material, see
``jaxdist.cluster.tls``):

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
    >>> serve_handshake(group, token, timeout=60)      # process 0
    >>> join_handshake(group, token, timeout=60)       # every other process
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import ssl
import struct
import time
from typing import Any

from jaxdist.cluster.errors import ClusterError, ClusterTimeoutError

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
    from jaxdist.cluster import tls

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
        >>> serve_handshake(group, token, timeout=60)
    """
    material = _tls_material() if tls_material == "auto" else tls_material
    ctx = _server_context(material)
    key, gdig = token.encode(), group_digest(group)
    host, port = _split(bind_address or group.coordination_bind_address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host or "", port))
    listener.listen(64)
    joined: dict[int, socket.socket] = {}
    expected = set(range(1, group.num_processes))
    deadline = time.monotonic() + timeout
    try:
        while set(joined) != expected:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = tuple(group.task_name(i) for i in sorted(expected - set(joined)))
                raise ClusterTimeoutError(
                    f"{group.name} could not join the cluster within {timeout:g} s: the "
                    f"tasks {list(missing)} must all start and prove the cluster token in the "
                    f"handshake with {group.name} at {group.coordination_address} (none did, "
                    f"or with another token)",
                    tasks=missing, timeout_seconds=timeout)
            listener.settimeout(min(left, 1.0))
            try:
                conn, peer = listener.accept()
            except TimeoutError:
                continue
            pid, conn = _answer(conn, peer, ctx, key, gdig, group)
            if pid is not None:
                old = joined.pop(pid, None)
                if old is not None:
                    old.close()
                joined[pid] = conn
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
        for conn in joined.values():
            conn.close()


def _answer(conn: socket.socket, peer: Any, ctx: ssl.SSLContext | None, key: bytes,
            gdig: bytes, group: Any) -> tuple[int | None, socket.socket]:
    """One joiner's challenge-response: its process id (None: refused or broken) and the
    connection (TLS-wrapped when ``ctx``)."""
    conn.settimeout(_IO_SECONDS)
    who = f"{peer[0]}:{peer[1]}"
    try:
        if ctx is not None:
            conn = ctx.wrap_socket(conn, server_side=True)
        hello = _recv_exact(conn, len(MAGIC) + 4 + _NONCE)
        if not hello.startswith(MAGIC):
            raise ConnectionError("not a jaxdist handshake")
        pid = struct.unpack(">I", hello[len(MAGIC):len(MAGIC) + 4])[0]
        theirs = hello[-_NONCE:]
        if not 0 < pid < group.num_processes:
            conn.sendall(b"NO")
            log.warning("%s refused %s: process id %d is not in the group", group.name, who,
                        pid)
            conn.close()
            return None, conn
        mine = secrets.token_bytes(_NONCE)
        conn.sendall(mine + _mac(key, b"chief", gdig, pid, theirs, mine))
        answer = _recv_exact(conn, _MAC)
        if not hmac.compare_digest(answer, _mac(key, b"joiner", gdig, pid, mine, theirs)):
            conn.sendall(b"NO")
            log.warning("%s refused a process at %s claiming to be %s: wrong cluster token or "
                        "another cluster spec", group.name, who, group.task_name(pid))
            conn.close()
            return None, conn
        conn.sendall(b"OK")
        conn.settimeout(None)
        return pid, conn
    except (OSError, ConnectionError, ssl.SSLError) as e:
        log.warning("%s: handshake with %s failed: %s", group.name, who, e)
        conn.close()
        return None, conn


def join_handshake(group: Any, token: str, timeout: float, tls_material: Any = "auto") -> None:
    """A process other than 0: proves the token to process 0 and waits for its ``GO``.

    Raises:
        ClusterAuthenticationError: process 0 refused this process (wrong token or another
            cluster spec), or process 0 could not prove the token itself.
        ClusterTimeoutError: process 0 did not answer (or not every process joined) in time.

    Example:
        >>> join_handshake(group, token, timeout=60)
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
