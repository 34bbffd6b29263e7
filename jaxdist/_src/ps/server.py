"""``ParameterServer``: a ``ParameterService`` behind gRPC (generic handlers, byte streams).

Every method is a bidirectional stream of ``jaxdist._src.transport.wire`` chunks: the request
streams in, the response streams out, so tensors of any size pass without gRPC message-size
limits. Every call must carry the cluster token in the ``x-jaxdist-token`` metadata; a call
without it, or with another token, is refused with ``UNAUTHENTICATED``. The server speaks
mutual TLS (the certificates from ``tls=``, TF_CONFIG ``"tls"`` or ``JAXDIST_TLS_*``); it
refuses to start without them unless plaintext on loopback was asked for
(``JAXDIST_INSECURE=1``).

Example:
    >>> from jaxdist.ps import ParameterServer, ParameterService
    >>> import os
    >>> os.environ["JAXDIST_INSECURE"] = "1"   # plaintext on loopback (tests, local runs)
    >>> server = ParameterServer(ParameterService("ps:0"), "127.0.0.1:0", token="s3cret")
    >>> server = server.start()
    >>> server.stop()               # or a Stop RPC
    >>> server.wait_for_stop()      # until a Stop RPC or server.stop()
    True
"""

from __future__ import annotations

import logging
import threading

import grpc

from jaxdist._src.ps import protocol
from jaxdist._src.ps.errors import (
    PSCheckpointWriteError,
    PSInvalidArgumentError,
    PSNotFoundError,
)
from jaxdist._src.ps.service import ParameterService
from jaxdist._src.security.tls import TLSConfig, resolve_tls
from jaxdist._src.transport import direct, wire
from jaxdist._src.transport.connections import ConnectionLimits
from jaxdist._src.transport.direct_server import CallFailed, DirectServer
from jaxdist._src.transport.grpc_util import (
    CHANNEL_OPTIONS,
    GrpcTaskServer,
    bind_server,
    check_token,
    require_token,
)
from jaxdist._src.transport.limits import CallGuard, ServerLimits
from jaxdist._src.transport.memory import RECEIVE_POOL, tune_malloc

log = logging.getLogger(__name__)



class ParameterServer(GrpcTaskServer):
    """Serves one ``ParameterService`` on ``address`` over gRPC.

    Args:
        service: the state to serve.
        address: ``host:port`` from the cluster spec (port 0 picks a free port).
        token: the cluster token every request must carry (``None`` refuses to start).
        max_workers: gRPC handler threads.
        tls: the mutual-TLS identity; ``"insecure"`` for plaintext (loopback only); ``None``
            reads TF_CONFIG ``"tls"`` / ``JAXDIST_TLS_*`` / ``JAXDIST_INSECURE``.
        limits: request size, call duration and calls per client (default:
            ``ServerLimits.from_env()``, see ``jaxdist._src.transport.limits``).
        direct_transport: also serve the direct socket transport
            (``jaxdist._src.transport.direct``) on a second port of the same host, with the
            same TLS, token and limits (default: on unless ``JAXDIST_PS_DIRECT=0``).
        connections: what connections may hold on both ports (handshake deadline, idle
            timeout, caps; default ``ConnectionLimits.from_env()``, see
            ``jaxdist._src.transport.connections``).

    The server confines ``Save`` / ``Restore`` to the service's checkpoint root (see
    ``ParameterService``): a request naming a directory outside it is refused.

    Raises:
        TLSConfigError: no TLS material and plaintext not asked for (the message says how to
            fix it), or plaintext asked for on an address that is not loopback.
    """

    def __init__(self, service: ParameterService, address: str, token: str | None,
                 max_workers: int = 16, *, tls: TLSConfig | str | None = None,
                 limits: ServerLimits | None = None, direct_transport: bool | None = None,
                 connections: ConnectionLimits | None = None):
        self.service = service
        self._token = require_token(token, service.task, "a parameter server refuses requests "
                                    "without it")
        self.tls = resolve_tls(tls, service.task)
        self.limits = limits or ServerLimits.from_env(max_workers=max_workers)
        self._guard = CallGuard(service.task, self.limits)
        self.connection_limits = connections or ConnectionLimits.from_env()
        service.confine_checkpoints()
        service.max_wait_seconds = self.limits.max_call_seconds
        tune_malloc()
        # gRPC itself refuses a single message (chunk) past the request limit.
        options = [*(o for o in CHANNEL_OPTIONS if o[0] != "grpc.max_receive_message_length"),
                   ("grpc.max_receive_message_length",
                    min(self.limits.max_request_bytes + (1 << 20), 2**31 - 1))]
        self._server, self.address = bind_server(
            service.task, address, protocol.SERVICE_NAME, protocol.METHODS, self._make_handler,
            max_workers, "jaxdist-ps", options=options, tls=self.tls,
            connections=self.connection_limits)
        self.port = int(self.address.rsplit(":", 1)[1])
        use_direct = direct.enabled() if direct_transport is None else direct_transport
        self.direct = DirectServer(
            service.task, self.address.rsplit(":", 1)[0], self._token, self.tls, self.limits,
            self._run_direct, service.incarnation,
            connections=self.connection_limits) if use_direct else None
        self._init_lifecycle()

    def start(self):
        if self.direct is not None:
            self.direct.start()
        return super().start()

    def _after_stop(self) -> None:
        if self.direct is not None:
            self.direct.stop()

    def _run_direct(self, method: str, meta: dict, arrays: dict) -> tuple[dict, dict]:
        """One call from the direct transport (already authenticated and size-checked)."""
        if method not in protocol.METHODS:
            raise CallFailed("UNIMPLEMENTED", f"{self.service.task}: unknown method "
                                              f"{method[:64]!r}")
        try:
            response_chunk_bytes(meta)  # checked as on the gRPC path
            out_meta, out_arrays = protocol.handle(self.service, method, meta, arrays)
        except Exception as e:  # noqa: BLE001 - mapped as the gRPC path maps it
            code, details = failure_status(self.service.task, method, e)
            raise CallFailed(code.name, details) from None
        return self._annotate(method, out_meta), out_arrays

    def _annotate(self, method: str, meta: dict) -> dict:
        if method == "Ping" and self.direct is not None:
            return {**meta, "direct_port": self.direct.port,
                    "max_request_bytes": self.limits.max_request_bytes}
        return meta

    # ------------------------------------------------------------------ handlers
    def _make_handler(self, method: str):
        task = self.service.task

        def handler(request_iterator, context):
            check_token(context, self._token, task, method)
            with self._guard.call(context, method) as progress:
                try:
                    meta, arrays = wire.decode(progress.watch_requests(request_iterator),
                                               RECEIVE_POOL,
                                               max_bytes=self.limits.max_request_bytes)
                    progress.streaming(False)
                    chunk = response_chunk_bytes(meta)
                    out_meta, out_arrays = protocol.handle(self.service, method, meta, arrays)
                    del arrays
                except grpc.RpcError:
                    if not context.is_active():  # cancelled: overdue, or the client left
                        return
                    raise
                except Exception as e:  # noqa: BLE001 - reported to the caller
                    context.abort(*failure_status(task, method, e))
                out_meta = self._annotate(method, out_meta)
                if method == "Stop":
                    threading.Thread(target=self.stop, args=(0.5,), daemon=True).start()
                yield from progress.watch_responses(wire.encode(out_meta, out_arrays, chunk))

        return handler


