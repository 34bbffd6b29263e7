"""The RPC transport under the parameter service (``ps``) and the coordinator (``coordinator``).

What a ps task and a worker task both speak, knowing nothing of either service: the message
format (``wire``: a JSON header plus 64-byte aligned arrays, cut into chunks for gRPC), the
aligned receive buffers (``memory``), the gRPC plumbing (``grpc_util``: the cluster-token check,
binding a server, opening channels, chunk stubs), the direct transport (``direct`` /
``direct_server``: the same requests as length-prefixed frames over one authenticated socket)
and the per-server limits (``limits``: request size, call duration, calls per client). It may
import ``cluster`` (TLS) and ``compat``; never ``ps`` or ``coordinator``.
"""
