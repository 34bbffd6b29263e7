"""``MultiWorkerMirroredStrategy``: synchronous data parallelism across processes and hosts.

The cluster resolver (``TF_CONFIG`` by default) says which task this process is; the strategy
brings up ``jax.distributed`` (chief first, then workers; ``ps`` and ``evaluator`` tasks stay
out), builds one global mesh over every process's devices (ordered process by process) and runs
steps with ``jit(shard_map(...))`` over it, as ``MirroredStrategy`` does on one host. Each process
feeds its own replicas; collectives go over gloo on CPU and NCCL on GPU.

Steps are not waited on one by one (that would stop two steps from ever overlapping): at most
``experimental_max_steps_in_flight`` (2) are dispatched and unfinished. A background thread
waits for each step in order (``jaxdist._src.strategies.watched_steps``); before dispatching step
``k`` the training thread waits, at most ``CommunicationOptions.timeout_seconds``, for step
``k - 2``. A dead peer becomes ``PeerLostError`` naming it: raised by the next ``run`` (a failed
collective, a step that did not finish in time) when the training thread can receive it.

When it cannot (it is blocked reading an output of a step whose collective never returns, or
inside XLA's collective at dispatch: a frozen peer, SIGSTOP or a hung host, blocks the
dispatching thread itself since the CPU client runs small computations inline), watchdogs act:
once a step has waited ``timeout_seconds`` in the background (or a dispatch has run
``timeout_seconds`` + heartbeat timeout + 4 s), they ask the coordination service which peers
are gone and, if any is (or the service does not answer), print the typed error
(``PeerLostError: worker:0: lost peer task(s) worker:1 ...``) and end the
process with status 1, as an uncaught exception would, instead of hanging. While every peer is
alive (a long compilation, a slow step) they keep waiting.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import sys
from typing import Any

import jax
from jax import lax

from jaxdist._src.cluster.auto_detect import resolver_from_environment
from jaxdist._src.cluster.errors import ClusterConfigError, ClusterTimeoutError
from jaxdist._src.cluster.tf_config import TFConfigClusterResolver
from jaxdist._src.distributed.bringup import (
    DEFAULT_TIMEOUT_SECONDS,
    check_healthy,
    cluster_state,
    find_lost_tasks,
    initialize_from_resolver,
    raise_if_peer_lost,
    raise_wait_timeout,
)
from jaxdist._src.distributed.process_group import ProcessGroup
from jaxdist._src.distributed.waiting import Watchdog
from jaxdist._src.strategies.cross_device_ops import NcclAllReduce, pack_by_bytes
from jaxdist._src.strategies.inflight import StepThrottle
from jaxdist._src.strategies.strategy import Strategy, StrategyExtended
from jaxdist._src.strategies.watched_steps import StepNotFinished, WatchedSteps

log = logging.getLogger(__name__)


class CommunicationImplementation(enum.Enum):
    """Which collective implementation to use (``tf.distribute.experimental.*``).

    Example:
        >>> import jaxdist
        >>> options = jaxdist.CommunicationOptions(
        ...     implementation=jaxdist.CommunicationImplementation.RING)
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


