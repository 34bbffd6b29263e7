"""``ClusterCoordinator``: TF2-style parameter-server training with scheduled functions.

The coordinator (the chief) holds a ``ParameterServerStrategy``; the variables live on the ps
tasks. ``schedule(fn, args)`` queues a function and returns a ``RemoteValue`` at once; one
thread per worker sends queued functions (cloudpickle, over the mutual-TLS channel, with the
coordinator token, see ``jaxdist.cluster.credentials``) to its
worker task (``python -m jaxdist.server`` with a ``worker`` TF_CONFIG), which runs them
against the ps tasks with its own strategy.

Fault tolerance (TF's ``fault_tolerance_test.py``):

* a worker lost in the middle of a function -> the function runs again on another (or the
  restarted) worker: at-least-once; a worker lost between functions loses nothing: exactly
  once;
* heartbeats detect dead or hung workers; a worker that answers again rejoins on its own and
  gets its per-worker resources (datasets, iterators) rebuilt;
* the first error raised by a function cancels the queued functions; ``join``/``schedule``
  raise it once, after which new schedules work;
* a ps task that stops answering becomes a ``PSUnavailableError`` naming it, raised by
  ``schedule`` and ``join`` until it answers again.

Example:
    >>> strategy = jaxdist.ParameterServerStrategy(resolver)        # on the chief
    >>> with strategy.scope():
    ...     params = strategy.create_variables(init_fn, jaxdist.ps.optimizers.adam(1e-3))
    >>> coordinator = ClusterCoordinator(strategy)
    >>> it = iter(coordinator.create_per_worker_dataset(dataset_fn))
    >>> def step(it):
    ...     x, y = next(it)
    ...     loss, grads = strategy.run(grad_fn, args=(params, x, y))
    ...     params.apply_gradients(grads)
    ...     return loss
    >>> losses = [coordinator.schedule(step, args=(it,)) for _ in range(100)]
    >>> coordinator.join()
"""

from __future__ import annotations

import itertools
import logging
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxdist.ps import closure_pickle
from jaxdist.ps.closure_pickle import WorkerResource
from jaxdist.ps.closure_queue import Closure, ClosureQueue
from jaxdist.ps.coordinator_errors import (
    CoordinatorError,
    JoinTimeoutError,
    RemoteError,
)
from jaxdist.ps.health import HealthWatcher, WorkerState
from jaxdist.ps.remote_value import PerWorkerValues, RemoteValue
from jaxdist.ps.worker_client import WorkerClient
from jaxdist.ps.worker_runtime import make_dataset, make_iterator
from jaxdist.ps.worker_service import from_bytes_array, to_bytes_array

log = logging.getLogger(__name__)

_MAX_RESOURCE_RETRIES = 20


