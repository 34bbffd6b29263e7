"""``jax.distributed`` bring-up from a resolver, peer-failure detection and an orderly exit.

``initialize_from_resolver`` starts JAX's coordination service and connects every training
task to it, with a timeout. The service runs in a helper process started by process 0
(``jaxdist._src.distributed.runtime``), so it outlives a crash of process 0, and the job runs
in JAX's *recoverable* mode, so the death of any member does not abort the survivors: their next
collective fails, the coordination service reports which tasks are gone, and ``wait_for_step``
raises ``PeerLostError`` naming them (the chief included). At exit the processes meet at a
barrier, then non-coordinator processes disconnect before process 0 stops the service. Once
the cluster is broken (or a registration timed out), a process exits with status 1 right after
its exit hooks, without interpreter shutdown: threads stuck in a broken collective would abort
it ("FATAL: exception not rethrown").

Before JAX starts, every process proves the cluster token to process 0 (and process 0 to it)
in an HMAC challenge-response on the coordinator's port (``jaxdist._src.distributed.handshake``); a
process with another token gets ``ClusterAuthenticationError`` and the cluster refuses it. The
coordination service and gloo listen only on the interface the cluster spec names for their
task. What this does not protect (JAX's service itself authenticates nobody) is in
docs/security.md.

A process cut off from the coordination service (its link, or the whole host of process 0,
gone) would be aborted by XLA's heartbeat thread ("the JAX distributed service detected fatal
errors", SIGABRT); its ``FreezeGuard`` with a ``LinkGuard`` ends it first with one line,
``jaxdist.PeerLostError: <task>: lost the coordination service (<task 0> at <address>) ...``,
and status 1 (``jaxdist._src.distributed.link_guard``). The tasks that still reach the service
name the cut-off task as lost, as for a task that died.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from jaxdist._src.cluster.errors import ClusterConfigError, ClusterTimeoutError, PeerLostError
from jaxdist._src.compat import jax_internals
from jaxdist._src.distributed.handshake import join_handshake, serve_handshake
from jaxdist._src.distributed.link_guard import LinkGuard
from jaxdist._src.distributed.process_group import ProcessGroup, process_group
from jaxdist._src.distributed.runtime import FreezeGuard, join_abandoned, start_runtime
from jaxdist._src.distributed.waiting import call_with_timeout

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SECONDS = 60.0
_POLL_SECONDS = 0.5  # how often a failed step asks the service again who is gone

class ClusterState:
    """This process's bring-up state: one instance, ``cluster_state`` (JAX's
    ``jax._src.distributed.State`` is the model).

    ``initialize_from_resolver`` fills it when the process joins a multi-process group; the
    step machinery (``strategies/multi_worker.py``) and the exit hooks read it through these
    methods and properties; nothing else writes it.

    Attributes:
        group: the ``ProcessGroup`` this process joined (``None`` before).
        timeout: how long registration and a step may take (``timeout_seconds``).
        heartbeat: the coordination service's heartbeat timeout in seconds (``None`` before).
        lost: the tasks found lost (``None`` while every peer is alive).
        broken: a step failed or timed out.

    Example:
        >>> from jaxdist._src.distributed.bringup import cluster_state
        >>> cluster_state.group is None, cluster_state.is_broken   # a single process
        (True, False)
        >>> cluster_state.heartbeat_seconds(30.0)
        30.0
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.group: ProcessGroup | None = None
        self.timeout: float = DEFAULT_TIMEOUT_SECONDS
        self.heartbeat: int | None = None
        self.lost: tuple[str, ...] | None = None
        self.broken: bool = False
        self.uncaught: bool = False  # the process is exiting on an uncaught exception
        self.exit_hooks_installed: bool = False
        self.joining: ProcessGroup | None = None  # registration timed out, JAX still waits
        self.freeze_guard: FreezeGuard | None = None
        self.shutdown_hooks: list[Callable[[], None]] = []

    @property
    def multi_process(self) -> bool:
        """Whether this process joined a group of several processes."""
        return self.group is not None and self.group.multi_process

    @property
    def is_broken(self) -> bool:
        """A step failed or timed out, a peer was lost, or the coordination service is gone."""
        return bool(self.lost or self.broken)

    def joined(self, group: ProcessGroup, timeout: float, heartbeat: int) -> None:
        """Records a successful join of ``group`` (a fresh, healthy state)."""
        self.group, self.timeout, self.heartbeat = group, timeout, heartbeat
        self.lost, self.broken = None, False

    def heartbeat_seconds(self, default: float) -> float:
        """The heartbeat timeout of the coordination service this process joined (``default``
        when none was set): how long the service takes to declare a silent task lost."""
        return float(self.heartbeat or default)

    def mark_broken(self) -> None:
        """Marks the training cluster broken (a step failed or timed out): at exit the process
        then ends at once (``exit_broken``) instead of an orderly ``shutdown``."""
        self.broken = True

    def mark_lost(self, tasks: Iterable[str]) -> tuple[str, ...]:
        """Records ``tasks`` as the lost peers (the first report wins); returns the lost peers."""
        if self.lost is None:
            self.lost = tuple(tasks)
        return self.lost

    def peer_lost_error(self, tasks: tuple[str, ...] | None = None,
                        cause: BaseException | None = None, what: str = "a step"
                        ) -> PeerLostError:
        """The ``PeerLostError`` naming ``tasks`` (default: the recorded lost peers), lost
        during ``what``."""
        tasks = tuple(self.lost or ()) if tasks is None else tuple(tasks)
        me = self.group.name if self.group else "this task"
        return PeerLostError(
            f"{me}: lost peer task(s) {', '.join(tasks)} during {what}; the training cluster "
            f"is broken. Restart the job (it resumes from the last checkpoint)"
            + (f" (error: {_first_line(cause)})" if cause is not None else ""),
            tasks=tasks,
        )

    def raise_lost(self, tasks: tuple[str, ...] | None = None,
                   cause: BaseException | None = None, what: str = "a step") -> None:
        """Raises ``peer_lost_error(tasks, cause, what)`` (from ``cause``)."""
        raise self.peer_lost_error(tasks, cause, what) from cause

    def raise_if_lost(self, cause: BaseException | None = None, what: str = "a step") -> None:
        """Raises ``PeerLostError`` at once if a peer was already found lost."""
        if self.lost:
            self.raise_lost(self.lost, cause, what)

    def exit_broken(self, reason: str, status: int = 1, group: ProcessGroup | None = None
                    ) -> None:
        """Ends the process at once with ``status``, skipping the interpreter's shutdown.

        Threads still blocked in the broken collective (and JAX's runtime waiting on them) would
        otherwise hang the exit or abort it ("FATAL: exception not rethrown", SIGABRT) when the
        interpreter tears them down. Output is flushed first; exit hooks registered after
        jaxdist's have already run. ``group`` names this process (default: the joined group).
        """
        group = group or self.group
        me = group.name if group is not None else "this task"
        try:
            sys.stderr.write(
                f"jaxdist: {me} exits with status {status}: {reason}; skipping "
                f"interpreter shutdown (threads may be stuck waiting on the cluster)\n"
            )
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        os._exit(status)


