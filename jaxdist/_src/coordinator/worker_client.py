"""The coordinator's client of the worker tasks (one gRPC channel per worker).

Every call has a deadline and a task name; failures become typed errors naming the worker:
``WorkerUnavailableError("worker:1 at 127.0.0.1:1234 did not answer RunClosure within 30.0 s
(...)")``. An in-flight call can be cancelled from another thread (the health watcher does so
when a worker stops answering heartbeats).

Every call is signed with the chief's key for its target worker, that worker's incarnation and
a fresh per-worker counter (``jaxdist._src.coordinator.signing``; the coordinator token itself never
leaves this process), and carries a fresh nonce; an answer that does not carry that worker's
MAC (its own answer key) over the nonce and every field and array of the answer is refused
before anything is unpickled (``WorkerAuthenticationError``). The client learns each worker's
incarnation from its (MAC'd) ``Ping`` answers; a worker that restarted refuses a request signed
for its predecessor (``WorkerUnavailableError``; the next call pings it first). The channel is
mutual TLS unless plaintext on loopback was asked for.

Example:
    >>> client = WorkerClient(["127.0.0.1:2224"], coordinator_token="c0ffee")  # doctest: +SKIP
    >>> meta, _ = client.call(0, "Ping", timeout=2.0)  # doctest: +SKIP
"""

from __future__ import annotations

import hmac
import json
import secrets
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np

from jaxdist._src.coordinator.errors import (
    CoordinatorError,
    WorkerAuthenticationError,
    WorkerUnavailableError,
)
from jaxdist._src.coordinator.signing import (
    AUTH_KEY,
    AUTH_METADATA_KEY,
    CONNECT_METHOD,
    MAC_KEY,
    RequestSigner,
    answer_mac,
    body_digest,
)
from jaxdist._src.coordinator.worker_service import (
    ANSWERS_KEY,
    MAX_BATCH_CLOSURES,
    NONCE_KEY,
    SERVICE_NAME,
    direct_enabled,
    item_nonce,
    split_answers,
)
from jaxdist._src.security.credentials import CoordinatorKeys, coordinator_token
from jaxdist._src.security.tls import TLSConfig, resolve_tls
from jaxdist._src.transport import wire
from jaxdist._src.transport.direct import DirectPool
from jaxdist._src.transport.direct import Unavailable as DirectUnavailable
from jaxdist._src.transport.grpc_util import CHANNEL_OPTIONS, ChunkStubs, open_channels

Message = tuple[dict[str, Any], dict[str, np.ndarray]]

_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
    ("grpc.enable_retries", 0),
]


#: Methods sent over a worker's direct port when it has one (the rest stay on gRPC).
DIRECT_METHODS = frozenset({"RunClosures"})

#: The prefix of a message's first chunk (``_src.transport.wire``): magic, header and payload bytes.
_FRAME_PREFIX = struct.Struct("<4sQQ")


def _next_message(responses: Iterator[bytes]) -> list[bytes] | None:
    """The chunks of the next message of a stream of several (``None``: the stream ended)."""
    first = next(responses, None)
    if first is None:
        return None
    if len(first) < _FRAME_PREFIX.size:
        raise wire.WireError(f"a message starts with {len(first)} bytes, shorter than the "
                             f"frame prefix")
    magic, hlen, total = _FRAME_PREFIX.unpack_from(first)
    if magic != wire.MAGIC:
        raise wire.WireError(f"bad frame magic {magic!r}: expected {wire.MAGIC!r}")
    chunks, got = [first], len(first) - _FRAME_PREFIX.size - hlen
    while got < total:
        chunk = next(responses, None)
        if chunk is None:
            raise wire.WireError(f"truncated message: got {got} of {total} payload bytes")
        chunks.append(chunk)
        got += len(chunk)
    return chunks


