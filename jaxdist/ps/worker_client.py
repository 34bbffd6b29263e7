"""The coordinator's client of the worker tasks (one gRPC channel per worker).

Every call has a deadline and a task name; failures become typed errors naming the worker:
``WorkerUnavailableError("worker:1 at 127.0.0.1:1234 did not answer RunClosure within 30.0 s
(...)")``. An in-flight call can be cancelled from another thread (the health watcher does so
when a worker stops answering heartbeats).

Example:
    >>> client = WorkerClient(["127.0.0.1:2224"], token="s3cret")
    >>> meta, _ = client.call(0, "Ping", timeout=2.0)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np

from jaxdist.ps import wire
from jaxdist.ps.coordinator_errors import (
    CoordinatorError,
    WorkerAuthenticationError,
    WorkerUnavailableError,
)
from jaxdist.ps.grpc_util import CHANNEL_OPTIONS, ChunkStubs
from jaxdist.ps.protocol import TOKEN_METADATA_KEY
from jaxdist.ps.worker_service import SERVICE_NAME

Message = tuple[dict[str, Any], dict[str, np.ndarray]]

_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
    ("grpc.enable_retries", 0),
]


class WorkerClient:
    """gRPC client of the ``worker`` job.

    Args:
        addresses: ``host:port`` of ``worker:0``, ``worker:1``, ...
        token: the cluster token sent with every call.
        job: the job name used in messages.
    """

    def __init__(self, addresses: Sequence[str], token: str | None, job: str = "worker"):
        if not addresses:
            raise ValueError("the coordinator needs at least one worker address, got none")
        self.addresses = list(addresses)
        self.job = job
        self._metadata = ((TOKEN_METADATA_KEY, token),) if token else ()
        self._channels = [grpc.insecure_channel(a, options=_OPTIONS) for a in self.addresses]
        self._stubs = ChunkStubs(self._channels, SERVICE_NAME)

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
        if not 0 <= task < self.num_tasks:
            raise ValueError(f"worker task {task} does not exist: the cluster has "
                             f"{self.num_tasks}")
        try:
            responses = self._stubs(
                task, method, wire.encode(meta, arrays), timeout=timeout, metadata=self._metadata,
                wait_for_ready=False)
            if on_start is not None:
                on_start(responses)
            return wire.decode(responses)
        except grpc.RpcError as e:
            raise self._translate(task, method, timeout, e) from None

    def _translate(self, task: int, method: str, timeout: float,
                   e: grpc.RpcError) -> CoordinatorError:
        name, addr = self.task_name(task), self.addresses[task]
        code = e.code() if hasattr(e, "code") else None
        details = e.details() if hasattr(e, "details") else str(e)
        if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.CANCELLED):
            return WorkerUnavailableError(
                f"{name} at {addr} did not answer {method} within {timeout:.1f} s "
                f"({details or code.name})", task=name, address=addr)
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return WorkerAuthenticationError(f"{name} at {addr}: {details}", task=name,
                                             address=addr)
        return CoordinatorError(f"{name} at {addr} failed {method}: {code}: {details}",
                                task=name, address=addr)

    def close(self) -> None:
        for ch in self._channels:
            ch.close()


__all__ = ["WorkerClient"]