cluster_state = ClusterState()


def add_shutdown_hook(hook: Callable[[], None]) -> None:
    """Runs ``hook()`` at the start of ``shutdown``, before the coordination service's client
    goes away (a thread that uses the client stops there).

    Example:
        >>> from jaxdist._src.distributed.bringup import add_shutdown_hook
        >>> add_shutdown_hook(lambda: None)
    """
    cluster_state.shutdown_hooks.append(hook)


def current_group() -> ProcessGroup | None:
    """The process group ``initialize_from_resolver`` joined (``None`` before)."""
    return cluster_state.group


def lost_tasks() -> tuple[str, ...] | None:
    """The tasks found lost so far (``None`` while the cluster is healthy)."""
    return cluster_state.lost


def _jax_distributed():
    return jax_internals.distributed_module()


def _configure_jax(collectives: str | None, gloo_host: str | None = None) -> None:
    import jax

    if collectives is not None:
        try:
            jax.config.update("jax_cpu_collectives_implementation", collectives)
        except (AttributeError, ValueError) as e:  # pragma: no cover - other JAX versions
            log.warning("could not select CPU collectives %r: %s", collectives, e)
    if collectives == "gloo" and gloo_host:
        _bind_gloo(gloo_host)
    try:
        jax.config.update("jax_enable_recoverability", True)
    except AttributeError:  # pragma: no cover - other JAX versions
        log.warning("this JAX has no recoverable mode: a lost peer aborts the survivors")


