"""``ParameterServerStrategy``: asynchronous between-graph training with parameter servers.

TF1 style (``tf.compat.v1.distribute.experimental.ParameterServerStrategy``): every worker runs
the same program. Variables live on the ps tasks; each step a worker pulls them, computes
gradients with jit synchronously across its own local devices (the ``run`` engine every jaxdist
strategy shares), and pushes them; each ps applies the optax update to its shards. Workers do
not wait for each other (``max_staleness=None``), or stay within ``max_staleness`` steps of the
slowest worker (bounded staleness, SSP).

Without a cluster (no ``ps`` job), the variables live on the host CPU of this process and
compute runs on the local devices, like TF's contrib strategy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jaxdist._src.cluster.task_info import TaskInfo, task_info
from jaxdist._src.cluster.validation import validate_cluster_spec
from jaxdist._src.ps import optimizers as ps_optimizers
from jaxdist._src.ps.checkpoints import latest_step, write_checkpoint_pointer
from jaxdist._src.ps.client import LocalClient, PSClient
from jaxdist._src.ps.embedding import EmbeddingTable
from jaxdist._src.ps.errors import PSInvalidArgumentError, StalenessTimeoutError
from jaxdist._src.ps.partitioners import split_rows
from jaxdist._src.ps.placement import ReplicaDeviceSetter, replica_device_setter
from jaxdist._src.ps.service import ParameterService
from jaxdist._src.ps.variables import Layout, PSVariables, ShardInfo, wait_for_marker
from jaxdist._src.strategies.devices import resolve_devices
from jaxdist._src.strategies.reduce_util import ReduceOp
from jaxdist._src.strategies.strategy import Strategy, StrategyExtended
from jaxdist._src.values.per_replica import PerReplica, is_per_replica

log = logging.getLogger(__name__)


def _is_ps_leaf(x: Any) -> bool:
    return isinstance(x, (PSVariables, PerReplica))


class ParameterServerStrategyExtended(StrategyExtended):
    """Internals of ``ParameterServerStrategy``: the ps client, placement, clocks, checkpoints.

    Args:
        strategy: the owning strategy.
        info: this task's place in the cluster.
        compute_devices: this worker's devices (replicas of ``run``).
        variable_partitioner: splits leaves on axis 0 (``None``: whole leaves).
        ps_strategy: placement of shards on ps tasks (default round-robin).
        max_staleness: SSP bound in steps (``None``: fully asynchronous).
        timeout: seconds any RPC or wait may take before a typed error.
    """

    plain_run = False  # its run_compiled does more per call

    def __init__(self, strategy: Strategy, info: TaskInfo, compute_devices: Sequence[Any],
                 variable_partitioner: Any, ps_strategy: Any, max_staleness: int | None,
                 timeout: float):
        super().__init__(strategy, compute_devices)
        self._info = info
        self._timeout = float(timeout)
        if info.ps_addresses:
            self._client: Any = PSClient(info.ps_addresses, info.token, timeout=self._timeout)
            self._local = False
        else:
            self._client = LocalClient([ParameterService("local")])
            self._local = True
        self._partitioner = variable_partitioner
        self._setter: ReplicaDeviceSetter = replica_device_setter(
            ps_tasks=self._client.num_tasks, ps_strategy=ps_strategy
        )
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
        self._max_staleness = max_staleness
        self._step = 0
        self.last_clock_gap = 0
        self._collections: dict[str, Any] = {}

    # ------------------------------------------------------------------ cluster facts
    @property
    def ps_client(self) -> Any:
        """The client of the ps tasks (``PSClient``, or ``LocalClient`` without a cluster)."""
        return self._client

    @property
    def task_info(self) -> TaskInfo:
        return self._info

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        if self._local:
            return ("/job:localhost/replica:0/task:0/device:CPU:0",)
        return tuple(f"/job:ps/task:{i}" for i in range(self._client.num_tasks))

    @property
    def experimental_between_graph(self) -> bool:
        return True

    @property
    def experimental_should_init(self) -> bool:
        """Whether this task creates (initialises) the variables: the chief."""
        return self._info.is_chief

    @property
    def should_checkpoint(self) -> bool:
        return self._info.is_chief

    @property
    def should_save_summary(self) -> bool:
        return self._info.is_chief

    @property
    def worker_index(self) -> int:
        return self._info.worker_index

    @property
    def cluster_coordinator(self) -> Any:
        """The live ``ClusterCoordinator`` created on this strategy, or ``None`` (the
        strategy's ``coordinator``)."""
        return getattr(self._container_strategy, "coordinator", None)

    @property
    def timeout(self) -> float:
        """Seconds any RPC or wait on another task may take before a typed error."""
        return self._timeout

    # ------------------------------------------------------------------ variables
    def _colocate_task(self) -> int | None:
        if not self._colocation:
            return None
        target = self._colocation[-1]
        if isinstance(target, PSVariables):
            return target.layout.leaves[0].shards[0].task
        if isinstance(target, EmbeddingTable):
            return target.shards[0].task
        raise TypeError(
            f"colocate_vars_with expects PSVariables or an EmbeddingTable, got "
            f"{type(target).__name__}"
        )

    def _reserve(self, name: str, what: Any) -> None:
        if name in self._collections:
            raise ValueError(f"variables named {name!r} already exist in this strategy; "
                             f"pass another name=")
        self._collections[name] = what

    def create_variables(self, init: Any, optimizer: Any = None,
                         name: str = "variables") -> PSVariables:
        """Creates a pytree of variables on the ps tasks (chief) or waits for them (others).

        Args:
            init: the initial pytree, or a function returning it (non-chief workers only
                evaluate its shapes with ``jax.eval_shape``).
            optimizer: a ``jaxdist.ps.optimizers`` spec applied by the ps to every shard
                (``None``: pushes are added to the variables).
            name: the collection name; every worker must use the same names in the same
                order.

        Raises:
            ValueError: the optimizer cannot be split across ps tasks.
            VariablesNotReadyError: (non-chief) the chief did not create them in time.
        """
        spec = ps_optimizers.as_spec(optimizer)
        worker_part, ps_part = spec.split() if spec is not None else (None, None)
        chief = self._info.is_chief
        if callable(init):
            abstract = jax.eval_shape(init) if not chief else None
            values = init() if chief else None
        else:
            values = init
            abstract = None
        tree = values if values is not None else abstract
        layout = Layout(name, tree, self._setter, self._partitioner, self._colocate_task())
        self._reserve(name, layout)
        marker = f"ready/{name}"
        if chief:
            parts = layout.split(values, "initial value")
            specs = {
                k: {"optimizer": ps_part.to_json() if ps_part else None, "kind": "dense"}
                for by_key in parts.values() for k in by_key
            }
            self._client.call_many([
                (t, "Create", {"specs": {k: specs[k] for k in parts[t]}}, parts[t])
                for t in sorted(parts)
            ])
            self._client.call(0, "SetMarker", {"name": marker})
        else:
            wait_for_marker(self._client, marker, self._timeout, "the chief")
            self._verify(layout)
        reduce_fn = self.sum_replicas
        return PSVariables(self._client, layout, worker_part, self.worker_index, reduce_fn)

    def _verify(self, layout: Layout) -> None:
        by_task = layout.keys_by_task()
        statuses = self._client.call_many([(t, "Status", {}, {}) for t in sorted(by_task)])
        want = {s.key: (leaf, s) for leaf in layout.leaves for s in leaf.shards}
        for t, (meta, _) in zip(sorted(by_task), statuses):
            have = meta["variables"]
            for key in by_task[t]:
                leaf, s = want[key]
                shape = [s.stop - s.start, *leaf.shape[1:]] if leaf.shape else []
                if key not in have or have[key]["shape"] != shape:
                    raise PSInvalidArgumentError(
                        f"{self._client.task_name(t)} holds {key!r} as "
                        f"{have.get(key, {}).get('shape')}, this worker expects {shape}: every "
                        f"worker must build the same variables with the same partitioner",
                        task=self._client.task_name(t),
                    )

    def create_embedding(self, name: str, vocab_size: int, dim: int, optimizer: Any = None,
                         initializer: Any = None, dtype: Any = np.float32,
                         num_shards: int | None = None, seed: int = 0) -> EmbeddingTable:
        """Creates a row-sharded embedding table on the ps tasks (chief) or waits for it.

        Args:
            name: the table's name (same on every worker).
            vocab_size: rows.
            dim: columns.
            optimizer: a row-wise ``jaxdist.ps.optimizers`` spec (sgd, adagrad, adam, ...).
            initializer: a ``(vocab_size, dim)`` array, a function ``(shape, dtype) -> array``,
                or ``None`` (normal with std ``1/sqrt(dim)``, seeded by ``seed``).
            dtype: the table's dtype.
            num_shards: row shards (default: one per ps task, fewer if fewer rows).
            seed: seed of the default initializer.

        Example:
            >>> import jaxdist.ps
            >>> strategy = jaxdist.ParameterServerStrategy()   # no TF_CONFIG: trains locally
            >>> strategy.extended.create_embedding(
            ...     "words", 100_000, 64, optimizer=jaxdist.ps.optimizers.adagrad(0.1))
            EmbeddingTable('words', vocab_size=100000, dim=64, shards=1)
        """
        spec = ps_optimizers.as_spec(optimizer)
        if spec is not None and spec.worker_part() is not None:
            raise ValueError(
                f"embedding {name!r}: {spec.worker_part().name!r} needs the whole gradient and "
                f"cannot run on sparse row updates; use an elementwise optimizer"
            )
        if vocab_size < 1 or dim < 1:
            raise ValueError(f"embedding {name!r}: vocab_size and dim must be >= 1, "
                             f"got {vocab_size}, {dim}")
        n = num_shards or self._client.num_tasks
        n = max(1, min(n, vocab_size))
        colocate = self._colocate_task()
        shards = []
        for i, (start, stop) in enumerate(split_rows(vocab_size, n)):
            key = f"{name}/part_{i}" if n > 1 else name
            task = colocate if colocate is not None else i % self._client.num_tasks
            shards.append(ShardInfo(key, task, start, stop))
        self._reserve(name, shards)
        marker = f"ready/{name}"
        if self._info.is_chief:
            shape = (vocab_size, dim)
            if initializer is None:
                rng = np.random.default_rng(seed)
                table = (rng.standard_normal(shape) / np.sqrt(dim)).astype(dtype)
            elif callable(initializer):
                table = np.asarray(initializer(shape, dtype))
            else:
                table = np.asarray(initializer)
            if table.shape != shape:
                raise ValueError(f"embedding {name!r}: initializer gave shape {table.shape}, "
                                 f"expected {shape}")
            table = table.astype(dtype)
            by_task: dict[int, tuple[dict, dict]] = {}
            for s in shards:
                meta, arrays = by_task.setdefault(s.task, ({"specs": {}}, {}))
                meta["specs"][s.key] = {"optimizer": spec.to_json() if spec else None,
                                        "kind": "rows"}
                arrays[s.key] = table[s.start:s.stop]
            self._client.call_many([(t, "Create", m, a) for t, (m, a) in sorted(by_task.items())])
            self._client.call(0, "SetMarker", {"name": marker})
        else:
            wait_for_marker(self._client, marker, self._timeout, "the chief")
        return EmbeddingTable(self._client, name, vocab_size, dim, dtype, shards,
                              self.worker_index)

    # ------------------------------------------------------------------ steps
    def sum_replicas(self, grads: Any) -> Any:
        leaves = jax.tree.leaves(grads, is_leaf=is_per_replica)
        if not any(isinstance(x, PerReplica) for x in leaves):
            return grads
        return self._container_strategy.reduce(ReduceOp.SUM, grads, axis=None)

    def begin_step(self) -> None:
        """Counts a step of this worker; first, under SSP (``max_staleness`` set, on a cluster),
        waits until it is at most ``max_staleness`` steps ahead of the slowest worker.

        ``run`` calls it for a step whose arguments hold ``PSVariables``; the Keras
        parameter-server fit calls it for each of its steps."""
        if self._max_staleness is not None and not self._local:
            self._wait_turn()
        self._step += 1

    def _wait_turn(self) -> None:
        """SSP: blocks until this worker is at most ``max_staleness`` steps ahead."""
        deadline = time.monotonic() + self._timeout
        while True:
            left = deadline - time.monotonic()
            meta, _ = self._client.call(0, "Clock", {
                "worker": self.worker_index,
                "clock": self._step,
                "num_workers": max(1, self._info.num_workers),
                "max_staleness": self._max_staleness,
                "wait_s": max(0.01, min(left, 2.0)),
            }, timeout=max(1.0, min(left, 2.0) + 5.0))
            if meta["ok"]:
                self.last_clock_gap = self._step - int(meta["slowest"][0])
                return
            if time.monotonic() >= deadline:
                low, who = meta["slowest"]
                raise StalenessTimeoutError(
                    f"worker {self.worker_index} at step {self._step} waited "
                    f"{self._timeout:.1f} s for worker {who} (at step {int(low)}) to come within "
                    f"max_staleness={self._max_staleness} steps",
                    task=f"worker:{who}",
                )

    def run_compiled(self, fn: Callable, args=(), kwargs=None) -> Any:
        container = self._container_strategy
        if getattr(container, "_coordinator", None) is not None and not getattr(
                container, "_allow_run_without_coordinator", False):
            # This is the coordinator (workers' strategies have no coordinator): TF's warning.
            log.warning(
                "A `ParameterServerStrategy` method is invoked without using "
                "`ClusterCoordinator.schedule`. This method is executed on the coordinator, "
                "which can be slow. To properly dispatch functions to run on workers, methods "
                "like `run` or `reduce` should be used within a function passed to "
                "`jaxdist.coordinator.ClusterCoordinator.schedule`.")
        if not isinstance(args, (list, tuple)):
            return super().run_compiled(fn, args, kwargs)  # raises the usual error
        tree = (tuple(args), dict(kwargs or {}))
        leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_ps_leaf)
        if any(isinstance(x, PSVariables) for x in leaves):
            self.begin_step()
            leaves = [x.pull() if isinstance(x, PSVariables) else x for x in leaves]
            args, kwargs = treedef.unflatten(leaves)
        return super().run_compiled(fn, args, kwargs)

    def worker_done(self) -> None:
        """Tells the cluster this worker has finished (SSP stops waiting for it)."""
        if self._max_staleness is not None and not self._local:
            self._client.call(0, "Clock", {"worker": self.worker_index, "clock": None,
                                           "num_workers": max(1, self._info.num_workers),
                                           "max_staleness": None, "wait_s": 0.0})

    # ------------------------------------------------------------------ checkpoints / stats
    def save(self, directory: str, step: int, keep: int | None = None) -> list[str]:
        """Asks every ps to save its shards, optimizer state and versions (atomically each),
        then marks ``step`` complete. Returns the per-ps checkpoint paths.

        Args:
            keep: each ps then deletes its checkpoints beyond the newest ``keep`` (never the
                last complete one); ``None`` keeps all.

        Example:
            >>> import jaxdist
            >>> import jax.numpy as jnp
            >>> strategy = jaxdist.ParameterServerStrategy()   # no TF_CONFIG: trains locally
            >>> with strategy.scope():
            ...     params = strategy.create_variables(lambda: {"w": jnp.zeros(3)})
            >>> if strategy.extended.should_checkpoint:
            ...     strategy.extended.save("ckpt", 100)
            ['.../ckpt/local/ckpt-100']
        """
        # A relative directory is this process's (where the pointer goes), not each ps's.
        directory = os.path.abspath(directory)
        results = self._client.call_many([
            (t, "Save", {"directory": directory, "step": int(step), "keep": keep}, {})
            for t in range(self._client.num_tasks)
        ])
        write_checkpoint_pointer(directory, step)
        return [m["path"] for m, _ in results]

    def restore(self, directory: str, step: int | None = None) -> list[int]:
        """Asks every ps to replace its state with checkpoint ``step`` (default: latest)."""
        directory = os.path.abspath(directory)  # as save: relative to this process
        results = self._client.call_many([
            (t, "Restore", {"directory": directory, "step": step}, {})
            for t in range(self._client.num_tasks)
        ])
        return [m["step"] for m, _ in results]

    def ps_status(self) -> list[dict[str, Any]]:
        """Every ps task's status: variables with versions and staleness stats, markers."""
        return [m for m, _ in self._client.call_many(
            [(t, "Status", {}, {}) for t in range(self._client.num_tasks)])]

    def latest_checkpoint_step(self, directory: str, task: str = "ps:0") -> int | None:
        """The step ``restore`` would load from ``directory`` for ``task`` (the chief's
        complete-checkpoint pointer, else that task's latest), or ``None``.

        Example:
            >>> import jaxdist
            >>> import jax.numpy as jnp
            >>> strategy = jaxdist.ParameterServerStrategy()   # no TF_CONFIG: trains locally
            >>> with strategy.scope():
            ...     params = strategy.create_variables(lambda: {"w": jnp.zeros(3)})
            >>> strategy.extended.save("ckpt", 200)
            ['.../ckpt/local/ckpt-200']
            >>> strategy.extended.latest_checkpoint_step("ckpt")
            200
        """
        return latest_step(directory, "local" if self._local and task == "ps:0" else task)

    def mark_checkpoint_final(self, directory: str, step: int) -> None:
        """Marks checkpoint ``step`` as the last of a finished run (a side-car evaluator
        stops after evaluating it)."""
        write_checkpoint_pointer(directory, step, final=True)

    def mark_done(self, worker_index: int | None = None) -> None:
        """Records on ps 0 that worker ``worker_index`` (default: this one) has finished
        training in this run of the ps tasks (``wait_for_workers`` reads it)."""
        index = self.worker_index if worker_index is None else int(worker_index)
        client = self._client
        meta, _ = client.call(0, "Status", {})
        client.call(0, "SetMarker", {"name": f"done/{meta['incarnation']}/worker:{index}"})

    def wait_for_workers(self, num_workers: int, timeout: float | None = None,
                         poll_s: float = 0.2) -> list[int]:
        """Waits until workers ``0 .. num_workers-1`` have called ``mark_done``, as long as
        the variables keep changing: ``timeout`` seconds (default: the strategy's) without a
        push and without the last worker finishing ends the wait.

        Returns:
            The workers that did not finish (empty when all did).

        Example:
            >>> missing = strategy.extended.wait_for_workers(2)   # doctest: +SKIP
        """
        timeout = self._timeout if timeout is None else float(timeout)
        client = self._client
        deadline, last_versions = time.monotonic() + timeout, None
        while True:
            meta, _ = client.call(0, "Status", {})
            prefix = f"done/{meta['incarnation']}/worker:"
            want = {f"{prefix}{w}" for w in range(num_workers)}
            if want <= set(meta["markers"]):
                return []
            versions = sum(v["version"] for v in meta["variables"].values())
            if versions != last_versions:   # others still push: keep waiting
                deadline, last_versions = time.monotonic() + timeout, versions
            if time.monotonic() > deadline:
                return sorted(int(m.rsplit(":", 1)[1]) for m in want - set(meta["markers"]))
            time.sleep(poll_s)