class _WorkerThread:
    """Sends queued closures to one worker task, one at a time (TF's ``Worker``)."""

    def __init__(self, coordinator: ClusterCoordinator, state: WorkerState):
        self._c = coordinator
        self.state = state
        self.index = state.index
        self._created: set[int] = set()
        self._created_for: str | None = None
        self.functions_run = 0
        self.thread = threading.Thread(target=self._loop, daemon=True,
                                       name=f"jaxdist-coordinator-{state.name}")

    # -------------------------------------------------------------- resources
    def resources_lost(self) -> None:
        self._created.clear()
        self._created_for = None

    def _ensure_resources(self) -> bool:
        """Builds the per-worker resources this worker lacks; False if it went down."""
        c = self._c
        if self._created_for != self.state.incarnation:
            self._created.clear()
            self._created_for = self.state.incarnation
        for rid, fn, args in c._resource_specs():
            if rid in self._created:
                continue
            try:
                payload = closure_pickle.dumps((fn, args), self.index, c._ps_rpc_timeout)
                meta, arrays = c._client.call(self.index, "CreateResource",
                                              {"resource_id": rid},
                                              {"fn": to_bytes_array(payload)},
                                              timeout=c._rpc_timeout,
                                              on_start=self.state.set_call)
            except CoordinatorError as e:
                self.state.mark_down(e)
                return False
            except Exception as e:  # noqa: BLE001 - the resource function cannot be sent
                c._queue.report_error(e)
                c._broken_resource(rid, e)
                continue
            finally:
                self.state.set_call(None)
            if not meta.get("ok"):
                if meta.get("kind") == "missing_resource":
                    self.resources_lost()
                    return False
                c._queue.report_error(_remote_exception(meta, arrays))
                c._broken_resource(rid, _remote_exception(meta, arrays))
                continue
            if meta.get("incarnation") != self._created_for:
                # The worker restarted under us: start again with its new incarnation.
                self.state.incarnation = meta.get("incarnation")
                self.resources_lost()
                return False
            self._created.add(rid)
        return True

    # -------------------------------------------------------------- main loop
    def _loop(self) -> None:
        c, st = self._c, self.state
        while not c._stopping.is_set():
            if not st.up.wait(0.1):
                continue
            if not self._ensure_resources():
                time.sleep(0.05)
                continue
            closure = c._queue.get(timeout=0.1)
            if closure is None:
                continue
            self._process(closure)

    def _process(self, closure: Closure) -> None:
        c, st = self._c, self.state
        closure.attempts += 1
        try:
            fn_payload = closure_pickle.dumps(closure.fn, self.index, c._ps_rpc_timeout)
            args_payload = closure_pickle.dumps((closure.args, closure.kwargs), self.index,
                                                c._ps_rpc_timeout, c._join_timeout)
        except Exception as e:  # noqa: BLE001 - unpicklable function or a failed input
            closure.remote_value._set_error(e)
            c._queue.mark_failed(e)
            return
        try:
            meta, arrays = c._client.call(
                self.index, "RunClosure", {"closure_id": closure.closure_id},
                {"fn": to_bytes_array(fn_payload), "args": to_bytes_array(args_payload)},
                timeout=c._closure_timeout, on_start=st.set_call)
        except CoordinatorError as e:
            # The worker died, hung (heartbeats cancelled the call) or is unreachable: run the
            # function again elsewhere (at-least-once).
            st.set_call(None)
            if c._stopping.is_set():  # shutdown cancelled the call
                c._queue.put_back(closure)
                return
            st.mark_down(e)
            log.warning("function #%d lost on %s (%s); scheduling it again",
                        closure.closure_id, st.name, e)
            c._queue.put_back(closure)
            return
        st.set_call(None)
        if meta.get("ok"):
            try:
                value = pickle.loads(from_bytes_array(arrays["value"]))
            except Exception as e:  # noqa: BLE001
                closure.remote_value._set_error(e, st.name)
                c._queue.mark_failed(e)
                return
            self.functions_run += 1
            closure.remote_value._set_value(value, st.name)
            c._queue.mark_finished()
            return
        if meta.get("kind") == "missing_resource" and closure.attempts < _MAX_RESOURCE_RETRIES:
            self.resources_lost()
            c._queue.put_back(closure)
            return
        error = _remote_exception(meta, arrays)
        closure.remote_value._set_error(error, st.name)
        c._queue.mark_failed(error)


def _remote_exception(meta: dict, arrays: dict) -> BaseException:
    """The exception a worker sent back, with its traceback attached as a note."""
    task = meta.get("task")
    error: BaseException | None = None
    if "error" in arrays:
        try:
            error = pickle.loads(from_bytes_array(arrays["error"]))
        except Exception:  # noqa: BLE001 - fall back to RemoteError
            error = None
    if not isinstance(error, BaseException):
        error = RemoteError(f"{task}: {meta.get('type')}: {meta.get('message')}", task=task,
                            remote_type=str(meta.get("type")),
                            remote_traceback=str(meta.get("traceback", "")))
    tb = meta.get("traceback")
    if tb and hasattr(error, "add_note"):
        error.add_note(f"raised on {task}:\n{tb}")
    return error