def _bind_gloo(host: str) -> None:
    """Makes gloo listen on ``host`` (this task's interface in the cluster spec).

    JAX creates gloo without a host name, so gloo binds the address the machine's host name
    resolves to, whatever the cluster spec says; the CPU backend factory is replaced by one
    that passes ``hostname=host`` (JAX 0.10's ``make_gloo_tcp_collectives`` parameter).
    """
    distributed = jax_internals.distributed_module()
    xla_bridge = jax_internals.xla_bridge()
    _jax = jax_internals.jax_extension()

    def make_cpu_client():
        collectives = _jax.make_gloo_tcp_collectives(
            distributed_client=distributed.global_state.client, hostname=host)
        return xla_bridge.make_cpu_client(collectives=collectives)

    try:
        xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0,
                                            fail_quietly=False)
    except (AttributeError, TypeError, RuntimeError) as e:  # pragma: no cover - other JAX
        log.warning("could not bind gloo to %s: %s", host, e)


def _own_host(resolver: Any, group: ProcessGroup) -> str | None:
    """This task's host in the cluster spec (``localhost`` as 127.0.0.1)."""
    from jaxdist._src.cluster.cluster_spec import as_cluster_spec
    from jaxdist._src.cluster.validation import split_address

    try:
        address = as_cluster_spec(resolver.cluster_spec()).task_address(group.task_type,
                                                                         group.task_id)
        host, _ = split_address(address)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    host = host.strip("[]")
    return "127.0.0.1" if host == "localhost" else host


def _cluster_token(resolver: Any, group: ProcessGroup) -> str:
    from jaxdist._src.cluster.resolver import TOKEN_ENV

    token = getattr(resolver, "cluster_token", None)
    token = (token() if callable(token) else token) or os.environ.get(TOKEN_ENV)
    if not token:
        raise ClusterConfigError(
            f"{group.name}: a multi-process group needs the cluster token, which every process "
            f"proves to {group.task_name(0)} before jax.distributed starts: set TF_CONFIG "
            f"\"token\" or {TOKEN_ENV} to the same secret on every task (python -m "
            f"jaxdist.launch sets it)")
    return token


def _recoverable() -> bool:
    import jax

    return bool(getattr(jax.config, "jax_enable_recoverability", False))


