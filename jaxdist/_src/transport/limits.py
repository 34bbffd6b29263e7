"""Per-server limits of a ps or worker server: request size, call duration, calls per client.

A ps serves every holder of the cluster token, and a holder that is buggy, frozen or hostile
must not be able to take the server down for the others. ``ServerLimits`` says how much one
request and one client may take; ``CallGuard`` enforces the per-call parts:

* ``max_request_bytes``: a request declaring more payload bytes is refused with
  ``RESOURCE_EXHAUSTED`` from its frame prefix, before anything is allocated.
* ``max_call_seconds``: a call still running after this long (a client that stalls mid-request
  or stops reading the response) is cancelled, which frees its handler thread.
* ``max_idle_seconds``: a call whose request or response stream makes no progress (no chunk
  received, no chunk taken by the client) for this long is cancelled, long before
  ``max_call_seconds``. The time the server itself spends on a call (applying a push,
  waiting in ``Clock``) does not count.
* ``max_calls_per_client``: calls in flight from one client; more are refused with
  ``RESOURCE_EXHAUSTED``, so a client cannot hold every handler thread. A client is its
  TLS certificate (``peer_identity``): every connection made with one certificate shares
  one allowance. In plaintext (loopback only) there is no certificate and each gRPC
  connection is a client of its own.

Each has an environment variable (``JAXDIST_PS_MAX_REQUEST_BYTES``,
``JAXDIST_PS_MAX_CALL_SECONDS``, ``JAXDIST_PS_MAX_IDLE_SECONDS``,
``JAXDIST_PS_MAX_CALLS_PER_CLIENT``) and a ``python -m jaxdist.server`` flag of the same name
in lower case.

Example:
    >>> from jaxdist.ps import ServerLimits
    >>> limits = ServerLimits.from_env(max_request_bytes=512 << 20)
    >>> server = ParameterServer(  # doctest: +SKIP
    ...     service, "127.0.0.1:0", token="s3cret", limits=limits)
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc

log = logging.getLogger(__name__)

ENV_MAX_REQUEST_BYTES = "JAXDIST_PS_MAX_REQUEST_BYTES"
ENV_MAX_CALL_SECONDS = "JAXDIST_PS_MAX_CALL_SECONDS"
ENV_MAX_CALLS_PER_CLIENT = "JAXDIST_PS_MAX_CALLS_PER_CLIENT"
ENV_MAX_IDLE_SECONDS = "JAXDIST_PS_MAX_IDLE_SECONDS"

#: The default request limit never goes below this: the benchmarks push 256 MiB tensors.
MIN_DEFAULT_REQUEST_BYTES = 288 << 20
MAX_DEFAULT_REQUEST_BYTES = 1 << 30
DEFAULT_MAX_CALL_SECONDS = 300.0
DEFAULT_MAX_IDLE_SECONDS = 30.0


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_max_request_bytes() -> int:
    """1 GiB, or a quarter of physical memory if that is less (never below 288 MiB).

    Example:
        >>> from jaxdist._src.transport.limits import default_max_request_bytes
        >>> default_max_request_bytes()   # on a 64 GiB machine
        1073741824
    """
    ram = _physical_memory()
    limit = MAX_DEFAULT_REQUEST_BYTES if ram is None else min(MAX_DEFAULT_REQUEST_BYTES,
                                                              ram // 4)
    return max(MIN_DEFAULT_REQUEST_BYTES, limit)


def parse_positive(name: str, text: str, kind: type) -> Any:
    """``text`` (the value of environment variable ``name``) as a positive ``kind``.

    Raises:
        ValueError: not a number of that kind, or not positive (the message names ``name``).

    Example:
        >>> from jaxdist._src.transport.limits import parse_positive
        >>> parse_positive("JAXDIST_MAX_CONNECTIONS", "64", int)
        64
    """
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a positive {kind.__name__}") from None
    if not value > 0:
        raise ValueError(f"{name}={text!r}: expected a positive {kind.__name__}")
    return value


@dataclass(frozen=True)
class ServerLimits:
    """How much one request and one client may take from a parameter server.

    Args:
        max_request_bytes: payload bytes one request may declare.
        max_call_seconds: seconds one call may run before it is cancelled.
        max_calls_per_client: calls in flight from one client (its TLS certificate; in
            plaintext, one connection).
        max_idle_seconds: seconds a call's request or response stream may make no progress.

    Example:
        >>> from jaxdist.ps import ServerLimits
        >>> ServerLimits(max_request_bytes=64 << 20, max_call_seconds=30.0)
        ServerLimits(max_request_bytes=67108864, max_call_seconds=30.0, ...)
    """

    max_request_bytes: int = MAX_DEFAULT_REQUEST_BYTES
    max_call_seconds: float = DEFAULT_MAX_CALL_SECONDS
    max_calls_per_client: int = 8
    max_idle_seconds: float = DEFAULT_MAX_IDLE_SECONDS

    def __post_init__(self):
        for name in ("max_request_bytes", "max_call_seconds", "max_calls_per_client",
                     "max_idle_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ServerLimits.{name}={value!r}: expected a positive number")

    @classmethod
    def from_env(cls, max_request_bytes: int | None = None,
                 max_call_seconds: float | None = None,
                 max_calls_per_client: int | None = None,
                 max_workers: int = 16, max_idle_seconds: float | None = None
                 ) -> ServerLimits:
        """Limits from the arguments, else the environment, else the defaults.

        The default ``max_calls_per_client`` is half the handler threads (``max_workers``).

        Raises:
            ValueError: an environment variable is not a positive number (it is named).

        Example:
            >>> from jaxdist.ps import ServerLimits
            >>> ServerLimits.from_env(max_call_seconds=60.0).max_call_seconds
            60.0
        """
        env = os.environ
        if max_request_bytes is None:
            text = env.get(ENV_MAX_REQUEST_BYTES)
            max_request_bytes = (parse_positive(ENV_MAX_REQUEST_BYTES, text, int) if text
                                 else default_max_request_bytes())
        if max_call_seconds is None:
            text = env.get(ENV_MAX_CALL_SECONDS)
            max_call_seconds = (parse_positive(ENV_MAX_CALL_SECONDS, text, float) if text
                                else DEFAULT_MAX_CALL_SECONDS)
        if max_calls_per_client is None:
            text = env.get(ENV_MAX_CALLS_PER_CLIENT)
            max_calls_per_client = (parse_positive(ENV_MAX_CALLS_PER_CLIENT, text, int) if text
                                    else max(1, max_workers // 2))
        if max_idle_seconds is None:
            text = env.get(ENV_MAX_IDLE_SECONDS)
            max_idle_seconds = (parse_positive(ENV_MAX_IDLE_SECONDS, text, float) if text
                                else DEFAULT_MAX_IDLE_SECONDS)
        return cls(int(max_request_bytes), float(max_call_seconds), int(max_calls_per_client),
                   float(max_idle_seconds))


def peer_identity(context: Any) -> str:
    """The client a gRPC call comes from, for per-client limits: its TLS certificate.

    ``"cert <common name> <sha256 prefix>"`` when the peer presented a certificate (every
    connection made with it is the same client); else the connection's address (plaintext:
    each connection is a client of its own).

    Example:
        >>> peer_identity(context)  # doctest: +SKIP
        'cert worker-0 3fa41c09d2e8b7a1'
    """
    try:
        auth = context.auth_context() or {}
    except Exception:  # noqa: BLE001 - a context without TLS information
        auth = {}
    pem = auth.get("x509_pem_cert")
    if pem:
        return certificate_identity(pem[0], (auth.get("x509_common_name") or [b""])[0])
    return context.peer() or "unknown"


def certificate_identity(cert: bytes, common_name: bytes | str = b"") -> str:
    """``"cert <common name> <sha256 prefix>"`` of a certificate (PEM or DER bytes)."""
    if isinstance(common_name, bytes):
        common_name = common_name.decode(errors="replace")
    digest = hashlib.sha256(cert).hexdigest()
    return f"cert {common_name[:64] or '?'} {digest[:16]}"


class CallProgress:
    """One admitted call as ``CallGuard`` watches it; the handler marks its stream's progress.

    ``streaming(True)`` while the call waits on the client (reading the request, sending the
    response), ``streaming(False)`` while the server works on it; ``touch()`` on every chunk.
    """

    __slots__ = ("deadline", "context", "client", "method", "last", "io")

    def __init__(self, deadline: float, context: Any, client: str, method: str):
        self.deadline, self.context, self.client, self.method = deadline, context, client, method
        self.last, self.io = time.monotonic(), True

    def touch(self) -> None:
        self.last = time.monotonic()

    def streaming(self, on: bool) -> None:
        self.last, self.io = time.monotonic(), on

    def watch_requests(self, chunks: Iterator[bytes]) -> Iterator[bytes]:
        """``chunks`` with a ``touch`` per chunk; the stream is idle-watched until it ends."""
        self.streaming(True)
        for chunk in chunks:
            self.touch()
            yield chunk
        self.streaming(False)

    def watch_responses(self, chunks: Iterator[bytes]) -> Iterator[bytes]:
        """``chunks`` idle-watched while the client takes each (a resume means it was sent)."""
        for chunk in chunks:
            self.streaming(True)
            yield chunk
        self.streaming(False)


class CallGuard:
    """Admits calls (at most ``max_calls_per_client`` per client) and cancels overdue ones.

    One daemon thread holds the deadlines of the calls in flight and cancels a call (its
    ``grpc.ServicerContext``) when its deadline passes, or when its stream has made no
    progress for ``max_idle_seconds``: a handler blocked on a request chunk that never comes,
    or on a response the client does not read, then returns. A client is ``peer_identity``
    (its TLS certificate; in plaintext, its connection).

    Args:
        task: the task's name for messages, e.g. ``"ps:0"``.
        limits: the limits to enforce.

    Example:
        >>> from jaxdist._src.transport.limits import CallGuard
        >>> from jaxdist.ps import ServerLimits
        >>> guard = CallGuard("ps:0", ServerLimits())
        >>> with guard.call(context, "Push") as progress:  # in a handler  # doctest: +SKIP
        ...     meta, arrays = wire.decode(progress.watch_requests(request_iterator))
    """

    def __init__(self, task: str, limits: ServerLimits):
        self.task = task
        self.limits = limits
        self._lock = threading.Condition()
        self._per_client: dict[str, int] = {}
        self._live: dict[int, CallProgress] = {}  # call id -> every call in flight
        self._ids = itertools.count()
        self.cancelled = 0
        self.idle_cancelled = 0
        self._thread: threading.Thread | None = None

    def in_flight(self, client: str) -> int:
        """Calls in flight from ``client`` (a ``peer_identity`` string)."""
        with self._lock:
            return self._per_client.get(client, 0)

    @contextmanager
    def call(self, context: grpc.ServicerContext, method: str) -> Iterator[CallProgress]:
        """Admits one call for its duration; aborts with ``RESOURCE_EXHAUSTED`` when its client
        already has ``max_calls_per_client`` calls in flight."""
        client = peer_identity(context)
        cap = self.limits.max_calls_per_client
        with self._lock:
            n = self._per_client.get(client, 0)
            admitted = n < cap
            if admitted:
                self._per_client[client] = n + 1
                call_id = next(self._ids)
                progress = CallProgress(time.monotonic() + self.limits.max_call_seconds,
                                        context, client, method)
                self._live[call_id] = progress
                self._ensure_thread()
                self._lock.notify()
        if not admitted:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.task} refused {method}: client {client} already has {n} calls in "
                f"flight (max_calls_per_client={cap}; set {ENV_MAX_CALLS_PER_CLIENT} on the "
                f"server to allow more)",
            )
        try:
            yield progress
        finally:
            with self._lock:
                self._live.pop(call_id, None)
                left = self._per_client.get(client, 1) - 1
                if left:
                    self._per_client[client] = left
                else:
                    self._per_client.pop(client, None)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="jaxdist-ps-deadlines",
                                            daemon=True)
            self._thread.start()

    def _due(self, c: CallProgress) -> float:
        idle = c.last + self.limits.max_idle_seconds if c.io else float("inf")
        return min(c.deadline, idle)

    def _watch(self) -> None:
        while True:
            with self._lock:
                if not self._live:
                    self._lock.wait()
                    continue
                now = time.monotonic()
                earliest = min(self._due(c) for c in self._live.values())
                if earliest > now:
                    self._lock.wait(min(earliest - now, 1.0))
                    continue
                overdue = [self._live.pop(i) for i, c in list(self._live.items())
                           if self._due(c) <= now]
            for c in overdue:
                if c.deadline <= now:
                    self.cancelled += 1
                    log.warning("%s cancelled %s from %s: still running after %g s "
                                "(max_call_seconds)", self.task, c.method, c.client,
                                self.limits.max_call_seconds)
                else:
                    self.idle_cancelled += 1
                    log.warning("%s cancelled %s from %s: its stream made no progress for "
                                "%g s (max_idle_seconds)", self.task, c.method, c.client,
                                self.limits.max_idle_seconds)
                c.context.cancel()


__all__ = [
    "ENV_MAX_CALLS_PER_CLIENT",
    "ENV_MAX_CALL_SECONDS",
    "ENV_MAX_IDLE_SECONDS",
    "ENV_MAX_REQUEST_BYTES",
    "CallGuard",
    "CallProgress",
    "ServerLimits",
    "certificate_identity",
    "default_max_request_bytes",
    "parse_positive",
    "peer_identity",
]