class PerWorkerDataset:
    """A dataset built on every worker by ``dataset_fn`` (``create_per_worker_dataset``).

    ``iter()`` gives a ``PerWorkerIterator``: pass it to scheduled functions; each worker
    receives its own iterator. A restarted worker rebuilds its dataset (from the start) and
    iterators.

    Example:
        >>> per_worker_dataset = coordinator.create_per_worker_dataset(dataset_fn)
        >>> per_worker_iterator = iter(per_worker_dataset)
        >>> coordinator.schedule(step_fn, args=(per_worker_iterator,))
    """

    def __init__(self, coordinator: ClusterCoordinator, dataset_fn: Callable[..., Any]):
        self._coordinator = coordinator
        self._dataset_fn = dataset_fn
        self._values = coordinator._create_per_worker_resources(
            make_dataset, (dataset_fn,), "dataset")

    @property
    def per_worker_values(self) -> PerWorkerValues:
        return self._values

    def __iter__(self) -> PerWorkerIterator:
        dataset_ref = self._values
        return PerWorkerIterator(self._coordinator._create_per_worker_resources(
            make_iterator, (dataset_ref,), "iterator"))

    def __repr__(self) -> str:
        return f"PerWorkerDataset({self._dataset_fn!r}, workers={len(self._values)})"