def initialize_from_resolver(resolver: Any, timeout_seconds: float | None = None,
                             heartbeat_timeout_seconds: int | None = None,
                             cpu_collectives: str | None = "gloo") -> ProcessGroup:
    """Brings up ``jax.distributed`` for the training group a cluster resolver describes.

    Idempotent: a second call with the same cluster returns the same group. ``ps`` and
    ``evaluator`` tasks, and single-process clusters, do not start ``jax.distributed``.

    Args:
        resolver: a ``ClusterResolver`` (``TFConfigClusterResolver``, ``SlurmClusterResolver``,
            ...).
        timeout_seconds: how long to wait for every task to register (default 60 s); also the
            bound ``wait_for_step`` uses.
        heartbeat_timeout_seconds: after how long a silent task is declared dead (default: half
            of ``timeout_seconds``, at least 3 s).
        cpu_collectives: the CPU collectives implementation (``"gloo"``; ``None`` leaves JAX's
            choice).

    Returns:
        The ``ProcessGroup`` this process belongs to.

    Raises:
        ClusterConfigError: the cluster is invalid, or ``jax.distributed`` was already
            initialized differently, or JAX already ran computations in this process.
        ClusterTimeoutError: not every task registered within ``timeout_seconds``; the message
            names the coordinator and the tasks expected.
        ClusterAuthenticationError: this process failed the cluster handshake (another cluster
            token or cluster spec than process 0's).

    Example:
        >>> group = initialize_from_resolver(   # doctest: +SKIP
        ...     jaxdist.cluster_resolver.TFConfigClusterResolver(), timeout_seconds=120)
        >>> group.process_id, group.num_processes   # worker 1 of 2  # doctest: +SKIP
        (1, 2)
    """
    timeout = float(timeout_seconds or DEFAULT_TIMEOUT_SECONDS)
    group = process_group(resolver)
    with cluster_state.lock:
        prev = cluster_state.group
        if prev is not None:
            _check_same_group(prev, group)
            return prev
        if not group.multi_process:
            return group  # one process, or a ps / evaluator task: no jax.distributed
        _check_jax_not_started(group)
        token = _cluster_token(resolver, group)
        _configure_jax(cpu_collectives, _own_host(resolver, group))
        hb = int(heartbeat_timeout_seconds or max(3, math.ceil(timeout / 2)))
        deadline = time.monotonic() + timeout
        _authenticate(group, token, timeout, deadline)
        _start_jax_runtime(group, timeout, hb, deadline)
        cluster_state.joined(group, timeout, hb)
        _start_freeze_guard(group, hb)
        _install_exit_hooks()
        return group


def _check_same_group(prev: ProcessGroup, group: ProcessGroup) -> None:
    """A second ``initialize_from_resolver`` must describe the group already joined."""
    if (prev.tasks, prev.process_id, prev.coordination_address) != (
        group.tasks, group.process_id, group.coordination_address
    ):
        raise ClusterConfigError(
            f"jax.distributed is already initialized as {prev.name} of "
            f"{[prev.task_name(i) for i in range(prev.num_processes)]} (coordinator "
            f"{prev.coordination_address}); cannot join as {group.name} of "
            f"{[group.task_name(i) for i in range(group.num_processes)]}"
        )


def _check_jax_not_started(group: ProcessGroup) -> None:
    """Neither ``jax.distributed`` nor a JAX backend may be running in this process yet."""
    if _jax_distributed().is_initialized():
        raise ClusterConfigError(
            "jax.distributed was initialized outside jaxdist; create the strategy from a "
            "resolver instead of calling jax.distributed.initialize yourself"
        )
    if jax_internals.xla_bridge().backends_are_initialized():
        raise ClusterConfigError(
            f"cannot join the cluster as {group.name}: JAX already initialized its "
            f"backend in this process (something called jax.devices(), created an array "
            f"or ran a computation). Create MultiWorkerMirroredStrategy (or call "
            f"jaxdist.experimental_connect_to_cluster) before any other JAX call"
        )


def _authenticate(group: ProcessGroup, token: str, timeout: float, deadline: float) -> None:
    """Every process proves the token to process 0 (and it to them) before JAX starts."""
    if group.process_id == 0:
        serve_handshake(group, token, timeout)
    else:
        join_handshake(group, token, timeout)
        # JAX aborts the process when the coordinator never answers: probe it first.
        _wait_for_coordination_service(group, max(1.0, deadline - time.monotonic()))


def _start_jax_runtime(group: ProcessGroup, timeout: float, hb: int, deadline: float) -> None:
    """Starts JAX's coordination service (process 0) and client; a failure to register within
    the deadline is a ``ClusterTimeoutError`` naming the coordinator and the other tasks."""
    try:
        start_runtime(
            coordination_address=group.coordination_address,
            num_processes=group.num_processes,
            process_id=group.process_id,
            bind_address=group.coordination_bind_address,
            join_timeout=max(1.0, deadline - time.monotonic()),
            heartbeat_timeout=hb,
            shutdown_timeout=max(1, math.ceil(timeout)),
            recoverable=_recoverable(),
            linger_seconds=2 * timeout + hb,
        )
    except Exception as e:
        if join_abandoned():  # JAX's registration still runs: exit without shutdown
            cluster_state.joining = group
            _install_exit_hooks()
        else:
            try:
                _jax_distributed().global_state.shutdown()
            except Exception:  # noqa: BLE001 - best effort after a failed start
                pass
        others = [group.task_name(i) for i in range(group.num_processes)
                  if i != group.process_id]
        raise ClusterTimeoutError(
            f"{group.name} could not join the cluster within {timeout:g} s: the "
            f"coordinator {group.task_name(0)} at {group.coordination_address} and the "
            f"tasks {others} must all start (error: {_first_line(e)})",
            tasks=tuple(others),
            timeout_seconds=timeout,
        ) from e


