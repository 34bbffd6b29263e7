"""``ClusterCoordinator``: TF2-style parameter-server training with scheduled functions.

The coordinator (the chief) holds a ``ParameterServerStrategy``; the variables live on the ps
tasks. ``schedule(fn, args)`` queues a function and returns a ``RemoteValue`` at once; one
``WorkerThread`` per worker (``worker_thread.py``) sends queued functions (cloudpickle, over
the mutual-TLS channel, with the coordinator token, see ``jaxdist._src.security.credentials``)
to its worker task (``python -m jaxdist.server`` with a ``worker`` TF_CONFIG), which runs them
against the ps tasks with its own strategy.

Fault tolerance (TF's ``fault_tolerance_test.py``):

* a worker lost in the middle of a function -> the function runs again on another (or the
  restarted) worker: at-least-once (so do the functions of its batch that ended at most
  ``worker_service.GROUP_HOLD_SECONDS`` before it was lost, whose answers it held); a worker
  lost between functions loses nothing: exactly once;
* heartbeats detect dead or hung workers; a worker that answers again rejoins on its own and
  gets its per-worker resources (datasets, iterators) rebuilt;
* the first error raised by a function is raised once by the next ``join``/``schedule``/
  ``done``, which first cancels the functions in flight and queued (their ``fetch()`` raises
  ``CancelledError``; errors of cancelled functions never surface); new schedules then work;
* a ps task that stops answering becomes a ``PSUnavailableError`` naming it, raised by
  ``schedule`` and ``join`` until it answers again.

Example:
    >>> strategy = jaxdist.ParameterServerStrategy(resolver)        # on the chief  # doctest: +SKIP
    >>> with strategy.scope():  # doctest: +SKIP
    ...     params = strategy.create_variables(init_fn, jaxdist.ps.optimizers.adam(1e-3))
    >>> coordinator = ClusterCoordinator(strategy)  # doctest: +SKIP
    >>> it = iter(coordinator.create_per_worker_dataset(dataset_fn))  # doctest: +SKIP
    >>> def step(it):  # doctest: +SKIP
    ...     x, y = next(it)
    ...     loss, grads = strategy.run(grad_fn, args=(params, x, y))
    ...     params.apply_gradients(grads)
    ...     return loss
    >>> losses = [coordinator.schedule(step, args=(it,)) for _ in range(100)]  # doctest: +SKIP
    >>> coordinator.join()  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxdist._src.coordinator import closure_pickle
from jaxdist._src.coordinator.closure_pickle import WorkerResource
from jaxdist._src.coordinator.closure_queue import Closure, ClosureQueue
from jaxdist._src.coordinator.errors import (
    CoordinatorError,
    JoinTimeoutError,
    WorkerUnavailableError,
)
from jaxdist._src.coordinator.health import HealthWatcher, WorkerState
from jaxdist._src.coordinator.remote_value import PerWorkerValues, RemoteValue
from jaxdist._src.coordinator.resources import PerWorkerResources
from jaxdist._src.coordinator.worker_client import WorkerClient
from jaxdist._src.coordinator.worker_runtime import make_dataset, make_iterator, resolve_strategy
from jaxdist._src.coordinator.worker_service import answer_value, to_bytes_array
from jaxdist._src.coordinator.worker_thread import SenderSettings, WorkerThread, remote_exception


def _identity_dataset(dataset: Any) -> Any:
    """The dataset itself (shipped by value to each worker: each gets a whole copy, as TF)."""
    return dataset


def _redistribute(dataset: Any, options: Any) -> Any:
    """A coordinator's distributed dataset rebuilt with this worker's strategy."""
    return resolve_strategy(60.0).experimental_distribute_dataset(dataset, options)


def _redistribute_from_function(dataset: Any, options: Any) -> Any:
    """A coordinator's ``distribute_datasets_from_function`` result, rebuilt on this worker."""
    return resolve_strategy(60.0).distribute_datasets_from_function(lambda _: dataset, options)