CollectiveCommunication = CommunicationImplementation


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
    """How replicas of a multi-worker strategy communicate.

    Args:
        bytes_per_pack: pack gradients into buckets of at most this many bytes before each
            all-reduce (0: one bucket per dtype, as ``NcclAllReduce(num_packs=1)``).
        timeout_seconds: bound on every wait for other processes (joining the cluster, each
            step's collectives); ``None`` means 60 s.
        implementation: ``AUTO``, ``RING`` (gloo on CPU, NCCL on GPU) or ``NCCL`` (GPUs only).

    Example:
        >>> import jaxdist
        >>> options = jaxdist.CommunicationOptions(
        ...     bytes_per_pack=32 * 1024 * 1024, timeout_seconds=120,
        ...     implementation=jaxdist.CommunicationImplementation.RING)
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation | str = CommunicationImplementation.AUTO

    def __post_init__(self):
        impl = self.implementation
        if not isinstance(impl, CommunicationImplementation):
            try:
                impl = CommunicationImplementation[str(getattr(impl, "name", impl)).upper()]
            except KeyError:
                raise ValueError(
                    f"CommunicationOptions.implementation={self.implementation!r}: expected "
                    f"AUTO, RING or NCCL"
                ) from None
            object.__setattr__(self, "implementation", impl)
        if not isinstance(self.bytes_per_pack, int) or self.bytes_per_pack < 0:
            raise ValueError(
                f"CommunicationOptions.bytes_per_pack={self.bytes_per_pack!r}: expected an "
                f"integer >= 0"
            )
        if self.timeout_seconds is not None and not self.timeout_seconds > 0:
            raise ValueError(
                f"CommunicationOptions.timeout_seconds={self.timeout_seconds!r}: expected a "
                f"positive number of seconds or None"
            )


class PackedAllReduce(NcclAllReduce):
    """All-reduce of values packed into buckets of ``bytes_per_pack`` bytes (one psum each).

    Example:
        >>> from jaxdist._src.strategies.multi_worker import PackedAllReduce
        >>> ops = PackedAllReduce(bytes_per_pack=4 * 1024 * 1024)
    """

    def __init__(self, bytes_per_pack: int):
        super().__init__(num_packs=1)
        if bytes_per_pack <= 0:
            raise ValueError(f"bytes_per_pack must be > 0, got {bytes_per_pack}")
        self.bytes_per_pack = bytes_per_pack
        self.pack_counts: list[int] = []  # buckets of each all-reduce traced (for tests)

    def _sum_varying(self, xs, axes, n):
        packs, unpack = pack_by_bytes(xs, self.bytes_per_pack)
        self.pack_counts.append(len(packs))
        return unpack([lax.psum(p, axes) for p in packs])

    def __repr__(self) -> str:
        return f"PackedAllReduce(bytes_per_pack={self.bytes_per_pack})"


def _global_devices(group: ProcessGroup) -> list[Any]:
    if not group.in_training_group:
        return list(jax.local_devices())
    # Process by process (process 0 is the chief), then by device id within a process.
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


class MultiWorkerExtended(StrategyExtended):
    """``StrategyExtended`` of ``MultiWorkerMirroredStrategy`` (adds the task's role)."""

    plain_run = False  # its run_compiled does more per call

    def __init__(self, strategy: Strategy, resolver: Any, options: CommunicationOptions):
        self._resolver = resolver
        self._options = options
        self._timeout = float(options.timeout_seconds or DEFAULT_TIMEOUT_SECONDS)
        group = initialize_from_resolver(resolver, timeout_seconds=self._timeout)
        if group.task_type == "ps":
            raise ClusterConfigError(
                f"MultiWorkerMirroredStrategy runs on chief and worker tasks, but this process "
                f"is {group.name}; ps tasks serve variables for ParameterServerStrategy"
            )
        self._group = group
        devices = _global_devices(group)
        platform = devices[0].platform
        impl = options.implementation
        if impl is CommunicationImplementation.NCCL and platform != "gpu":
            raise ValueError(
                f"CommunicationImplementation.NCCL needs GPUs, but the devices are "
                f"{platform} ({devices[0]}); use RING (gloo on CPU) or AUTO"
            )
        cdo = PackedAllReduce(options.bytes_per_pack) if options.bytes_per_pack else None
        super().__init__(strategy, devices, cdo)
        self._watchdog = Watchdog("jaxdist-step-watchdog")

    # ------------------------------------------------------------------ role (TF names)
    @property
    def cluster_resolver(self) -> Any:
        return self._resolver

    @property
    def process_group(self) -> ProcessGroup:
        """This process's place in the ``jax.distributed`` group."""
        return self._group

    @property
    def task_type(self) -> str | None:
        return self._group.task_type

    @property
    def task_id(self) -> int | None:
        return self._group.task_id

    @property
    def is_chief(self) -> bool:
        """The chief task, or worker 0 when the cluster has no chief (TF's rule)."""
        return self._group.is_chief

    @property
    def should_checkpoint(self) -> bool:
        """Only the chief writes checkpoints."""
        return self.is_chief

    @property
    def should_save_summary(self) -> bool:
        """Only the chief writes summaries and metrics."""
        return self.is_chief

    @property
    def should_init(self) -> bool:
        """Every task initialises its (identical) state; jaxdist needs no broadcast."""
        return True

    experimental_should_init = should_init

    @property
    def experimental_between_graph(self) -> bool:
        return True

    @property
    def local_devices(self) -> tuple[Any, ...]:
        """This process's devices among the strategy's replicas."""
        me = jax.process_index()
        return tuple(d for d in self._devices if d.process_index == me)

    @property
    def communication_options(self) -> CommunicationOptions:
        return self._options

    # ------------------------------------------------------------------ steps
    def _make_throttle(self, max_in_flight: int) -> StepThrottle:
        if not self._group.multi_process:
            return StepThrottle(max_in_flight)
        return WatchedSteps(max_in_flight, self._timeout, self._on_slow_step)

    def run_compiled(self, fn, args=(), kwargs=None):
        check_healthy()
        if not self._group.multi_process:
            return super().run_compiled(fn, args, kwargs)
        with self._watchdog.watch(self._watch_seconds(), self._on_stuck_step):
            try:
                return super().run_compiled(fn, args, kwargs)
            except StepNotFinished:
                self._raise_step_timeout()
            except Exception as e:
                # A collective that failed (at dispatch, or an earlier step waited on in the
                # background): name the lost peer if there is one.
                raise_if_peer_lost(e, "a step", self._timeout)
                raise

    def _raise_step_timeout(self) -> None:
        """The oldest step in flight did not finish in ``timeout_seconds``: a typed error."""
        raise_wait_timeout(self._group, "a step", self._timeout, until_lost=True)

    def _on_slow_step(self, elapsed: float) -> bool:
        """The background wait on a step has run ``elapsed`` s. If the training thread is in its
        own bounded wait it raises the typed error itself; else it may be blocked where no
        exception reaches it (reading that step's output), so act as ``_on_stuck_step``."""
        if isinstance(self._throttle, WatchedSteps) and self._throttle.training_thread_waiting:
            return False
        return self._on_stuck_step(elapsed)

    def _watch_seconds(self) -> float:
        # Past the step's own bounded wait (timeout, then up to heartbeat + 2 s asking the
        # service), so the watchdog only acts when that wait could not run.
        return self._timeout + cluster_state.heartbeat_seconds(self._timeout) + 4.0

    def _on_stuck_step(self, elapsed: float) -> bool:
        """The step has run ``elapsed`` s, blocked where no exception can reach it: if a peer
        is gone, print the typed error and end the process (status 1); else keep waiting."""
        group = self._group
        hb = cluster_state.heartbeat_seconds(self._timeout)
        lost = find_lost_tasks(hb + 2.0, until_lost=True)
        if lost == ():
            log.warning("%s: a step has run for %.0f s and every peer is alive; still waiting",
                        group.name, elapsed)
            return False
        if lost:
            error: Exception = cluster_state.peer_lost_error(cluster_state.mark_lost(lost))
        else:
            peers = tuple(group.task_name(i) for i in range(group.num_processes)
                          if i != group.process_id)
            error = ClusterTimeoutError(
                f"{group.name}: a step did not finish within {elapsed:.0f} s and the "
                f"coordination service did not answer. Waiting on peers {list(peers)}",
                tasks=peers, timeout_seconds=self._timeout)
        cluster_state.mark_broken()
        try:
            sys.stderr.write(
                f"jaxdist: {group.name}: the step is blocked inside XLA's collectives, where no "
                f"exception can be raised; the step watchdog ends the process:\n"
                f"{type(error).__module__}.{type(error).__qualname__}: {error}\n")
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
        cluster_state.exit_broken(f"{type(error).__name__} in a step", group=group)
        return True


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous training across processes and hosts (``MultiWorkerMirroredStrategy``).

    Create it first in the program, before any other JAX call: it calls
    ``jax.distributed.initialize``. Run the same program on every chief and worker task.

    Args:
        cluster_resolver: where the tasks are (default: the resolver of the environment this
            process runs in: ``TF_CONFIG``, else a Slurm job step, else a TPU slice, see
            ``jaxdist._src.cluster.auto_detect``; none of them: ``TFConfigClusterResolver()``,
            as in TF). No cluster means a single process on the local devices.
        communication_options: ``CommunicationOptions`` (packing, timeout, implementation).

    Raises:
        ClusterConfigError: the cluster is invalid (the message quotes the bad part) or this is
            a ``ps`` task.
        ClusterTimeoutError: the other tasks did not join within the timeout.

    Example:
        >>> import jaxdist
        >>> import jax.numpy as jnp
        >>> import numpy as np
        >>> strategy = jaxdist.MultiWorkerMirroredStrategy(   # TF_CONFIG unset: one worker
        ...     communication_options=jaxdist.CommunicationOptions(timeout_seconds=60))
        >>> with strategy.scope():
        ...     params = jnp.zeros(3)
        >>> def train_step(params, x):
        ...     grads = jaxdist.get_replica_context().all_reduce("MEAN", x.mean(axis=0))
        ...     return params - 0.1 * grads, jnp.sum(grads)
        >>> dataset = jaxdist.Dataset.from_tensor_slices(np.ones((64, 3), np.float32)).batch(16)
        >>> dist = strategy.experimental_distribute_dataset(dataset)   # global batches
        >>> for batch in dist:
        ...     params, loss = strategy.run(train_step, args=(params, batch))
    """

    def __init__(self, cluster_resolver: Any = None,
                 communication_options: CommunicationOptions | None = None):
        if cluster_resolver is None:
            cluster_resolver = resolver_from_environment() or TFConfigClusterResolver()
        resolver = cluster_resolver
        options = communication_options or CommunicationOptions()
        if not isinstance(options, CommunicationOptions):
            raise TypeError(
                f"communication_options must be jaxdist.CommunicationOptions, got {options!r}"
            )
        super().__init__(MultiWorkerExtended(self, resolver, options))

    @property
    def cluster_resolver(self) -> Any:
        return self._extended.cluster_resolver

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None):
        """Gives this process its part of ``dataset``, split across its replicas.

        ``dataset`` yields global batches; the ``AutoShardPolicy`` (``AUTO`` unless the dataset
        carries one, see ``jaxdist._src.input.autoshard``) decides which files or rows this process
        reads.
        """
        from jaxdist._src.input.autoshard import auto_shard
        from jaxdist._src.input.distributed import DistributedDataset

        group = self._extended._group
        n, i = (group.num_processes, group.process_id) if group.multi_process else (1, 0)
        local = auto_shard(dataset, n, i)
        return DistributedDataset(self._extended, local, options)

    def __repr__(self) -> str:
        g = self._extended._group
        return (
            f"MultiWorkerMirroredStrategy(task={g.name if g.task_type else 'local'}, "
            f"num_processes={g.num_processes if g.multi_process else 1}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


__all__ = [
    "CollectiveCommunication",
    "CommunicationImplementation",
    "CommunicationOptions",
    "MultiWorkerExtended",
    "MultiWorkerMirroredStrategy",
    "PackedAllReduce",
    "pack_by_bytes",
]
