"""JAX's distributed runtime (coordination service and client) started the way jaxdist needs.

``start_runtime`` does what ``jax._src.distributed.State.initialize`` does in JAX 0.10
(``get_distributed_runtime_client(...).connect()``, the preemption sync manager, everything
recorded in ``jax._src.distributed.global_state``, where XLA's backends and gloo look for the
client), with one difference: process 0 runs the coordination service in a helper process
(``jaxdist.cluster.service_process``) instead of in itself. JAX terminates every process whose
client loses the service, so a service inside process 0 would take the survivors down with it
when process 0 dies; a service that outlives it lets them raise ``PeerLostError`` naming it.

Why not a non-fatal error callback instead: ``get_distributed_runtime_client`` accepts a
``missed_heartbeat_callback``, but jaxlib 0.10.2 binds it as ``std::function<void(absl::Status)>``
and has no Python conversion for ``absl::Status``: when XLA calls it (on a gRPC thread),
nanobind throws ``std::bad_cast`` and the process terminates ("terminate called after throwing
an instance of 'std::bad_cast'"). Without a callback XLA uses its default, which logs
"Terminating process because the JAX distributed service detected fatal errors" and aborts.
"""

from __future__ import annotations

import logging
import math
import os
import threading

from jaxdist.cluster.service_process import start_service_process
from jaxdist.cluster.waiting import call_with_timeout

log = logging.getLogger(__name__)

_REGISTRATION_SLACK_SECONDS = 3600  # JAX's own registration deadline, past jaxdist's timeout
_abandoned = threading.Event()


class JoinTimeout(TimeoutError):
    """Not every process registered with the coordination service in time."""


def start_runtime(coordination_address: str, num_processes: int, process_id: int,
                  bind_address: str, join_timeout: float, heartbeat_timeout: int,
                  shutdown_timeout: int, recoverable: bool = True,
                  linger_seconds: float = 60.0) -> None:
    """Starts the coordination service (from process 0) and connects this process's client.

    On return ``jax.distributed.is_initialized()`` is true and JAX's backends (gloo included)
    use the client, exactly as after ``jax.distributed.initialize``.

    JAX aborts the process when registration runs past the client's ``init_timeout``, so the
    client gets a long one (``join_timeout`` + 1 h) and the connection is waited for, bounded
    by ``join_timeout``, on a daemon thread: a group that does not assemble in time is a
    ``JoinTimeout`` here, and the abandoned registration keeps waiting in the background
    (``join_abandoned()``) until the process exits.

    Args:
        coordination_address: ``host:port`` of the coordination service.
        num_processes: processes in the group.
        process_id: this process's index.
        bind_address: where the service listens.
        join_timeout: seconds to wait for every process to register.
        heartbeat_timeout: seconds after which a silent process is declared dead.
        shutdown_timeout: seconds the shutdown of the client and service may take.
        recoverable: the service keeps running when a task dies (JAX's recoverable mode).
        linger_seconds: how long the service keeps serving the survivors after process 0
            died.

    Raises:
        JoinTimeout: not every process registered within ``join_timeout``.
        RuntimeError: JAX's distributed runtime is already initialized in this process, or the
            service did not start.
        Exception: whatever JAX raises when the client cannot connect.
    """
    from jax._src import distributed
    from jax._src.lib import _jax

    state = distributed.global_state
    if state.client is not None or state.service is not None:
        raise RuntimeError("JAX's distributed runtime is already initialized in this process")
    state.coordination_address = coordination_address
    state.process_id = process_id
    state.num_processes = num_processes
    register_timeout = int(math.ceil(join_timeout)) + _REGISTRATION_SLACK_SECONDS
    if process_id == 0:
        log.info("starting the JAX distributed service on %s", bind_address)
        state.service = start_service_process(
            bind_address, num_processes, heartbeat_timeout, shutdown_timeout, recoverable,
            linger_seconds, timeout_seconds=max(30.0, join_timeout),
            register_timeout=register_timeout,
        )
    state.client = _jax.get_distributed_runtime_client(
        coordination_address,
        process_id,
        init_timeout=register_timeout,
        shutdown_timeout=shutdown_timeout,
        heartbeat_timeout=heartbeat_timeout,
        use_compression=True,
    )
    log.info("connecting to the JAX distributed service on %s", coordination_address)
    finished, error = call_with_timeout(state.client.connect, join_timeout, "jaxdist-connect")
    if not finished:
        _abandoned.set()
        raise JoinTimeout(f"not every process registered within {join_timeout:g} s")
    if error is not None:
        raise error
    state.initialize_preemption_sync_manager()
    partition = os.environ.get("JAX_PARTITION_INDEX")
    state.partition_index = int(partition) if partition is not None else None


def join_abandoned() -> bool:
    """A registration timed out and is still pending: this process must not exit normally.

    JAX would abort it when the pending registration finally fails (or hang on the client's
    shutdown), so the exit path ends the process with ``os._exit`` instead.
    """
    return _abandoned.is_set()


__all__ = ["JoinTimeout", "join_abandoned", "start_runtime"]
