"""gRPC plumbing shared by the ps and worker servers: token check and binding.

One implementation of the cluster-token check, so every service refuses the same requests with
the same ``UNAUTHENTICATED`` messages, and one way to bind a ``host:port`` from a cluster spec.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable, Iterable
from concurrent import futures
from typing import Any

import grpc

from jaxdist.ps.protocol import TOKEN_METADATA_KEY

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.so_reuseport", 0),
]


def require_token(token: str | None, task: str, why: str) -> bytes:
    """The token as bytes; a clear error naming ``task`` when there is none.

    Example:
        >>> require_token("s3cret", "ps:0", "it refuses requests without it")
        b's3cret'
    """
    if not token:
        raise ValueError(
            f"{task}: needs the cluster token (set TF_CONFIG 'token' or JAXDIST_CLUSTER_TOKEN, "
            f"or pass token=) because {why}"
        )
    return token.encode()


def check_token(context: grpc.ServicerContext, token: bytes, task: str, method: str) -> None:
    """Aborts the call with ``UNAUTHENTICATED`` unless it carries ``token``.

    Example:
        >>> check_token(context, b"s3cret", "ps:0", "Pull")   # inside a gRPC handler
    """
    got = None
    for key, value in context.invocation_metadata() or ():
        if key == TOKEN_METADATA_KEY:
            got = value.encode() if isinstance(value, str) else value
    if got is None:
        context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            f"{task} refused {method}: the request carries no cluster token "
            f"(metadata {TOKEN_METADATA_KEY!r}); set JAXDIST_CLUSTER_TOKEN or TF_CONFIG "
            f"'token' on the caller",
        )
    if not hmac.compare_digest(got, token):
        context.abort(
            grpc.StatusCode.UNAUTHENTICATED, f"{task} refused {method}: wrong cluster token"
        )


def bind_server(
    task: str,
    address: str,
    service_name: str,
    methods: Iterable[str],
    make_handler: Callable[[str], Callable],
    max_workers: int,
    thread_prefix: str,
) -> tuple[grpc.Server, str]:
    """A gRPC server with one bidirectional-stream handler per method, bound to ``address``.

    Returns:
        ``(server, "host:port")`` with the port actually bound (``address`` may say port 0).

    Raises:
        ValueError: ``address`` is not ``host:port``.
        OSError: the address cannot be bound (the message names the task and the address).

    Example:
        >>> server, addr = bind_server("ps:0", "127.0.0.1:0", "svc", ["Ping"], make, 4, "ps")
    """
    if ":" not in address:
        raise ValueError(f"{task}: address {address!r} is not host:port")
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_prefix),
        options=CHANNEL_OPTIONS,
    )
    handlers = {m: grpc.stream_stream_rpc_method_handler(make_handler(m)) for m in methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, handlers),))
    host = address.rsplit(":", 1)[0]
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise OSError(f"{task}: cannot bind {address}: {e}") from None
    if not port:
        raise OSError(f"{task}: cannot bind {address} (address in use?)")
    return server, f"{host}:{port}"


class GrpcTaskServer:
    """Start / stop / wait of a task's gRPC server (the ps and worker servers share it).

    Subclasses set ``self._server`` (from ``bind_server``) and ``self.service`` (with a
    ``stopped`` event) and may override ``_after_stop``.

    Example:
        >>> server = ParameterServer(service, "127.0.0.1:0", token="s3cret").start()
        >>> server.wait_for_stop(timeout=10.0)
    """

    _server: grpc.Server
    service: Any
    _stop_wait_seconds: float = 5.0

    def _init_lifecycle(self) -> None:
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()

    def start(self):
        self._server.start()
        return self

    def stop(self, grace: float | None = 1.0) -> None:
        """Stops serving (in-flight calls get ``grace`` seconds to finish)."""
        with self._stop_lock:
            if self._stopped.is_set():
                return
            self.service.stopped.set()
            self._server.stop(grace).wait(timeout=(grace or 0) + self._stop_wait_seconds)
            self._stopped.set()
            self._after_stop()

    def _after_stop(self) -> None:
        pass

    def wait_for_stop(self, timeout: float | None = None) -> bool:
        """Blocks until stopped (Stop RPC, ``stop()``, a signal handler); True if stopped."""
        if not self.service.stopped.wait(timeout):
            return False
        if not self._stopped.is_set():
            self.stop()
        return True
