"""``ParameterServer``: a ``ParameterService`` behind gRPC (generic handlers, byte streams).

Every method is a bidirectional stream of ``jaxdist.ps.wire`` chunks: the request streams in,
the response streams out, so tensors of any size pass without gRPC message-size limits. Every
call must carry the cluster token in the ``x-jaxdist-token`` metadata; a call without it, or
with another token, is refused with ``UNAUTHENTICATED``.

Example:
    >>> server = ParameterServer(ParameterService("ps:0"), "127.0.0.1:2222", token="s3cret")
    >>> server.start()
    >>> server.wait_for_stop()      # until a Stop RPC or server.stop()
"""

from __future__ import annotations

import hmac
import logging
import threading
from concurrent import futures

import grpc

from jaxdist.ps import protocol, wire
from jaxdist.ps.errors import PSInvalidArgumentError, PSNotFoundError
from jaxdist.ps.memory import RECEIVE_POOL, tune_malloc
from jaxdist.ps.service import ParameterService

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.so_reuseport", 0),
]


class ParameterServer:
    """Serves one ``ParameterService`` on ``address`` over gRPC.

    Args:
        service: the state to serve.
        address: ``host:port`` from the cluster spec (port 0 picks a free port).
        token: the cluster token every request must carry (``None`` refuses to start).
        max_workers: gRPC handler threads.
    """

    def __init__(self, service: ParameterService, address: str, token: str | None,
                 max_workers: int = 16):
        if not token:
            raise ValueError(
                f"{service.task}: a parameter server needs the cluster token (set TF_CONFIG "
                f"'token' or JAXDIST_CLUSTER_TOKEN, or pass token=); it refuses requests "
                f"without it"
            )
        if ":" not in address:
            raise ValueError(f"{service.task}: address {address!r} is not host:port")
        self.service = service
        self._token = token.encode()
        tune_malloc()
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="jaxdist-ps"),
            options=CHANNEL_OPTIONS,
        )
        handlers = {
            name: grpc.stream_stream_rpc_method_handler(self._make_handler(name))
            for name in protocol.METHODS
        }
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(protocol.SERVICE_NAME, handlers),)
        )
        host = address.rsplit(":", 1)[0]
        try:
            self.port = self._server.add_insecure_port(address)
        except RuntimeError as e:
            raise OSError(f"{service.task}: cannot bind {address}: {e}") from None
        if not self.port:
            raise OSError(f"{service.task}: cannot bind {address} (address in use?)")
        self.address = f"{host}:{self.port}"
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()

    # ------------------------------------------------------------------ handlers
    def _check_token(self, context: grpc.ServicerContext, method: str) -> None:
        got = None
        for key, value in context.invocation_metadata() or ():
            if key == protocol.TOKEN_METADATA_KEY:
                got = value.encode() if isinstance(value, str) else value
        if got is None:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{self.service.task} refused {method}: the request carries no cluster token "
                f"(metadata {protocol.TOKEN_METADATA_KEY!r}); set JAXDIST_CLUSTER_TOKEN or "
                f"TF_CONFIG 'token' on the worker",
            )
        if not hmac.compare_digest(got, self._token):
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{self.service.task} refused {method}: wrong cluster token",
            )

    def _make_handler(self, method: str):
        def handler(request_iterator, context):
            self._check_token(context, method)
            try:
                meta, arrays = wire.decode(request_iterator, RECEIVE_POOL)
                # The decoded arrays belong to this call alone: the service may keep them.
                out_meta, out_arrays = protocol.handle(self.service, method, meta, arrays,
                                                       donate=True)
                del arrays
            except PSNotFoundError as e:
                context.abort(grpc.StatusCode.NOT_FOUND, str(e))
            except (PSInvalidArgumentError, wire.WireError, ValueError, TypeError, KeyError) as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{self.service.task} {method}: {type(e).__name__}: {e}")
            except Exception as e:  # noqa: BLE001 - reported to the caller, logged here
                log.exception("%s %s failed", self.service.task, method)
                context.abort(grpc.StatusCode.INTERNAL,
                              f"{self.service.task} {method}: {type(e).__name__}: {e}")
            if method == "Stop":
                threading.Thread(target=self.stop, args=(0.5,), daemon=True).start()
            chunk = int(meta.get("chunk_bytes", wire.DEFAULT_CHUNK_BYTES))
            yield from wire.encode(out_meta, out_arrays, max(1 << 16, min(chunk, 1 << 30)))

        return handler

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> ParameterServer:
        self._server.start()
        return self

    def stop(self, grace: float | None = 1.0) -> None:
        """Stops serving (in-flight calls get ``grace`` seconds to finish)."""
        with self._stop_lock:
            if self._stopped.is_set():
                return
            self.service.stopped.set()
            self._server.stop(grace).wait(timeout=(grace or 0) + 5)
            self._stopped.set()

    def wait_for_stop(self, timeout: float | None = None) -> bool:
        """Blocks until stopped (Stop RPC, ``stop()``, SIGTERM handler); True if stopped."""
        if not self.service.stopped.wait(timeout):
            return False
        if not self._stopped.is_set():
            self.stop()
        return True


__all__ = ["CHANNEL_OPTIONS", "ParameterServer"]
