"""Per-server limits of a parameter server: request size, call duration, calls per client.

A ps serves every holder of the cluster token, and a holder that is buggy, frozen or hostile
must not be able to take the server down for the others. ``ServerLimits`` says how much one
request and one client may take; ``CallGuard`` enforces the per-call parts:

* ``max_request_bytes``: a request declaring more payload bytes is refused with
  ``RESOURCE_EXHAUSTED`` from its frame prefix, before anything is allocated.
* ``max_call_seconds``: a call still running after this long (a client that stalls mid-request
  or stops reading the response) is cancelled, which frees its handler thread.
* ``max_calls_per_client``: calls in flight from one client (one gRPC connection; a
  ``PSClient`` opens one per ps task); more are refused with ``RESOURCE_EXHAUSTED``, so a
  client cannot hold every handler thread.

Each has an environment variable (``JAXDIST_PS_MAX_REQUEST_BYTES``,
``JAXDIST_PS_MAX_CALL_SECONDS``, ``JAXDIST_PS_MAX_CALLS_PER_CLIENT``) and a
``python -m jaxdist.server`` flag of the same name in lower case.

Example:
    >>> limits = ServerLimits.from_env(max_request_bytes=512 << 20)
    >>> server = ParameterServer(service, "127.0.0.1:0", token="s3cret", limits=limits)
"""

from __future__ import annotations

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

#: The default request limit never goes below this: the benchmarks push 256 MiB tensors.
MIN_DEFAULT_REQUEST_BYTES = 288 << 20
MAX_DEFAULT_REQUEST_BYTES = 1 << 30
DEFAULT_MAX_CALL_SECONDS = 300.0


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def default_max_request_bytes() -> int:
    """1 GiB, or a quarter of physical memory if that is less (never below 288 MiB).

    Example:
        >>> default_max_request_bytes()   # on a 64 GiB machine
        1073741824
    """
    ram = _physical_memory()
    limit = MAX_DEFAULT_REQUEST_BYTES if ram is None else min(MAX_DEFAULT_REQUEST_BYTES,
                                                              ram // 4)
    return max(MIN_DEFAULT_REQUEST_BYTES, limit)


def _parse(name: str, text: str, kind: type) -> Any:
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
        max_calls_per_client: calls in flight from one client (gRPC connection).

    Example:
        >>> ServerLimits(max_request_bytes=64 << 20, max_call_seconds=30.0)
    """

    max_request_bytes: int = MAX_DEFAULT_REQUEST_BYTES
    max_call_seconds: float = DEFAULT_MAX_CALL_SECONDS
    max_calls_per_client: int = 8

    def __post_init__(self):
        for name in ("max_request_bytes", "max_call_seconds", "max_calls_per_client"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ServerLimits.{name}={value!r}: expected a positive number")

    @classmethod
    def from_env(cls, max_request_bytes: int | None = None,
                 max_call_seconds: float | None = None,
                 max_calls_per_client: int | None = None,
                 max_workers: int = 16) -> ServerLimits:
        """Limits from the arguments, else the environment, else the defaults.

        The default ``max_calls_per_client`` is half the handler threads (``max_workers``).

        Raises:
            ValueError: an environment variable is not a positive number (it is named).

        Example:
            >>> ServerLimits.from_env(max_call_seconds=60.0).max_call_seconds
            60.0
        """
        env = os.environ
        if max_request_bytes is None:
            text = env.get(ENV_MAX_REQUEST_BYTES)
            max_request_bytes = (_parse(ENV_MAX_REQUEST_BYTES, text, int) if text
                                 else default_max_request_bytes())
        if max_call_seconds is None:
            text = env.get(ENV_MAX_CALL_SECONDS)
            max_call_seconds = (_parse(ENV_MAX_CALL_SECONDS, text, float) if text
                                else DEFAULT_MAX_CALL_SECONDS)
        if max_calls_per_client is None:
            text = env.get(ENV_MAX_CALLS_PER_CLIENT)
            max_calls_per_client = (_parse(ENV_MAX_CALLS_PER_CLIENT, text, int) if text
                                    else max(1, max_workers // 2))
        return cls(int(max_request_bytes), float(max_call_seconds), int(max_calls_per_client))


class CallGuard:
    """Admits calls (at most ``max_calls_per_client`` per client) and cancels overdue ones.

    One daemon thread holds the deadlines of the calls in flight and cancels a call (its
    ``grpc.ServicerContext``) when its deadline passes: a handler blocked on a request chunk
    that never comes, or on a response the client does not read, then returns.

    Args:
        task: the task's name for messages, e.g. ``"ps:0"``.
        limits: the limits to enforce.

    Example:
        >>> guard = CallGuard("ps:0", ServerLimits())
        >>> with guard.call(context, "Push"):    # inside a gRPC handler
        ...     ...
    """

    def __init__(self, task: str, limits: ServerLimits):
        self.task = task
        self.limits = limits
        self._lock = threading.Condition()
        self._per_client: dict[str, int] = {}
        # call id -> (deadline, context, client, method) of every call in flight
        self._live: dict[int, tuple[float, Any, str, str]] = {}
        self._ids = itertools.count()
        self.cancelled = 0
        self._thread: threading.Thread | None = None

    def in_flight(self, client: str) -> int:
        """Calls in flight from ``client`` (a ``context.peer()`` string)."""
        with self._lock:
            return self._per_client.get(client, 0)

    @contextmanager
    def call(self, context: grpc.ServicerContext, method: str) -> Iterator[None]:
        """Admits one call for its duration; aborts with ``RESOURCE_EXHAUSTED`` when its client
        already has ``max_calls_per_client`` calls in flight."""
        client = context.peer() or "unknown"
        cap = self.limits.max_calls_per_client
        with self._lock:
            n = self._per_client.get(client, 0)
            admitted = n < cap
            if admitted:
                self._per_client[client] = n + 1
                call_id = next(self._ids)
                self._live[call_id] = (time.monotonic() + self.limits.max_call_seconds,
                                       context, client, method)
                self._ensure_thread()
                if len(self._live) == 1:
                    self._lock.notify()
        if not admitted:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.task} refused {method}: client {client} already has {n} calls in "
                f"flight (max_calls_per_client={cap}; set {ENV_MAX_CALLS_PER_CLIENT} on the "
                f"server to allow more)",
            )
        try:
            yield
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

    def _watch(self) -> None:
        while True:
            with self._lock:
                if not self._live:
                    self._lock.wait()
                    continue
                now = time.monotonic()
                earliest = min(d for d, _, _, _ in self._live.values())
                if earliest > now:
                    self._lock.wait(earliest - now)
                    continue
                overdue = [self._live.pop(i) for i, (d, _, _, _) in list(self._live.items())
                           if d <= now]
            for _, context, client, method in overdue:
                self.cancelled += 1
                log.warning("%s cancelled %s from %s: still running after %g s "
                            "(max_call_seconds)", self.task, method, client,
                            self.limits.max_call_seconds)
                context.cancel()


__all__ = [
    "ENV_MAX_CALLS_PER_CLIENT",
    "ENV_MAX_CALL_SECONDS",
    "ENV_MAX_REQUEST_BYTES",
    "CallGuard",
    "ServerLimits",
    "default_max_request_bytes",
]