class PerWorkerIterator(PerWorkerValues):
    """One iterator per worker (``iter(per_worker_dataset)``); pass it to ``schedule``.

    Example:
        >>> it = iter(coordinator.create_per_worker_dataset(dataset_fn))
        >>> def step_fn(iterator):
        ...     x, y = next(iterator)          # the executing worker's own iterator
        ...     return x.sum()
        >>> coordinator.schedule(step_fn, args=(it,))
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

    Example:
        >>> coordinator = jaxdist.coordinator.ClusterCoordinator(strategy)
        >>> rv = coordinator.schedule(step_fn, args=(per_worker_iterator,))
        >>> coordinator.join()
        >>> rv.fetch()
    """

    def __init__(self, strategy: Any, *, heartbeat_interval: float = 1.0,
                 heartbeat_timeout: float = 10.0, ps_timeout: float | None = None,
                 join_timeout: float | None = 600.0, closure_timeout: float = 3600.0,
                 rpc_timeout: float = 60.0):
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
                f"(TF_CONFIG task type must be 'chief')")
        if existing := getattr(strategy, "_jaxdist_coordinator", None):
            if not existing._stopping.is_set():
                raise ValueError("this strategy already has a ClusterCoordinator; shut it down "
                                 "first (coordinator.shutdown())")
        self._strategy = strategy
        self._rpc_timeout = float(rpc_timeout)
        self._closure_timeout = float(closure_timeout)
        self._join_timeout = join_timeout
        self._ps_rpc_timeout = float(getattr(ext, "_timeout", 60.0))
        self._queue = ClosureQueue()
        self._ids = itertools.count()
        self._resource_ids = itertools.count()
        self._resources: list[tuple[int, Callable, tuple]] = []
        self._broken: dict[int, BaseException] = {}
        self._resources_lock = threading.Lock()
        self._stopping = threading.Event()
        # The coordinator token (not the ps token) lets it run code on the workers.
        self._client = WorkerClient(workers, tls=getattr(ext.ps_client, "tls", None))
        ps_client = ext.ps_client if info.ps_addresses else None
        self._health = HealthWatcher(
            self._client, ps_client, heartbeat_interval, heartbeat_timeout,
            ps_timeout if ps_timeout is not None else self._ps_rpc_timeout,
            self._queue.set_cluster_error, self._on_restart)
        self._workers = [_WorkerThread(self, st) for st in self._health.workers]
        self._health.start()
        for w in self._workers:
            w.thread.start()
        strategy._jaxdist_coordinator = self

    # -------------------------------------------------------------- properties
    @property
    def strategy(self) -> Any:
        return self._strategy

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def worker_states(self) -> list[WorkerState]:
        """The health of every worker (``up``, ``incarnation``, ``restarts``, ...)."""
        return list(self._health.workers)

    def functions_run(self) -> list[int]:
        """Functions each worker completed (as seen by this coordinator)."""
        return [w.functions_run for w in self._workers]

    # -------------------------------------------------------------- scheduling
    def schedule(self, fn: Callable[..., Any], args: Sequence[Any] | None = None,
                 kwargs: dict[str, Any] | None = None) -> RemoteValue:
        """Queues ``fn(*args, **kwargs)`` to run on some worker; returns at once.

        ``PerWorkerValues`` arguments (per-worker iterators) are replaced by the executing
        worker's part; ``RemoteValue`` arguments by their values; the strategy and its
        variables by the worker's.

        Raises:
            Exception: an error of an earlier function (raised once, then cleared), or the
                ``PSUnavailableError`` of a ps task that is down.
            TypeError: ``fn`` is not callable or ``args``/``kwargs`` have the wrong type.

        Example:
            >>> rv = coordinator.schedule(step_fn, args=(it,))
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
        busy = [w.state.name for w in self._workers if w.state._call is not None]
        return JoinTimeoutError(
            f"join waited {timeout:.1f} s without any function finishing: {len(self._queue)} "
            f"queued, {self._queue.inflight} in flight (busy: {busy}, down: {down})",
            task=(down or busy or [None])[0])

    def done(self) -> bool:
        """Whether every scheduled function has finished (raises a pending error once)."""
        return self._queue.done()

    def fetch(self, val: Any) -> Any:
        """Blocking: the values of the ``RemoteValue``s (and ``PerWorkerValues``) in ``val``.

        Example:
            >>> coordinator.fetch([rv1, {"b": rv2}, 3])   # -> [v1, {"b": v2}, 3]
        """

        def one(x: Any) -> Any:
            if isinstance(x, RemoteValue):
                return x.fetch()
            if isinstance(x, PerWorkerValues):
                return tuple(one(v) for v in x.values)
            return x

        return jax.tree.map(one, val,
                            is_leaf=lambda x: isinstance(x, (RemoteValue, PerWorkerValues)))

    # -------------------------------------------------------------- per-worker resources
    def _create_per_worker_resources(self, fn: Callable[..., Any], args: tuple,
                                     kind: str = "resource") -> PerWorkerValues:
        rid = next(self._resource_ids)
        with self._resources_lock:
            self._resources.append((rid, fn, args))
        return PerWorkerValues([WorkerResource(rid, i, kind) for i in range(self.num_workers)])

    def _resource_specs(self) -> list[tuple[int, Callable, tuple]]:
        with self._resources_lock:
            return [r for r in self._resources if r[0] not in self._broken]

    def _broken_resource(self, rid: int, error: BaseException) -> None:
        with self._resources_lock:
            self._broken.setdefault(rid, error)

    def create_per_worker_dataset(self, dataset_fn: Callable[..., Any]) -> PerWorkerDataset:
        """Builds ``dataset_fn()`` on every worker (``dataset_fn(input_context)`` if it takes
        an argument: ``input_pipeline_id`` = worker index, ``num_input_pipelines`` = workers).

        Example:
            >>> ds = coordinator.create_per_worker_dataset(
            ...     lambda ctx: jaxdist.Dataset.from_tensor_slices(x).shard(
            ...         ctx.num_input_pipelines, ctx.input_pipeline_id).batch(32).repeat())
            >>> it = iter(ds)
        """
        if not callable(dataset_fn):
            raise TypeError(f"create_per_worker_dataset expects a callable dataset_fn, got "
                            f"{type(dataset_fn).__name__}")
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
            >>> def eval_fn(it):
            ...     return sum(float(jnp.sum(model(x) == y)) for x, y in it), ...
            >>> acc = coordinator.evaluate(eval_fn, lambda i, n: eval_ds.shard(n, i).batch(64),
            ...                            reduce_fn=lambda parts: ...)
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
            w.thread.join(max(0.1, deadline - time.monotonic()))
        self._health.stop(max(0.1, deadline - time.monotonic()))
        self._client.close()
        alive = [w.state.name for w in self._workers if w.thread.is_alive()]
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


def _eval_shard(eval_fn: Callable[[Any], Any], dataset_fn: Callable[[int, int], Any],
                shard: int, num_shards: int) -> Any:
    return eval_fn(iter(dataset_fn(shard, num_shards)))


__all__ = ["ClusterCoordinator", "PerWorkerDataset", "PerWorkerIterator"]