class WorkerClient:
    """gRPC client of the ``worker`` job.

    Args:
        addresses: ``host:port`` of ``worker:0``, ``worker:1``, ...
        coordinator_token: the coordinator token, from which the key every call is signed
            with and the workers' answer keys are derived; it is never sent (``None``:
            TF_CONFIG ``"coordinator_token"`` / ``JAXDIST_COORDINATOR_TOKEN``).
        job: the job name used in messages.
        tls: the mutual-TLS identity; ``"insecure"`` for plaintext on loopback; ``None`` reads
            TF_CONFIG / the environment.
        direct_transport: send ``RunClosures`` over the workers' direct port (one
            authenticated socket per sender, no gRPC per call) when they have one; ``None``:
            unless ``JAXDIST_COORDINATOR_DIRECT=0``.

    Raises:
        ValueError: no coordinator token configured.
        TLSConfigError: no TLS material and plaintext not asked for.
    """

    def __init__(self, addresses: Sequence[str], coordinator_token: str | None = None,
                 job: str = "worker", *, tls: TLSConfig | str | None = None,
                 direct_transport: bool | None = None):
        if not addresses:
            raise ValueError("the coordinator needs at least one worker address, got none")
        token = _coordinator_token(coordinator_token)
        self.addresses = list(addresses)
        self.job = job
        self._signer = RequestSigner(CoordinatorKeys(token),
                                     [self.task_name(i) for i in range(len(self.addresses))])
        self._answer_keys = [self._signer.answer_key(i) for i in range(len(self.addresses))]
        # Each worker's incarnation, from its last authenticated answer (None: ping first).
        self._incarnations: list[str | None] = [None] * len(self.addresses)
        self.tls = resolve_tls(tls, "the coordinator")
        self._channels = open_channels(self.addresses, self.tls, job, _OPTIONS)
        self._stubs = ChunkStubs(self._channels, SERVICE_NAME)
        use_direct = direct_enabled() if direct_transport is None else direct_transport
        # One connection per sender thread (PIPELINE_DEPTH of them per worker), kept open.
        self._direct = DirectPool(self.addresses, self._connect_credential, self.tls,
                                  self._ping_meta,
                                  self._direct_error, max_idle=4,
                                  job=job) if use_direct else None

    @property
    def direct_calls(self) -> int:
        """Calls answered over the direct transport so far."""
        return self._direct.calls if self._direct is not None else 0

    @property
    def num_tasks(self) -> int:
        return len(self.addresses)

    def task_name(self, task: int) -> str:
        return f"{self.job}:{task}"

    def call(self, task: int, method: str, meta: dict | None = None,
             arrays: dict | None = None, timeout: float = 30.0,
             on_start: Callable[[Any], None] | None = None) -> Message:
        """One RPC to worker ``task``.

        Args:
            on_start: called with the in-flight call (it has ``cancel()``).

        Raises:
            WorkerUnavailableError: no answer within ``timeout``, connection lost, cancelled.
            WorkerAuthenticationError: the worker refused the token.
            CoordinatorError: the worker rejected the request.
        """
        nonce, responses = self._start(task, method, meta, arrays, timeout, on_start)
        try:
            out_meta, out_arrays = wire.decode(responses)
        except grpc.RpcError as e:
            raise self._translate(task, method, timeout, e) from None
        self._check_mac(task, method, nonce, out_meta, out_arrays)
        return out_meta, out_arrays

    def call_stream(self, task: int, method: str, meta: dict | None = None,
                    arrays: dict | None = None, timeout: float = 30.0,
                    on_start: Callable[[Any], None] | None = None) -> Iterator[Message]:
        """Starts one RPC to worker ``task`` whose answer is several messages
        (``RunClosures``); the call is under way when this returns. The iterator it returns
        yields each answer as it arrives, after checking its MAC over ``"<nonce>/<index>"``.

        Raises (here or while iterating):
            WorkerUnavailableError: no answer within ``timeout``, connection lost, cancelled,
                or an answer that is not a well-formed message.
            WorkerAuthenticationError: the worker refused the token, or an answer lacks the
                worker's MAC for this call and its place in it.
            CoordinatorError: the worker rejected the request.
        """
        self._check_task(task)
        if self._direct is not None and method in DIRECT_METHODS:
            nonce, deadline = secrets.token_hex(16), time.monotonic() + timeout
            signed, arrays = {**(meta or {}), NONCE_KEY: nonce}, arrays or {}
            signed[AUTH_KEY] = self._signer.sign(
                task, self._incarnation(task, method, timeout), method, signed, arrays)
            try:
                frames = self._direct.call_stream(task, method, signed, arrays, deadline,
                                                  timeout, on_start)
            except DirectUnavailable:
                # No direct port, or nothing could be sent: gRPC, in the time that is left.
                timeout = max(1e-3, deadline - time.monotonic())
            else:
                return self._direct_answers(task, method, nonce, frames)
        nonce, responses = self._start(task, method, meta, arrays, timeout, on_start)
        return self._answers(task, method, timeout, nonce, responses)

    def _direct_answers(self, task: int, method: str, nonce: str,
                        frames: Iterator[Message]) -> Iterator[Message]:
        try:
            for index, (out_meta, out_arrays) in enumerate(frames):
                self._check_mac(task, method, item_nonce(nonce, index), out_meta, out_arrays)
                yield from self._split(task, method, index, out_meta, out_arrays)
        finally:
            frames.close()  # a refused answer, or the caller stopped reading: drop the call

    def _incarnation(self, task: int, method: str, timeout: float) -> str:
        """The incarnation a request to ``task`` is signed for: the last one its
        authenticated answers named; unknown, a ``Ping`` first (a ``Ping`` itself may be
        signed for any)."""
        known = self._incarnations[task]
        if known is None and method != "Ping":
            self.call(task, "Ping", timeout=min(timeout, 10.0))
            known = self._incarnations[task]
        return known or ""

    def _connect_credential(self, task: int, hello: dict) -> dict:
        """The signed credential a new direct connection to ``task`` presents (for the
        incarnation the worker's hello names, which the pool checked against its ping)."""
        incarnation = hello.get("incarnation")
        return self._signer.sign_digest(task, incarnation if isinstance(incarnation, str)
                                        else "", CONNECT_METHOD, body_digest({}, {}))

    def _ping_meta(self, task: int, timeout: float) -> dict:
        """The worker's ``Ping`` answer (it says its direct port)."""
        return self.call(task, "Ping", timeout=timeout)[0]

    def _direct_error(self, task: int, method: str, timeout: float, code: str | None,
                      details: str | None) -> CoordinatorError:
        """The typed error of a direct call that failed with the gRPC status named ``code``."""
        status = getattr(grpc.StatusCode, str(code), None)
        return self._error(task, method, timeout, status, details or "")

    def _check_task(self, task: int) -> None:
        if not 0 <= task < self.num_tasks:
            raise ValueError(f"worker task {task} does not exist: the cluster has "
                             f"{self.num_tasks}")

    def _start(self, task: int, method: str, meta: dict | None, arrays: dict | None,
               timeout: float, on_start: Callable[[Any], None] | None) -> tuple[str, Any]:
        """Sends the request of one call (with a fresh nonce); ``(nonce, responses)``."""
        self._check_task(task)
        nonce = secrets.token_hex(16)
        signed, arrays = {**(meta or {}), NONCE_KEY: nonce}, arrays or {}
        auth = self._signer.sign(task, self._incarnation(task, method, timeout), method,
                                 signed, arrays)
        try:
            responses = self._stubs(
                task, method, wire.encode(signed, arrays), timeout=timeout,
                metadata=((AUTH_METADATA_KEY, json.dumps(auth)),), wait_for_ready=False)
            if on_start is not None:
                on_start(responses)
        except grpc.RpcError as e:
            raise self._translate(task, method, timeout, e) from None
        return nonce, responses

    def _answers(self, task: int, method: str, timeout: float, nonce: str,
                 responses: Any) -> Iterator[Message]:
        index, ended = 0, False
        try:
            while True:
                chunks = _next_message(responses)
                if chunks is None:
                    ended = True
                    return
                out_meta, out_arrays = wire.decode(chunks)
                self._check_mac(task, method, item_nonce(nonce, index), out_meta, out_arrays)
                index += 1
                yield from self._split(task, method, index - 1, out_meta, out_arrays)
        except grpc.RpcError as e:
            raise self._translate(task, method, timeout, e) from None
        except wire.WireError as e:
            name = self.task_name(task)
            raise WorkerUnavailableError(
                f"{name} at {self.addresses[task]}: answer {index} to {method} is not a "
                f"well-formed message: {e}", task=name, address=self.addresses[task]) from None
        finally:
            if not ended:
                responses.cancel()  # the caller stopped reading, or the answer was refused

    def _split(self, task: int, method: str, index: int, out_meta: dict,
               out_arrays: dict) -> list[Message]:
        """The answers one message carries: itself, or those it groups (``group_answers``)."""
        if ANSWERS_KEY not in out_meta:
            return [(out_meta, out_arrays)]
        try:
            return split_answers(out_meta, out_arrays, MAX_BATCH_CLOSURES)
        except ValueError as e:
            name = self.task_name(task)
            raise WorkerUnavailableError(
                f"{name} at {self.addresses[task]}: answer {index} to {method} is not a "
                f"well-formed group of answers: {e}", task=name,
                address=self.addresses[task]) from None

    def _check_mac(self, task: int, method: str, nonce: str, out_meta: dict,
                   out_arrays: dict) -> None:
        name = self.task_name(task)
        mac = out_meta.pop(MAC_KEY, None)
        if not isinstance(mac, str) or not hmac.compare_digest(
                mac, answer_mac(self._answer_keys[task], name, method, nonce, out_meta,
                                out_arrays)):
            raise WorkerAuthenticationError(
                f"{name} at {self.addresses[task]}: the answer to {method} does not carry "
                f"{name}'s MAC for this call; refusing to unpickle it (is something else "
                f"listening on that address, or does the worker have another coordinator "
                f"credential?)", task=name, address=self.addresses[task])
        answers = out_meta.get(ANSWERS_KEY)
        first = answers[0] if isinstance(answers, list) and answers else out_meta
        incarnation = first.get("incarnation") if isinstance(first, dict) else None
        if isinstance(incarnation, str):
            self._incarnations[task] = incarnation

    def _translate(self, task: int, method: str, timeout: float,
                   e: grpc.RpcError) -> CoordinatorError:
        code = e.code() if hasattr(e, "code") else None
        details = e.details() if hasattr(e, "details") else str(e)
        return self._error(task, method, timeout, code, details)

    def _error(self, task: int, method: str, timeout: float, code: grpc.StatusCode | None,
               details: str) -> CoordinatorError:
        name, addr = self.task_name(task), self.addresses[task]
        if code == grpc.StatusCode.ABORTED:  # signed for the worker's previous process
            self._incarnations[task] = None
            return WorkerUnavailableError(f"{name} at {addr} restarted: {details}", task=name,
                                          address=addr)
        if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.CANCELLED):
            return WorkerUnavailableError(
                f"{name} at {addr} did not answer {method} within {timeout:.1f} s "
                f"({details or code.name})", task=name, address=addr)
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return WorkerAuthenticationError(f"{name} at {addr}: {details}", task=name,
                                             address=addr)
        return CoordinatorError(f"{name} at {addr} failed {method}: {code}: {details}",
                                task=name, address=addr)

    def close(self) -> None:
        if self._direct is not None:
            self._direct.close()
        for ch in self._channels:
            ch.close()


def _coordinator_token(token: str | None) -> str:
    found = coordinator_token(token)
    if not found:
        raise ValueError(
            "the coordinator needs the coordinator token (the right to run code on the "
            "workers): set TF_CONFIG 'coordinator_token' or JAXDIST_COORDINATOR_TOKEN on the "
            "chief (python -m jaxdist.launch --coordinator sets it), or pass "
            "coordinator_token=")
    return found


__all__ = ["WorkerClient"]