class _InputFnIterator:
    """What ``make_input_fn_iterator`` returns: TF's ``InputIterator`` (get_next, initialize)."""

    def __init__(self, strategy: Strategy, input_fn: Callable, ctx: Any):
        self._strategy, self._input_fn, self._ctx = strategy, input_fn, ctx
        self._it = None

    def initialize(self) -> list:
        dataset = self._input_fn(self._ctx)
        self._it = iter(self._strategy.experimental_distribute_dataset(dataset))
        return []

    def get_next(self) -> Any:
        if self._it is None:
            self.initialize()
        return next(self._it)

    def __iter__(self):
        return self

    def __next__(self):
        return self.get_next()


class ParameterServerStrategy(Strategy):
    """Asynchronous training with variables on parameter servers.

    ``tf.compat.v1.distribute.experimental.ParameterServerStrategy`` (between-graph): every
    worker runs this program. The chief creates the variables on the ps tasks; every worker
    pulls them each step, computes gradients on its local devices, and pushes them; the ps
    applies the optimizer. With no ``ps`` job in the cluster, variables live on the host CPU.

    Args:
        cluster_resolver: a jaxdist cluster resolver (or anything with ``cluster_spec()``,
            ``task_type``, ``task_id``, ``cluster_token``); ``None`` reads ``TF_CONFIG``, and
            without it trains locally.
        variable_partitioner: ``FixedShardsPartitioner`` / ``MinSizePartitioner`` /
            ``MaxSizePartitioner`` (splits leaves on axis 0), or ``None``.
        ps_strategy: shard placement, e.g. ``GreedyLoadBalancingStrategy(num_ps,
            byte_size_load_fn)``; default round-robin.
        max_staleness: bounded staleness in steps (SSP); ``None``: fully asynchronous.
        timeout: seconds before an RPC or a wait fails with a typed error naming the task.
        compute_devices: this worker's devices (default: all local devices).

    Example:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import numpy as np
        >>> import jaxdist.ps
        >>> resolver = jaxdist.cluster_resolver.TFConfigClusterResolver()  # no TF_CONFIG: local
        >>> strategy = jaxdist.ParameterServerStrategy(resolver)
        >>> init_fn = lambda: {"w": jnp.zeros(3)}
        >>> with strategy.scope():
        ...     params = strategy.create_variables(init_fn, jaxdist.ps.optimizers.adam(1e-2))
        >>> ds = jaxdist.Dataset.from_tensor_slices(np.ones((32, 3), np.float32)).batch(8)
        >>> grad_fn = lambda p, x: jax.value_and_grad(lambda p: jnp.sum(p["w"] * x))(p)
        >>> for batch in strategy.experimental_distribute_dataset(ds):
        ...     loss, grads = strategy.run(grad_fn, args=(params, batch))
        ...     _ = params.apply_gradients(grads)

    On the chief, ``jaxdist.coordinator.ClusterCoordinator(strategy)`` attaches itself to the
    strategy (``attach_coordinator``); ``strategy.coordinator`` is then that coordinator, until
    it is shut down, and ``None`` before and after (TF keeps the link private, as
    ``strategy._cluster_coordinator``):

        >>> strategy.coordinator is None   # no ClusterCoordinator on this strategy
        True
    """

    def __init__(self, cluster_resolver: Any = None, variable_partitioner: Any = None, *,
                 ps_strategy: Any = None, max_staleness: int | None = None,
                 timeout: float = 60.0, compute_devices: Sequence[Any] | None = None):
        info = task_info(cluster_resolver)
        if info.cluster:  # TF's multi-worker rules (multi_worker_util), as TF's strategy checks
            spec = (cluster_resolver.cluster_spec()
                    if callable(getattr(cluster_resolver, "cluster_spec", None)) else info.cluster)
            validate_cluster_spec(spec, info.task_type,
                                  info.task_id if info.task_type else None,
                                  source=getattr(cluster_resolver, "config_source", "cluster"))
        if info.ps_addresses and info.task_type == "ps":
            raise ValueError(
                "this process is a ps task (TF_CONFIG task type 'ps'): run jaxdist.Server "
                "(python -m jaxdist.server) there, not ParameterServerStrategy"
            )
        self._cluster_resolver = cluster_resolver
        # TF's flag: a deliberate run on the coordinator (Keras' inline evaluation) sets it,
        # through running_without_coordinator(), to skip the "invoked without
        # ClusterCoordinator.schedule" warning.
        self._allow_run_without_coordinator = False
        self._coordinator: Any = None  # the ClusterCoordinator attached on the chief
        devices = resolve_devices(compute_devices, default=jax.local_devices())
        super().__init__(ParameterServerStrategyExtended(
            self, info, devices, variable_partitioner, ps_strategy, max_staleness, timeout
        ))

    @property
    def cluster_resolver(self) -> Any:
        return self._cluster_resolver

    @property
    def coordinator(self) -> Any:
        """The live ``ClusterCoordinator`` created on this strategy, or ``None`` (none was
        created, or it was shut down). Read-only: ``ClusterCoordinator(strategy)`` sets it
        through ``attach_coordinator``.

        Example:
            >>> import jaxdist
            >>> strategy = jaxdist.ParameterServerStrategy()   # no TF_CONFIG: local
            >>> strategy.coordinator is None
            True
        """
        coordinator = self._coordinator
        if coordinator is None or coordinator.stopping:
            return None
        return coordinator

    def attach_coordinator(self, coordinator: Any) -> None:
        """Links ``coordinator`` to this strategy: ``ClusterCoordinator(strategy)`` calls it.

        From then on ``strategy.run`` on the chief outside ``coordinator.schedule`` logs TF's
        "invoked without using ``ClusterCoordinator.schedule``" warning, and
        ``num_replicas_in_sync`` is the workers' replica count, while ``coordinator`` is live
        (it has a ``stopping`` property, ``worker_num_replicas()`` and ``join()``).

        Example:
            >>> coordinator = jaxdist.coordinator.ClusterCoordinator(strategy)  # doctest: +SKIP
            >>> strategy.coordinator is coordinator   # doctest: +SKIP
            True
        """
        self._coordinator = coordinator

    @contextlib.contextmanager
    def running_without_coordinator(self) -> Iterator[None]:
        """Within it, ``run`` on the chief outside ``ClusterCoordinator.schedule`` is deliberate
        (Keras' inline evaluation, the Trainer's ``evaluate`` and ``predict`` on the chief) and
        logs no warning: TF's ``_allow_run_without_coordinator`` flag, as a context manager.
        Nests; the previous permission comes back on exit.

        Example:
            >>> import jax, jax.numpy as jnp
            >>> import jaxdist
            >>> strategy = jaxdist.ParameterServerStrategy(compute_devices=jax.devices()[:1])
            >>> with strategy.running_without_coordinator():
            ...     out = strategy.run(lambda x: x + 1, args=(jnp.ones(2),))
        """
        before = self._allow_run_without_coordinator
        self._allow_run_without_coordinator = True
        try:
            yield
        finally:
            self._allow_run_without_coordinator = before

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas of one worker's step (TF: GPUs per worker, or 1).

        On the chief with a ``ClusterCoordinator`` the steps run on the worker tasks, so this
        is the workers' replica count (asked of them once), not this process's devices: a
        global batch computed from it on the coordinator matches what ``strategy.run`` sees
        inside a scheduled function, as in TF.

        Example:
            >>> coordinator = jaxdist.coordinator.ClusterCoordinator(strategy)  # doctest: +SKIP
            >>> strategy.num_replicas_in_sync   # doctest: +SKIP
            1
        """
        coordinator = self.coordinator
        if coordinator is not None:
            return coordinator.worker_num_replicas()
        return super().num_replicas_in_sync

    def create_variables(self, init: Any, optimizer: Any = None,
                         name: str = "variables") -> PSVariables:
        """See ``ParameterServerStrategyExtended.create_variables``."""
        return self._extended.create_variables(init, optimizer, name)

    def create_embedding(self, name: str, vocab_size: int, dim: int, **kwargs: Any):
        """See ``ParameterServerStrategyExtended.create_embedding``."""
        return self._extended.create_embedding(name, vocab_size, dim, **kwargs)

    def make_input_fn_iterator(self, input_fn: Callable, replication_mode: Any = None):
        """Calls ``input_fn(InputContext)`` for this worker; returns an iterator of batches.

        ``InputContext`` has ``num_input_pipelines`` = number of workers and
        ``input_pipeline_id`` = this worker's index (shard your data with them).
        """
        del replication_mode
        from jaxdist._src.input.options import InputContext

        info = self._extended.task_info
        ctx = InputContext(
            num_input_pipelines=max(1, info.num_workers),
            input_pipeline_id=info.worker_index if info.num_workers else 0,
            num_replicas_in_sync=self.num_replicas_in_sync,
        )
        return _InputFnIterator(self, input_fn, ctx)

    def __repr__(self) -> str:
        ext = self._extended
        coordinator = self._coordinator
        # Never probe the workers from repr (they may be down): use what is known.
        known = getattr(coordinator, "known_worker_num_replicas", None) or ext.num_replicas_in_mesh
        return (f"ParameterServerStrategy(task={ext.task_info.name}, "
                f"ps_tasks={ext.ps_client.num_tasks}, num_replicas_in_sync={known})")


__all__ = ["ParameterServerStrategy", "ParameterServerStrategyExtended"]