def _as_dataset_fn(dataset_or_fn: Any) -> Callable[..., Any]:
    """What ``create_per_worker_dataset`` runs on each worker for ``dataset_or_fn``.

    Raises:
        TypeError: neither a callable nor an iterable dataset.
    """
    from jaxdist._src.input.distributed import (
        DistributedDataset,
        DistributedDatasetsFromFunction,
        source_dataset,
    )

    if isinstance(dataset_or_fn, DistributedDataset):
        return functools.partial(_redistribute, source_dataset(dataset_or_fn),
                                 dataset_or_fn.options)
    if isinstance(dataset_or_fn, DistributedDatasetsFromFunction):
        return functools.partial(_redistribute_from_function, source_dataset(dataset_or_fn),
                                 dataset_or_fn.options)
    if hasattr(dataset_or_fn, "__iter__") and not isinstance(dataset_or_fn, (str, bytes, dict)):
        return functools.partial(_identity_dataset, dataset_or_fn)
    if callable(dataset_or_fn):
        return dataset_or_fn
    raise TypeError(
        f"create_per_worker_dataset expects a dataset (an iterable such as jaxdist.Dataset, or "
        f"a distributed dataset of this strategy) or a callable dataset_fn, got "
        f"{type(dataset_or_fn).__name__}")


class PerWorkerDataset:
    """A dataset built on every worker (``create_per_worker_dataset``).

    Built from a ``dataset_fn`` run on each worker, or from a dataset that each worker gets a
    copy of. ``iter()`` gives a ``PerWorkerIterator``: pass it to scheduled functions; each
    worker receives its own iterator. A restarted worker rebuilds its dataset (from the
    start) and iterators.

    Example:
        >>> per_worker_dataset = coordinator.create_per_worker_dataset(dataset_fn)  # doctest: +SKIP
        >>> per_worker_iterator = iter(per_worker_dataset)  # doctest: +SKIP
        >>> coordinator.schedule(step_fn, args=(per_worker_iterator,))  # doctest: +SKIP
    """

    def __init__(self, coordinator: ClusterCoordinator, dataset_fn: Any):
        self._coordinator = coordinator
        self._dataset_fn = dataset_fn
        self._values = coordinator._create_per_worker_resources(
            make_dataset, (_as_dataset_fn(dataset_fn),), "dataset")

    @property
    def per_worker_values(self) -> PerWorkerValues:
        return self._values

    def build(self) -> PerWorkerValues:
        """The per-worker datasets themselves (TF's ``build()``), to pass to ``schedule``.

        Example:
            >>> datasets = coordinator.create_per_worker_dataset(ds).build()  # doctest: +SKIP
            >>> coordinator.schedule(lambda d: next(iter(d)), args=(datasets,))  # doctest: +SKIP
        """
        return self._values

    def __iter__(self) -> PerWorkerIterator:
        dataset_ref = self._values
        it = PerWorkerIterator(self._coordinator._create_per_worker_resources(
            make_iterator, (dataset_ref,), "iterator"))
        # An iterator nobody holds is not rebuilt on restarted workers (TF frees it).
        rid = it.values[0].resource_id
        weakref.finalize(it, self._coordinator._release_resource, rid)
        return it

    def __repr__(self) -> str:
        return f"PerWorkerDataset({self._dataset_fn!r}, workers={len(self._values)})"


class PerWorkerIterator(PerWorkerValues):
    """One iterator per worker (``iter(per_worker_dataset)``); pass it to ``schedule``.

    Example:
        >>> it = iter(coordinator.create_per_worker_dataset(dataset_fn))  # doctest: +SKIP
        >>> def step_fn(iterator):  # doctest: +SKIP
        ...     x, y = next(iterator)          # the executing worker's own iterator
        ...     return x.sum()
        >>> coordinator.schedule(step_fn, args=(it,))  # doctest: +SKIP
    """

    def __init__(self, values: PerWorkerValues):
        super().__init__(values.values)

    def __iter__(self) -> PerWorkerIterator:
        return self

    def __next__(self) -> Any:
        raise TypeError(
            "a PerWorkerIterator lives on the workers: pass it to coordinator.schedule and "
            "call next() on it inside the scheduled function")