def _start_freeze_guard(group: ProcessGroup, hb: int) -> None:
    """Starts the ``FreezeGuard`` (with its ``LinkGuard``) of the joined group."""
    client = _jax_distributed().global_state.client
    peers = [group.task_name(i) for i in range(group.num_processes)
             if i != group.process_id]
    link = LinkGuard(group.name, group.process_id, peers,
                     f"{group.task_name(0)} at {group.coordination_address}", hb, client)
    cluster_state.freeze_guard = FreezeGuard(
        group.name, group.process_id, group.num_processes, hb, client, link=link).start()


def _wait_for_coordination_service(group: ProcessGroup, timeout: float) -> None:
    host, _, port = str(group.coordination_address).rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError as e:
            last = e
            time.sleep(0.2)
    others = [group.task_name(i) for i in range(1, group.num_processes)
              if i != group.process_id]
    raise ClusterTimeoutError(
        f"{group.name} could not join the cluster within {timeout:g} s: the coordinator "
        f"{group.task_name(0)} at {group.coordination_address} is not reachable ({last}); start "
        f"it (and {others or 'no other task'}) with the same cluster spec",
        tasks=(group.task_name(0),),
        timeout_seconds=timeout,
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


# ---------------------------------------------------------------------- failure detection
def find_lost_tasks(wait_seconds: float, until_lost: bool = False) -> tuple[str, ...] | None:
    """Asks the coordination service which members are gone.

    Args:
        wait_seconds: how long to wait for an answer.
        until_lost: keep asking (every 0.5 s, within ``wait_seconds``) while every member is
            alive: after a collective failed, the service declares the dead task lost only once
            its heartbeats stop.

    Returns:
        The lost tasks' names (``("worker:1",)``), ``()`` when every member is alive, or
        ``None`` when the service did not answer within ``wait_seconds``. If the service
        itself is unreachable the coordinator task is reported lost.
    """
    group = cluster_state.group
    if group is None or not group.multi_process:
        return ()
    client = _jax_distributed().global_state.client
    if client is None:
        return None
    result: dict[str, Any] = {}
    deadline = time.monotonic() + max(0.1, wait_seconds)

    def probe() -> None:
        while True:
            live = client.get_live_nodes(list(range(group.num_processes)))
            result["live"] = live
            if (not until_lost or len(live) < group.num_processes
                    or time.monotonic() + _POLL_SECONDS > deadline):
                return
            time.sleep(_POLL_SECONDS)

    _, error = call_with_timeout(probe, max(0.1, deadline - time.monotonic()),
                                 "jaxdist-live-nodes")
    if error is not None:  # the service itself is unreachable
        return (group.task_name(0),)
    if "live" in result:
        live = set(result["live"])
        return tuple(group.task_name(i) for i in range(group.num_processes) if i not in live)
    return None


def raise_wait_timeout(group: ProcessGroup, what: str, timeout: float,
                       until_lost: bool = False) -> NoReturn:
    """``what`` did not finish within ``timeout`` s: marks the cluster broken and raises the
    typed error, ``PeerLostError`` naming the lost tasks when the coordination service reports
    any (``until_lost``: keep asking it for the whole heartbeat window), else
    ``ClusterTimeoutError`` naming the peers waited on.

    Raises:
        PeerLostError: the coordination service reports lost tasks.
        ClusterTimeoutError: it reports none, or does not answer.
    """
    cluster_state.mark_broken()
    lost = find_lost_tasks(cluster_state.heartbeat_seconds(timeout) + 2.0, until_lost=until_lost)
    if lost:
        cluster_state.raise_lost(cluster_state.mark_lost(lost), None, what)
    peers = tuple(group.task_name(i) for i in range(group.num_processes)
                  if i != group.process_id)
    status = "no task lost" if lost == () else "nothing (it did not answer)"
    raise ClusterTimeoutError(
        f"{group.name}: {what} did not finish within {timeout:g} s; the coordination "
        f"service reports {status}. Waiting on peers {list(peers)}",
        tasks=peers, timeout_seconds=timeout)


def _block(leaves: list[Any]) -> None:
    for x in leaves:
        if hasattr(x, "block_until_ready"):
            x.block_until_ready()


def wait_for_step(outputs: Any, timeout_seconds: float | None = None, what: str = "a step") -> Any:
    """Waits for ``outputs`` (arrays of a step with collectives), bounded by the timeout.

    In a single-process run this is ``block_until_ready``.

    Raises:
        PeerLostError: a member of the group died (the message and ``.tasks`` name it).
        ClusterTimeoutError: the step did not finish in time and no member is known dead.

    Example:
        >>> import jax, jaxdist
        >>> import jax.numpy as jnp
        >>> from jaxdist._src.distributed.bringup import wait_for_step
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
        >>> loss = wait_for_step(strategy.run(lambda x: x * 2, args=(jnp.ones(3),)))
    """
    import jax

    leaves = [x for x in jax.tree.leaves(outputs) if isinstance(x, jax.Array)]
    group = cluster_state.group
    if group is None or not group.multi_process:
        _block(leaves)
        return outputs
    cluster_state.raise_if_lost(None, what)
    timeout = float(timeout_seconds or cluster_state.timeout)
    start = time.monotonic()
    # On a daemon thread, so a collective that never returns cannot keep the process alive.
    finished, error = call_with_timeout(lambda: _block(leaves), timeout, "jaxdist-wait")
    if not finished:
        raise_wait_timeout(group, what, timeout)
    if error is not None:
        raise_if_peer_lost(error, what, max(2.0, timeout - (time.monotonic() - start)))
        raise error
    return outputs


_RUNTIME_FAILURE = re.compile(
    r"gloo|nccl|UNAVAILABLE|DEADLINE_EXCEEDED|ABORTED|INTERNAL|UNKNOWN|connection|socket|"
    r"coordination|heartbeat|peer",
    re.IGNORECASE,
)


def raise_if_peer_lost(error: BaseException, what: str = "a step",
                       wait_seconds: float | None = None) -> None:
    """Turns a failed collective into ``PeerLostError`` when a member of the group is gone.

    Returns (so the caller re-raises ``error``) when the error does not look like a runtime
    failure, when this process is not in a multi-process group, or when every member is alive.

    Raises:
        PeerLostError: the coordination service reports lost tasks; ``.tasks`` names them.
    """
    if not cluster_state.multi_process:
        return
    if isinstance(error, (PeerLostError, ClusterTimeoutError)):
        return
    cluster_state.raise_if_lost(error, what)
    if isinstance(error, (TypeError, KeyError, AttributeError)) or not _RUNTIME_FAILURE.search(
        f"{type(error).__name__}: {error}"
    ):
        return
    cluster_state.mark_broken()
    lost = find_lost_tasks(float(wait_seconds or cluster_state.timeout), until_lost=True)
    if lost:
        cluster_state.raise_lost(cluster_state.mark_lost(lost), error, what)


def check_healthy(what: str = "a step") -> None:
    """Raises ``PeerLostError`` at once if a peer was already found lost."""
    cluster_state.raise_if_lost(None, what)



# ---------------------------------------------------------------------- orderly exit
def _install_exit_hooks() -> None:
    if cluster_state.exit_hooks_installed:
        return
    cluster_state.exit_hooks_installed = True
    previous = sys.excepthook

    def excepthook(tp, value, tb):
        cluster_state.uncaught = True
        previous(tp, value, tb)

    sys.excepthook = excepthook
    # Registered after JAX's own clean-up, so it runs before it (atexit is LIFO).
    atexit.register(_at_exit)


def cluster_broken() -> bool:
    """A step failed or timed out, a peer was lost, or the coordination service is gone."""
    return cluster_state.is_broken



def _at_exit() -> None:
    """The exit hook: an orderly ``shutdown`` while healthy, else ``exit_broken``."""
    if join_abandoned() and cluster_state.joining is not None:
        cluster_state.exit_broken("its registration with the coordination service timed out "
                                  "and is still pending", group=cluster_state.joining)
    group = cluster_state.group
    if group is None or not group.multi_process:
        return
    if not cluster_broken():
        shutdown()
    if cluster_broken():
        lost = ", ".join(cluster_state.lost or ()) or "none named"
        cluster_state.exit_broken(f"the training cluster is broken (lost: {lost})", group=group)


def shutdown(timeout_seconds: float | None = None) -> None:
    """Leaves the cluster in order: barrier, workers disconnect, then process 0 stops the service.

    Runs automatically at exit; skips the barrier when a peer was lost or this process is
    exiting on an uncaught exception (so the others learn it quickly instead of waiting).
    """
    while cluster_state.shutdown_hooks:
        hook = cluster_state.shutdown_hooks.pop()
        try:
            hook()
        except Exception as e:  # noqa: BLE001 - shut down anyway
            log.warning("shutdown hook %r failed: %s", hook, _first_line(e))
    group = cluster_state.group
    if group is None or not group.multi_process:
        return
    if cluster_state.freeze_guard is not None:
        cluster_state.freeze_guard.stop()
    dist = _jax_distributed()
    state = dist.global_state
    client = state.client
    if client is None:
        return
    timeout = float(timeout_seconds or min(cluster_state.timeout, 60.0))
    healthy = not (cluster_state.is_broken or cluster_state.uncaught)
    if healthy:
        try:
            client.wait_at_barrier("jaxdist_exit", int(timeout * 1000))
        except Exception as e:  # noqa: BLE001 - exit anyway
            log.warning("exit barrier failed: %s", _first_line(e))
            healthy = False
    if group.process_id != 0:
        try:
            state.shutdown()
        except Exception as e:  # noqa: BLE001 - the service may be gone already
            log.info("distributed shutdown: %s", _first_line(e))
        return
    # Process 0 hosts the service: wait (bounded) until the others have disconnected.
    find_lost_tasks(timeout if healthy else min(timeout, 5.0))
    try:
        state.shutdown()
    except Exception as e:  # noqa: BLE001
        log.info("distributed shutdown: %s", _first_line(e))
    cluster_state.group = None


def should_save_checkpoint() -> bool:
    """Whether this task writes checkpoints: the chief of the joined cluster (True alone).

    Example:
        >>> from jaxdist._src.distributed.bringup import should_save_checkpoint
        >>> should_save_checkpoint()     # a single process
        True
    """
    group = current_group()
    return True if group is None else bool(group.is_chief)


def should_load_checkpoint() -> bool:
    """Whether this task loads checkpoints: every task of a synchronous cluster does.

    TF returns the worker context's ``experimental_should_init``, which is True for every
    task of ``MultiWorkerMirroredStrategy`` (each task restores the same state).

    Example:
        >>> from jaxdist._src.distributed.bringup import should_load_checkpoint
        >>> should_load_checkpoint()
        True
    """
    return True


__all__ = [
    "add_shutdown_hook",
    "should_load_checkpoint",
    "should_save_checkpoint",
    "DEFAULT_TIMEOUT_SECONDS",
    "ClusterState",
    "check_healthy",
    "cluster_state",
    "cluster_broken",
    "current_group",
    "find_lost_tasks",
    "initialize_from_resolver",
    "lost_tasks",
    "raise_if_peer_lost",
    "raise_wait_timeout",
    "shutdown",
    "wait_for_step",
]
