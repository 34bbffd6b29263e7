"""``ParameterServer``: a ``ParameterService`` behind gRPC (generic handlers, byte streams).

Every method is a bidirectional stream of ``jaxdist.ps.wire`` chunks: the request streams in,
the response streams out, so tensors of any size pass without gRPC message-size limits. Every
call must carry the cluster token in the ``x-jaxdist-token`` metadata; a call without it, or
with another token, is refused with ``UNAUTHENTICATED``. The server speaks mutual TLS (the
certificates from ``tls=``, TF_CONFIG ``"tls"`` or ``JAXDIST_TLS_*``); it refuses to start
without them unless plaintext on loopback was asked for (``JAXDIST_INSECURE=1``).

Example:
    >>> server = ParameterServer(ParameterService("ps:0"), "127.0.0.1:2222", token="s3cret")
    >>> server.start()
    >>> server.wait_for_stop()      # until a Stop RPC or server.stop()
"""

from __future__ import annotations

import logging
import threading

import grpc

from jaxdist.cluster.tls import TLSConfig, resolve_tls
from jaxdist.ps import protocol, wire
from jaxdist.ps.errors import PSInvalidArgumentError, PSNotFoundError
from jaxdist.ps.grpc_util import (
    CHANNEL_OPTIONS,
    GrpcTaskServer,
    bind_server,
    check_token,
    require_token,
)
from jaxdist.ps.memory import RECEIVE_POOL, tune_malloc
from jaxdist.ps.service import ParameterService

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

    Raises:
        TLSConfigError: no TLS material and plaintext not asked for (the message says how to
            fix it), or plaintext asked for on an address that is not loopback.
    """

    def __init__(self, service: ParameterService, address: str, token: str | None,
                 max_workers: int = 16, *, tls: TLSConfig | str | None = None):
        self.service = service
        self._token = require_token(token, service.task, "a parameter server refuses requests "
                                    "without it")
        self.tls = resolve_tls(tls, service.task)
        tune_malloc()
        self._server, self.address = bind_server(
            service.task, address, protocol.SERVICE_NAME, protocol.METHODS, self._make_handler,
            max_workers, "jaxdist-ps", tls=self.tls)
        self.port = int(self.address.rsplit(":", 1)[1])
        self._init_lifecycle()

    # ------------------------------------------------------------------ handlers
    def _make_handler(self, method: str):
        def handler(request_iterator, context):
            check_token(context, self._token, self.service.task, method)
            try:
                meta, arrays = wire.decode(request_iterator, RECEIVE_POOL)
                out_meta, out_arrays = protocol.handle(self.service, method, meta, arrays)
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


__all__ = ["CHANNEL_OPTIONS", "ParameterServer"]
