"""gRPC plumbing shared by the ps and worker servers: token check, binding, channels.

One implementation of the cluster-token check, so every service refuses the same requests with
the same ``UNAUTHENTICATED`` messages, and one way to bind a ``host:port`` from a cluster spec
and to open a channel to one: mutual TLS (``jaxdist._src.security.tls``), or plaintext on loopback
when explicitly asked for.
"""

from __future__ import annotations

import hmac
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc

from jaxdist._src.security.tls import TLSConfig, add_port, open_channel
from jaxdist._src.transport.connections import (
    ConnectionGate,
    ConnectionLimits,
    grpc_options,
    raise_open_files_limit,
)

# Each method is served twice: under ``service_name`` as a bidirectional stream of chunks, and
# under ``service_name + UNARY_SUFFIX`` taking a request of one chunk (most requests: pulls,
# clocks, pings, small pushes). A unary request saves gRPC Python's request-sending thread and
# a round trip: 0.6 ms instead of 1.1 ms per call on the 2-core test machine.
UNARY_SUFFIX = ".Unary"

#: The gRPC metadata key (and the direct transport's auth field name in messages) that carries
#: the cluster token.
TOKEN_METADATA_KEY = "x-jaxdist-token"

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.so_reuseport", 0),
]


def require_token(token: str | None, task: str, why: str) -> bytes:
    """The token as bytes; a clear error naming ``task`` when there is none.

    Example:
        >>> from jaxdist._src.transport.grpc_util import require_token
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
        >>> check_token(context, b"s3cret", "ps:0", "Pull")   # in a handler  # doctest: +SKIP
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
    options: Sequence[tuple[str, Any]] | None = None,
    *,
    tls: TLSConfig | None,
    connections: ConnectionLimits | None = None,
) -> tuple[grpc.Server, str]:
    """A gRPC server with one bidirectional-stream handler per method, bound to ``address``.

    ``tls`` is the task's mutual-TLS identity (clients must present a certificate signed by
    its CA); ``None`` serves plaintext, which ``jaxdist._src.security.tls`` allows only on loopback.
    ``connections`` bounds the port's connections (handshake deadline, idle timeout, total
    cap; default ``ConnectionLimits.from_env()``, see ``jaxdist._src.transport.connections``);
    ``GrpcTaskServer.start`` adds the per-address cap and the idle-first drop. The soft
    open-files limit is raised to the hard one first.

    Returns:
        ``(server, "host:port")`` with the port actually bound (``address`` may say port 0).

    Raises:
        ValueError: ``address`` is not ``host:port``.
        TLSConfigError: plaintext asked for on an address that is not loopback.
        OSError: the address cannot be bound (the message names the task and the address).

    Example:
        >>> server, addr = bind_server(  # doctest: +SKIP
        ...     "ps:0", "127.0.0.1:0", "svc", ["Ping"], make, 4, "ps", tls=resolve_tls())
    """
    if ":" not in address:
        raise ValueError(f"{task}: address {address!r} is not host:port")
    raise_open_files_limit()
    limits = ConnectionLimits.from_env() if connections is None else connections
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_prefix),
        options=[*(CHANNEL_OPTIONS if options is None else options), *grpc_options(limits)],
    )
    streaming, unary = {}, {}
    for m in methods:
        handler = make_handler(m)
        streaming[m] = grpc.stream_stream_rpc_method_handler(handler)
        unary[m] = grpc.unary_stream_rpc_method_handler(_one_chunk(handler))
    server.add_generic_rpc_handlers((
        grpc.method_handlers_generic_handler(service_name, streaming),
        grpc.method_handlers_generic_handler(service_name + UNARY_SUFFIX, unary),
    ))
    host = address.rsplit(":", 1)[0]
    try:
        port = add_port(server, address, tls, task)
    except RuntimeError as e:
        raise OSError(f"{task}: cannot bind {address}: {e}") from None
    if not port:
        raise OSError(f"{task}: cannot bind {address} (address in use?)")
    return server, f"{host}:{port}"


def open_channels(addresses: Sequence[str], tls: TLSConfig | None, job: str,
                  options: Sequence[tuple[str, Any]]) -> list[grpc.Channel]:
    """One channel per task address: mutual TLS, or plaintext (loopback only) when ``tls`` is
    ``None``.

    Example:
        >>> from jaxdist._src.transport.grpc_util import CHANNEL_OPTIONS, open_channels
        >>> import os
        >>> from jaxdist._src.security.tls import resolve_tls
        >>> os.environ["JAXDIST_INSECURE"] = "1"   # plaintext on loopback (tests, local runs)
        >>> channels = open_channels(["127.0.0.1:2222"], resolve_tls(), "ps", CHANNEL_OPTIONS)
    """
    return [open_channel(a, tls, f"{job}:{i}", options) for i, a in enumerate(addresses)]


def method_path(service_name: str, method: str, unary: bool = False) -> str:
    """The gRPC path of ``method`` as ``bind_server`` serves it.

    Example:
        >>> from jaxdist._src.transport.grpc_util import method_path
        >>> method_path("jaxdist.ps.ParameterService", "Pull", unary=True)
        '/jaxdist.ps.ParameterService.Unary/Pull'
    """
    return f"/{service_name}{UNARY_SUFFIX if unary else ''}/{method}"


def _one_chunk(handler: Callable) -> Callable:
    def unary_handler(request: bytes, context: grpc.ServicerContext):
        return handler(iter((request,)), context)

    return unary_handler


class ChunkStubs:
    """Callables of a chunked service's methods on a set of channels (one per task).

    ``stubs(task, method, chunks, **kwargs)`` sends the request ``chunks`` and returns the
    response iterator (a ``grpc.Call``): a request of one chunk goes as a unary request, a
    longer one streams.

    Example:
        >>> stubs = ChunkStubs(channels, "jaxdist.ps.ParameterService")  # doctest: +SKIP
        >>> responses = stubs(  # doctest: +SKIP
        ...     0, "Pull", wire.encode({"keys": ["w"]}), timeout=5.0)
    """

    def __init__(self, channels: Sequence[grpc.Channel], service_name: str):
        self._channels = list(channels)
        self._service = service_name
        self._stubs: dict[tuple[int, str, bool], Any] = {}
        self._lock = threading.Lock()

    def _stub(self, task: int, method: str, unary: bool):
        key = (task, method, unary)
        with self._lock:
            stub = self._stubs.get(key)
            if stub is None:
                channel = self._channels[task]
                path = method_path(self._service, method, unary)
                stub = (channel.unary_stream if unary else channel.stream_stream)(path)
                self._stubs[key] = stub
            return stub

    def __call__(self, task: int, method: str, chunks: Iterator[bytes], **kwargs: Any):
        chunks = iter(chunks)
        first = next(chunks)
        second = next(chunks, None)
        if second is None:
            return self._stub(task, method, True)(first, **kwargs)
        return self._stub(task, method, False)(itertools.chain((first, second), chunks),
                                               **kwargs)


class GrpcTaskServer:
    """Start / stop / wait of a task's gRPC server (the ps and worker servers share it).

    Subclasses set ``self._server`` (from ``bind_server``), ``self.address``,
    ``self.connection_limits`` (what they gave ``bind_server``) and ``self.service`` (with a
    ``stopped`` event) and may override ``_after_stop``. While the server runs,
    ``ConnectionGate`` watches its port.

    Example:
        >>> import os
        >>> from jaxdist._src.ps.server import ParameterServer
        >>> from jaxdist._src.ps.service import ParameterService
        >>> os.environ["JAXDIST_INSECURE"] = "1"   # plaintext on loopback (tests, local runs)
        >>> server = ParameterServer(ParameterService("ps:0"), "127.0.0.1:0", token="s3cret")
        >>> server = server.start()
        >>> server.stop()
        >>> server.wait_for_stop(timeout=10.0)
        True
    """

    _server: grpc.Server
    service: Any
    address: str
    connection_limits: ConnectionLimits
    _stop_wait_seconds: float = 5.0

    def _init_lifecycle(self) -> None:
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()

    def start(self):
        self._server.start()
        task = getattr(self.service, "task", "?")
        ConnectionGate.shared().watch(int(self.address.rsplit(":", 1)[1]), f"{task} gRPC",
                                      self.connection_limits)
        return self

    def stop(self, grace: float | None = 1.0) -> None:
        """Stops serving (in-flight calls get ``grace`` seconds to finish)."""
        with self._stop_lock:
            if self._stopped.is_set():
                return
            self.service.stopped.set()
            ConnectionGate.shared().unwatch(int(self.address.rsplit(":", 1)[1]))
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