def failure_status(task: str, method: str, e: Exception) -> tuple[grpc.StatusCode, str]:
    """The status and message a failed call answers (both transports).

    Example:
        >>> from jaxdist._src.ps.server import failure_status
        >>> from jaxdist.ps import PSNotFoundError
        >>> failure_status("ps:0", "Pull", PSNotFoundError("no variable 'w'"))[0]
        <StatusCode.NOT_FOUND: (5, 'not found')>
    """
    if isinstance(e, wire.MessageTooLargeError):
        return (grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{task} {method}: {e}; raise the server's max_request_bytes or send smaller "
                f"requests")
    if isinstance(e, PSNotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(e)
    if isinstance(e, PSCheckpointWriteError):  # the ps goes on serving: one line, no trace
        log.warning("%s %s failed: %s", task, method, e)
        return grpc.StatusCode.FAILED_PRECONDITION, str(e)
    if isinstance(e, (PSInvalidArgumentError, wire.WireError, ValueError, TypeError, KeyError)):
        return grpc.StatusCode.INVALID_ARGUMENT, f"{task} {method}: {type(e).__name__}: {e}"
    log.error("%s %s failed", task, method, exc_info=e)
    return grpc.StatusCode.INTERNAL, f"{task} {method}: {type(e).__name__}: {e}"


_MIN_CHUNK, _MAX_CHUNK = 1 << 16, 1 << 30


def response_chunk_bytes(meta: dict) -> int:
    """The chunk size a request asks its response to be cut into (``chunk_bytes``), clamped to
    [64 KiB, 1 GiB].

    Raises:
        PSInvalidArgumentError: ``chunk_bytes`` is not a positive integer.

    Example:
        >>> from jaxdist._src.ps.server import response_chunk_bytes
        >>> response_chunk_bytes({"chunk_bytes": 4 << 20})
        4194304
    """
    chunk = meta.get("chunk_bytes", wire.DEFAULT_CHUNK_BYTES)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise PSInvalidArgumentError(
            f"chunk_bytes={chunk!r}: expected a positive integer (the response is cut into "
            f"chunks of that many bytes, clamped to [{_MIN_CHUNK}, {_MAX_CHUNK}])")
    return max(_MIN_CHUNK, min(chunk, _MAX_CHUNK))


__all__ = ["CHANNEL_OPTIONS", "ParameterServer", "failure_status", "response_chunk_bytes"]
