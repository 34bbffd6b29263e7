"""Clients of the ps tasks: ``PSClient`` (gRPC, one channel per task) and ``LocalClient``.

Both expose ``call(task, method, meta, arrays)`` and ``call_many([...])`` (the calls to
different tasks go out in parallel). Every remote call has a deadline; a task that does not
answer in time raises ``PSUnavailableError`` naming it, e.g.
``ps:1 at 127.0.0.1:1234 did not answer Pull within 5.0 s``. Idempotent calls are retried on a
lost connection until the deadline (a restarting ps is waited for, not reported at once).

The TF2 ``ClusterCoordinator`` reuses these clients: they know nothing about strategies.

Example:
    >>> import numpy as np
    >>> from jaxdist.ps import PSClient
    >>> import os
    >>> from jaxdist._src.ps.optimizers import sgd
    >>> from jaxdist._src.ps.server import ParameterServer
    >>> from jaxdist._src.ps.service import ParameterService
    >>> os.environ["JAXDIST_INSECURE"] = "1"   # plaintext on loopback (tests, local runs)
    >>> service = ParameterService("ps:0")
    >>> service.create({"model/w": np.zeros(3, np.float32)},
    ...                {"model/w": {"optimizer": sgd(0.1).to_json()}})
    {'model/w': 0}
    >>> server = ParameterServer(service, "127.0.0.1:0", token="s3cret").start()
    >>> client = PSClient([server.address], token="s3cret", timeout=5.0)
    >>> meta, arrays = client.call(0, "Pull", {"keys": ["model/w"]})
    >>> server.stop()
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent import futures
from typing import Any

import grpc
import numpy as np

from jaxdist._src.ps import protocol
from jaxdist._src.ps.errors import (
    PSAuthenticationError,
    PSCheckpointWriteError,
    PSError,
    PSInvalidArgumentError,
    PSNotFoundError,
    PSUnavailableError,
)
from jaxdist._src.ps.service import ParameterService
from jaxdist._src.security.tls import TLSConfig, resolve_tls
from jaxdist._src.transport import direct, wire
from jaxdist._src.transport.direct import DirectPool
from jaxdist._src.transport.direct import Unavailable as DirectUnavailable
from jaxdist._src.transport.grpc_util import (
    CHANNEL_OPTIONS,
    TOKEN_METADATA_KEY,
    ChunkStubs,
    open_channels,
)
from jaxdist._src.transport.memory import RECEIVE_POOL, tune_malloc

Message = tuple[dict[str, Any], dict[str, np.ndarray]]
Call = tuple[int, str, dict[str, Any], dict[str, Any]]

_CLIENT_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
]


class _Base:
    num_tasks: int

    def task_name(self, task: int) -> str:
        return f"ps:{task}"

    def call(self, task: int, method: str, meta: dict | None = None, arrays: dict | None = None,
             timeout: float | None = None) -> Message:
        raise NotImplementedError

    def call_many(self, calls: Sequence[Call], timeout: float | None = None) -> list[Message]:
        """Runs ``calls`` (``(task, method, meta, arrays)``) in parallel; results in order.

        Raises the first error (by call order) after every call has finished.
        """
        if len(calls) <= 1:
            return [self.call(*c, timeout=timeout) for c in calls]
        futs = [self._pool.submit(self.call, *c, timeout=timeout) for c in calls]
        results, first_error = [], None
        for f in futs:
            try:
                results.append(f.result())
            except BaseException as e:  # noqa: BLE001 - re-raised below
                results.append(None)
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return results

    def close(self) -> None:
        self._pool.shutdown(wait=False)


class PSClient(_Base):
    """gRPC client of every ps task of a cluster.

    Args:
        addresses: ``host:port`` of ``ps:0``, ``ps:1``, ...
        token: the cluster token sent with every call.
        timeout: default deadline in seconds of one call.
        chunk_bytes: size of the chunks large arrays are streamed in.
        job: the job name used in messages (``"ps"``).
        tls: this client's mutual-TLS identity; ``"insecure"`` for plaintext (loopback only);
            ``None`` reads TF_CONFIG ``"tls"`` / ``JAXDIST_TLS_*`` / ``JAXDIST_INSECURE``.
        direct_transport: send calls over the ps tasks' direct socket port
            (``jaxdist._src.transport.direct``: same TLS and token, no gRPC per call) when
            they have one; gRPC otherwise (default: on unless ``JAXDIST_PS_DIRECT=0``).

    Raises:
        TLSConfigError: no TLS material and plaintext not asked for.
    """

    def __init__(self, addresses: Sequence[str], token: str | None, timeout: float = 30.0,
                 chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES, job: str = "ps", *,
                 tls: TLSConfig | str | None = None, direct_transport: bool | None = None):
        if not addresses:
            raise ValueError("PSClient needs at least one ps address, got none")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout}")
        self.addresses = list(addresses)
        self.num_tasks = len(self.addresses)
        self.timeout = float(timeout)
        self.chunk_bytes = chunk_bytes
        self.job = job
        self._metadata = ((TOKEN_METADATA_KEY, token),) if token else ()
        tune_malloc()
        self.tls = resolve_tls(tls, f"the client of the {job} job")
        self._channels = open_channels(self.addresses, self.tls, job, _CLIENT_OPTIONS)
        self._stubs = ChunkStubs(self._channels, protocol.SERVICE_NAME)
        self._pool = futures.ThreadPoolExecutor(
            max_workers=max(2, 2 * self.num_tasks), thread_name_prefix="jaxdist-psclient"
        )
        use_direct = direct.enabled() if direct_transport is None else direct_transport
        self._direct = DirectPool(self.addresses, token, self.tls, self._grpc_ping,
                                  self._error) if use_direct else None

    @property
    def direct_calls(self) -> int:
        """Calls answered over the direct transport (``jaxdist._src.transport.direct``) so far."""
        return self._direct.calls if self._direct is not None else 0

    def _grpc_ping(self, task: int, timeout: float) -> dict:
        return self._grpc_call(task, "Ping", {}, None, timeout)[0]

    def task_name(self, task: int) -> str:
        return f"{self.job}:{task}"

    def call(self, task: int, method: str, meta: dict | None = None, arrays: dict | None = None,
             timeout: float | None = None) -> Message:
        """One RPC to ps ``task``; returns the response ``(meta, arrays)``.

        Raises:
            PSUnavailableError: no answer within ``timeout`` (default: the client's).
            PSAuthenticationError: the task refused the token.
            PSNotFoundError / PSInvalidArgumentError / PSError: the task rejected the call.
        """
        if not 0 <= task < self.num_tasks:
            raise ValueError(f"ps task {task} does not exist: the cluster has {self.num_tasks}")
        timeout = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + timeout  # one deadline for both transports
        if self._direct is not None:
            try:
                return self._direct.call(task, method, dict(meta or {}), arrays or {},
                                         deadline, timeout, method in protocol.IDEMPOTENT)
            except DirectUnavailable:
                pass  # no direct port, or it failed before the call could matter: use gRPC
        return self._grpc_call(task, method, meta, arrays, timeout, deadline)

    def _grpc_call(self, task: int, method: str, meta: dict | None, arrays: dict | None,
                   timeout: float, deadline: float | None = None) -> Message:
        if deadline is None:
            deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._unavailable(task, method, timeout, "deadline passed")
            try:
                responses = self._stubs(
                    task, method, wire.encode(meta, arrays, self.chunk_bytes),
                    timeout=left,
                    metadata=self._metadata,
                    wait_for_ready=True,
                )
                return wire.decode(responses, RECEIVE_POOL)
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                if (code == grpc.StatusCode.UNAVAILABLE and method in protocol.IDEMPOTENT
                        and deadline - time.monotonic() > 0.05):
                    time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
                    continue
                raise self._translate(task, method, timeout, e) from None

    def _unavailable(self, task, method, timeout, detail) -> PSUnavailableError:
        name, addr = self.task_name(task), self.addresses[task]
        return PSUnavailableError(
            f"{name} at {addr} did not answer {method} within {timeout:.1f} s ({detail})",
            task=name,
            address=addr,
        )

    def _translate(self, task: int, method: str, timeout: float, e: grpc.RpcError) -> PSError:
        code = e.code() if hasattr(e, "code") else None
        details = e.details() if hasattr(e, "details") else str(e)
        return self._error(task, method, timeout, code, details)

    def _error(self, task: int, method: str, timeout: float, code: Any,
               details: str | None) -> PSError:
        """The typed error of a failed call (``code``: a ``grpc.StatusCode`` or its name)."""
        if isinstance(code, str):
            code = getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN)
        name, addr = self.task_name(task), self.addresses[task]
        if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.CANCELLED):
            return self._unavailable(task, method, timeout, details or code.name)
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return PSAuthenticationError(f"{name} at {addr}: {details}", task=name, address=addr)
        if code == grpc.StatusCode.NOT_FOUND:
            return PSNotFoundError(details, task=name, address=addr)
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return PSInvalidArgumentError(details, task=name, address=addr)
        if code == grpc.StatusCode.FAILED_PRECONDITION:  # a checkpoint could not be written
            return PSCheckpointWriteError(details, task=name, address=addr)
        return PSError(f"{name} at {addr} failed {method}: {code}: {details}", task=name,
                       address=addr)

    def close(self) -> None:
        super().close()
        if self._direct is not None:
            self._direct.close()
        for ch in self._channels:
            ch.close()


class LocalClient(_Base):
    """In-process client of ``ParameterService`` objects (no network, no serialisation).

    Used by ``ParameterServerStrategy`` without a cluster: the variables live in host memory
    and updates are applied on the host CPU.

    Example:
        >>> from jaxdist.ps import LocalClient, ParameterService
        >>> client = LocalClient([ParameterService("local")])
    """

    def __init__(self, services: Sequence[ParameterService]):
        self.services = list(services)
        self.num_tasks = len(self.services)
        self._pool = futures.ThreadPoolExecutor(max_workers=max(2, self.num_tasks))

    def task_name(self, task: int) -> str:
        return self.services[task].task

    def call(self, task: int, method: str, meta: dict | None = None, arrays: dict | None = None,
             timeout: float | None = None) -> Message:
        arrays = {k: np.asarray(v) for k, v in (arrays or {}).items()}
        return protocol.handle(self.services[task], method, dict(meta or {}), arrays)


__all__ = ["LocalClient", "PSClient"]