class ClusterCoordinator:
    """Schedules functions onto the worker tasks of a parameter-server cluster.

    Args:
        strategy: a ``ParameterServerStrategy`` on the chief (its cluster must have a
            ``worker`` job, and ``ps`` tasks for the variables).
        heartbeat_interval: seconds between heartbeats.
        heartbeat_timeout: seconds without an answer before a worker is declared down (its
            in-flight function then runs elsewhere).
        ps_timeout: seconds without an answer before a ps task is an error (default: the
            strategy's RPC timeout).
        join_timeout: seconds ``join``/``fetch`` wait without any function finishing before
            ``JoinTimeoutError`` (``None``: wait as long as needed).
        closure_timeout: deadline of one function on a worker.
        rpc_timeout: deadline of the small coordinator -> worker calls.

    As in TF, a strategy has one coordinator: ``ClusterCoordinator(strategy)`` again returns
    the same object (until it is shut down; asking for other settings is an error).

    Example:
        >>> coordinator = jaxdist.coordinator.ClusterCoordinator(strategy)  # doctest: +SKIP
        >>> assert jaxdist.coordinator.ClusterCoordinator(strategy) is coordinator  # doctest: +SKIP
        >>> rv = coordinator.schedule(step_fn, args=(per_worker_iterator,))  # doctest: +SKIP
        >>> coordinator.join()  # doctest: +SKIP
        >>> rv.fetch()  # doctest: +SKIP
    """

    def __new__(cls, strategy: Any, **settings: Any) -> ClusterCoordinator:
        existing = getattr(strategy, "coordinator", None)  # the live one, if any
        if isinstance(existing, cls) and not existing.stopping:
            if settings and settings != existing._settings:
                raise ValueError(
                    f"this strategy already has a ClusterCoordinator with settings "
                    f"{existing._settings}; ClusterCoordinator(strategy) returns it (as in TF), "
                    f"so other settings ({settings}) cannot apply: shut it down first "
                    f"(coordinator.shutdown()) or pass no settings")
            return existing
        return super().__new__(cls)

    def __init__(self, strategy: Any, **settings: Any):
        if getattr(self, "_initialized", False):
            return  # TF: the strategy's coordinator, already running
        self._init(strategy, settings, **settings)
        self._initialized = True

    def _init(self, strategy: Any, settings: dict[str, Any], *,
              heartbeat_interval: float = 1.0, heartbeat_timeout: float = 10.0,
              ps_timeout: float | None = None, join_timeout: float | None = 600.0,
              closure_timeout: float = 3600.0, rpc_timeout: float = 60.0) -> None:
        ext = getattr(strategy, "extended", None)
        info = getattr(ext, "task_info", None)
        if info is None or not hasattr(ext, "ps_client"):
            raise TypeError(
                f"ClusterCoordinator needs a ParameterServerStrategy, got "
                f"{type(strategy).__name__}")
        workers = info.cluster.get("worker", [])
        if not workers:
            raise ValueError(
                f"ClusterCoordinator needs a cluster with a 'worker' job; the strategy's "
                f"cluster has jobs {sorted(info.cluster)} (set TF_CONFIG on the chief)")
        if info.task_type not in ("chief", None):
            raise ValueError(
                f"the coordinator runs on the chief task, this process is {info.name} "
                f"(TF_CONFIG task type must be 'chief'); with python -m jaxdist.launch pass "
                f"--coordinator: it adds the chief that runs the program and runs "
                f"python -m jaxdist.server on the worker and ps tasks")
        self._settings = dict(settings)
        self._strategy = strategy
        self._rpc_timeout = float(rpc_timeout)
        self._closure_timeout = float(closure_timeout)
        self._join_timeout = join_timeout
        self._ps_rpc_timeout = float(getattr(ext, "timeout", 60.0))
        self._queue = ClosureQueue(on_cancel=self._cancel_inflight)
        self._num_replicas: int | None = None
        self._num_replicas_lock = threading.Lock()
        self._ids = itertools.count()
        self._resources = PerWorkerResources()
        self._stopping = threading.Event()
        # The coordinator token (not the ps token) lets it run code on the workers.
        self._client = WorkerClient(workers, tls=getattr(ext.ps_client, "tls", None))
        ps_client = ext.ps_client if info.ps_addresses else None
        self._health = HealthWatcher(
            self._client, ps_client, heartbeat_interval, heartbeat_timeout,
            ps_timeout if ps_timeout is not None else self._ps_rpc_timeout,
            self._queue.set_cluster_error, self._on_restart)
        sender_settings = SenderSettings(
            num_workers=len(self._health.workers), rpc_timeout=self._rpc_timeout,
            closure_timeout=self._closure_timeout, ps_rpc_timeout=self._ps_rpc_timeout,
            join_timeout=self._join_timeout)
        self._workers = [
            WorkerThread(st, self._queue, self._client, self._resources, sender_settings,
                         self._stopping)
            for st in self._health.workers]
        self._health.start()
        for w in self._workers:
            w.start()
        strategy.attach_coordinator(self)

    # -------------------------------------------------------------- properties
    @property
    def strategy(self) -> Any:
        return self._strategy

    @property
    def stopping(self) -> bool:
        """Whether ``shutdown`` has started: the coordinator schedules nothing more, and its
        strategy's ``coordinator`` property no longer returns it.

        Example:
            >>> coordinator = jaxdist.coordinator.ClusterCoordinator(strategy)  # doctest: +SKIP
            >>> coordinator.shutdown()  # doctest: +SKIP
            >>> coordinator.stopping, strategy.coordinator  # doctest: +SKIP
            (True, None)
        """
        return self._stopping.is_set()

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def worker_states(self) -> list[WorkerState]:
        """The health of every worker (``up``, ``incarnation``, ``restarts``, ...)."""
        return list(self._health.workers)

    def functions_run(self) -> list[int]:
        """Functions each worker completed (as seen by this coordinator)."""
        return [w.functions_run for w in self._workers]

    def _cancel_inflight(self) -> None:
        """The queue's ``on_cancel``: an error cancels every function in flight (TF)."""
        for w in self._workers:
            w.cancel()

    @property
    def known_worker_num_replicas(self) -> int | None:
        """``worker_num_replicas()`` if the workers were already asked, else ``None``; never
        contacts a worker (for ``repr`` and logs, when the workers may be down)."""
        return self._num_replicas

    def worker_num_replicas(self) -> int:
        """The replicas of one worker's strategy (``num_replicas_in_sync`` inside ``schedule``).

        Asked once of every worker that answers (TF: the number of GPUs per worker, or 1).

        Raises:
            ValueError: the workers have different numbers of replicas.
            WorkerUnavailableError: no worker answered.

        Example:
            >>> coordinator.worker_num_replicas()  # doctest: +SKIP
            1
        """
        with self._num_replicas_lock:
            if self._num_replicas is not None:
                return self._num_replicas
            counts: dict[str, int] = {}
            errors: list[str] = []
            # Workers still starting (not listening yet) are asked again, round after round,
            # until one answers or rpc_timeout has passed since the first round.
            deadline = time.monotonic() + self._rpc_timeout
            while not counts:
                errors = []
                for w in self._workers:
                    try:
                        counts[w.state.name] = self._probe_replicas(w.index)
                    except WorkerUnavailableError as e:  # down or not up yet: ask the others
                        errors.append(f"{w.state.name}: {e}")
                    except Exception as e:  # noqa: BLE001 - a worker that failed: the others
                        errors.append(f"{w.state.name}: {e}")
                        deadline = 0.0  # an answer that is an error: no point asking again
                if not self._workers or time.monotonic() >= deadline:
                    break
            if not counts:
                raise WorkerUnavailableError(
                    f"no worker answered the replica-count probe: {errors}",
                    task=self._workers[0].state.name if self._workers else None)
            if len(set(counts.values())) > 1:
                raise ValueError(
                    f"Mismatched number of replicas per worker: {counts}; every worker task "
                    f"must have the same number of devices (as TF requires of GPUs)")
            self._num_replicas = next(iter(counts.values()))
            return self._num_replicas

    def _run_direct(self, index: int, fn: Callable[..., Any], args: tuple) -> tuple[dict, dict]:
        """Runs ``fn(*args)`` on worker ``index`` now, outside the queue (small queries)."""
        fn_payload = closure_pickle.dumps(fn, index, self._ps_rpc_timeout)
        args_payload = closure_pickle.dumps((args, {}), index, self._ps_rpc_timeout,
                                            self._join_timeout)
        return self._client.call(
            index, "RunClosure", {"closure_id": -1},
            {"fn": to_bytes_array(fn_payload), "args": to_bytes_array(args_payload)},
            timeout=self._rpc_timeout)

    def _probe_replicas(self, index: int) -> int:
        meta, arrays = self._run_direct(index, _worker_num_replicas, (self._ps_rpc_timeout,))
        if not meta.get("ok"):
            raise remote_exception(meta, arrays, self._client.task_name(index))
        return int(answer_value(arrays, self._client.task_name(index)))

    def _fetch_resource(self, resource: WorkerResource) -> Any:
        """The value of a per-worker resource, copied from its worker (TF fetches the
        per-worker ``RemoteValue``); waits up to ``rpc_timeout`` for the worker to build it."""
        deadline = time.monotonic() + self._rpc_timeout
        while True:
            broken = self._resources.broken(resource.resource_id)
            if broken is not None:
                raise broken
            meta, arrays = self._run_direct(resource.worker_index, _identity_value, (resource,))
            sender = self._client.task_name(resource.worker_index)
            if meta.get("ok"):
                return answer_value(arrays, sender)
            if meta.get("kind") != "missing_resource" or time.monotonic() > deadline:
                raise remote_exception(meta, arrays, sender)
            time.sleep(0.05)  # its worker thread has not built it yet

    # -------------------------------------------------------------- scheduling
    def schedule(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
                 kwargs: dict[str, Any] | None = None) -> RemoteValue:
        """Queues ``fn(*args, **kwargs)`` to run on some worker; returns at once.

        ``PerWorkerValues`` arguments (per-worker iterators) are replaced by the executing
        worker's part (TF); a ``RemoteValue`` argument by its value, waited for on the
        coordinator before the function is sent (TF raises ``ValueError``: not supported);
        the strategy and its variables by the worker's. See docs/coordinator.md.

        Raises:
            Exception: an error of an earlier function (raised once, then cleared), or the
                ``PSUnavailableError`` of a ps task that is down.
            TypeError: ``fn`` is not callable or ``args``/``kwargs`` have the wrong type.

        Example:
            >>> rv = coordinator.schedule(step_fn, args=(it,))  # doctest: +SKIP
        """
        if not callable(fn):
            raise TypeError(f"schedule expects a callable fn, got {type(fn).__name__}")
        if args is not None and not isinstance(args, (tuple, list)):
            raise TypeError(f"schedule expects args as a tuple or list, got "
                            f"{type(args).__name__}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"schedule expects kwargs as a dict, got {type(kwargs).__name__}")
        cid = next(self._ids)
        name = getattr(fn, "__name__", "function")
        rv = RemoteValue(f"{name} #{cid}", default_timeout=self._join_timeout)
        self._queue.put(Closure(cid, fn, tuple(args or ()), dict(kwargs or {}), rv))
        return rv

    def join(self, timeout: float | None = None) -> None:
        """Blocks until every scheduled function has finished.

        Raises:
            Exception: the first error of a function since the last raise (once), after the
                functions in flight ended; ``PSUnavailableError`` naming a ps that is down.
            JoinTimeoutError: no function finished for ``timeout`` seconds (default: the
                coordinator's ``join_timeout``); it names the busy and down workers.
        """
        timeout = self._join_timeout if timeout is None else timeout
        self._queue.wait(timeout, lambda: self._timeout_error(timeout))

    def _timeout_error(self, timeout: float | None) -> JoinTimeoutError:
        down = self._health.down_workers()
        busy = [w.state.name for w in self._workers if w.state.current_call is not None]
        return JoinTimeoutError(
            f"join waited {timeout:.1f} s without any function finishing: {len(self._queue)} "
            f"queued, {self._queue.inflight} in flight (busy: {busy}, down: {down})",
            task=(down or busy or [None])[0])

    def done(self) -> bool:
        """Whether every scheduled function has finished (raises a pending error once)."""
        return self._queue.done()

    def fetch(self, val: Any) -> Any:
        """Blocking: the values of the ``RemoteValue``s (and ``PerWorkerValues``) in ``val``.

        A per-worker value (e.g. from ``per_worker_dataset.build()``) is copied from its
        worker, as TF fetches it; it must be picklable (an iterator is not).

        Example:
            >>> coordinator.fetch([rv1, {"b": rv2}, 3])   # -> [v1, {"b": v2}, 3]  # doctest: +SKIP
        """

        def one(x: Any) -> Any:
            if isinstance(x, RemoteValue):
                return x.fetch()
            if isinstance(x, PerWorkerValues):
                return tuple(one(v) for v in x.values)
            if isinstance(x, WorkerResource):
                return self._fetch_resource(x)
            return x

        return jax.tree.map(one, val, is_leaf=lambda x: isinstance(
            x, (RemoteValue, PerWorkerValues, WorkerResource)))

    # -------------------------------------------------------------- per-worker resources
    def _create_per_worker_resources(self, fn: Callable[..., Any], args: tuple,
                                     kind: str = "resource") -> PerWorkerValues:
        return self._resources.create(fn, args, kind, self.num_workers)

    def _release_resource(self, rid: int) -> None:
        """Forgets a per-worker resource nobody holds: restarted workers do not rebuild it."""
        self._resources.release(rid)

    def _live_resources(self, kind: str | None = None) -> list[int]:
        """Ids of the per-worker resources (of ``kind``) restarted workers would rebuild."""
        return self._resources.live(kind)

    def create_per_worker_dataset(self, dataset_fn: Any) -> PerWorkerDataset:
        """Builds a dataset on every worker, as TF's ``create_per_worker_dataset``.

        Args:
            dataset_fn: a function run on each worker: ``dataset_fn()``, or
                ``dataset_fn(input_context)`` if it takes an argument (``input_pipeline_id``
                = worker index, ``num_input_pipelines`` = workers); or a dataset (e.g.
                ``jaxdist.Dataset``), of which every worker gets a whole copy; or a
                distributed dataset of this strategy, rebuilt with each worker's strategy.

        Raises:
            TypeError: ``dataset_fn`` is neither.

        Example:
            >>> ds = coordinator.create_per_worker_dataset(  # doctest: +SKIP
            ...     lambda ctx: jaxdist.Dataset.from_tensor_slices(x).shard(
            ...         ctx.num_input_pipelines, ctx.input_pipeline_id).batch(32).repeat())
            >>> it = iter(ds)  # doctest: +SKIP
            >>> same = coordinator.create_per_worker_dataset(  # doctest: +SKIP
            ...     jaxdist.Dataset.from_tensor_slices(x))
        """
        return PerWorkerDataset(self, dataset_fn)

    def _on_restart(self, state: WorkerState) -> None:
        self._workers[state.index].resources_lost()

    # -------------------------------------------------------------- exactly-once evaluation
    def evaluate(self, eval_fn: Callable[[Any], Any], dataset_fn: Callable[[int, int], Any],
                 num_shards: int | None = None,
                 reduce_fn: Callable[[list[Any]], Any] | None = None) -> Any:
        """Exactly-once evaluation: every example of every shard counts exactly once.

        The evaluation data is cut into ``num_shards`` shards; one scheduled function per
        shard builds ``dataset_fn(shard_index, num_shards)`` on the worker and returns
        ``eval_fn(iterator_over_that_shard)``. A worker lost mid-shard is discarded whole and
        the shard runs again from its start elsewhere; only the one complete run of each
        shard is kept, so despite failures the results cover every example exactly once.

        Args:
            eval_fn: ``iterator -> partial result`` (e.g. ``(loss_sum, count)``); runs on a
                worker, must not update shared state (its result is what counts).
            dataset_fn: ``(shard_index, num_shards) -> iterable`` of that shard's batches.
            num_shards: shards (default: 4 per worker).
            reduce_fn: combines the list of shard results (default: return the list).

        Returns:
            ``reduce_fn([result of shard 0, shard 1, ...])``.

        Example:
            >>> def eval_fn(it):  # doctest: +SKIP
            ...     return sum(float(jnp.sum(model(x) == y)) for x, y in it), ...
            >>> acc = coordinator.evaluate(eval_fn, lambda i, n: eval_ds.shard(n, i).batch(64),
            ...                            reduce_fn=lambda parts: ...)  # doctest: +SKIP
        """
        n = num_shards or 4 * self.num_workers
        if n < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        rvs = [self.schedule(_eval_shard, args=(eval_fn, dataset_fn, i, n)) for i in range(n)]
        self.join()
        parts = [rv.fetch() for rv in rvs]
        return reduce_fn(parts) if reduce_fn is not None else parts

    # -------------------------------------------------------------- lifecycle
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the worker threads and heartbeats; queued functions are cancelled.

        Functions in flight are abandoned (their workers finish them). No thread of the
        coordinator survives this call. The worker and ps tasks keep running.
        """
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._queue.stop()
        for w in self._workers:
            w.state.cancel_call()
        deadline = time.monotonic() + timeout
        for w in self._workers:
            w.join(deadline)
        self._health.stop(max(0.1, deadline - time.monotonic()))
        self._client.close()
        alive = [w.state.name for w in self._workers if w.is_alive()]
        if alive:
            raise CoordinatorError(f"coordinator threads for {alive} did not stop within "
                                   f"{timeout:.1f} s")

    def __enter__(self) -> ClusterCoordinator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (f"ClusterCoordinator(workers={self.num_workers}, "
                f"down={self._health.down_workers()})")


def get_current_worker_index() -> int:
    """The index of the worker task running this code (TF's
    ``tf.distribute.coordinator.experimental_get_current_worker_index``).

    Call it in a scheduled function or a per-worker ``dataset_fn``.

    Raises:
        RuntimeError: not on a worker task.

    Example:
        >>> import jaxdist
        >>> def dataset_fn():
        ...     i = jaxdist.coordinator.get_current_worker_index()
        ...     return jaxdist.Dataset.from_tensor_slices(x[i::num_workers])
    """
    from jaxdist._src.coordinator import worker_runtime

    try:
        runtime = worker_runtime.current()
    except Exception as e:  # noqa: BLE001 - not a worker task
        raise RuntimeError(
            f"get_current_worker_index() is only valid on a worker task (in a scheduled "
            f"function or a per-worker dataset_fn): {e}") from None
    return runtime.worker_index


def _identity_value(value: Any) -> Any:
    """On a worker: the value itself (sent back to the coordinator)."""
    return value


def _worker_num_replicas(timeout: float) -> int:
    """On a worker: its strategy's ``num_replicas_in_sync``."""
    return int(resolve_strategy(timeout).num_replicas_in_sync)


def _eval_shard(eval_fn: Callable[[Any], Any], dataset_fn: Callable[[int, int], Any],
                shard: int, num_shards: int) -> Any:
    return eval_fn(iter(dataset_fn(shard, num_shards)))


__all__ = ["ClusterCoordinator", "PerWorkerDataset", "PerWorkerIterator",
           "get_current_worker_index"]
