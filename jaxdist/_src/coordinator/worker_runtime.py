"""What a worker task holds for the coordinator: its strategy, per-worker resources, caches.

Functions arrive pickled (cloudpickle) by the coordinator. References to coordinator objects
that cannot travel (the strategy with its gRPC channels, ``PSVariables`` and embedding tables
bound to the coordinator's client, per-worker resources) are pickled as small references
(see ``closure_pickle.py``) that the functions below resolve here, on the worker,
against this worker's own objects.

Example:
    >>> runtime = WorkerRuntime(info)              # by the worker service  # doctest: +SKIP
    >>> set_current(runtime)  # doctest: +SKIP
    >>> resolve_strategy(60.0)            # this worker's strategy  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import inspect
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from jaxdist._src.cluster.task_info import TaskInfo
from jaxdist._src.coordinator.errors import MissingResourceError
from jaxdist._src.strategies.parameter_server import ParameterServerStrategy

_current: WorkerRuntime | None = None


class _Resolver:
    """A duck-typed cluster resolver for this worker's strategy."""

    def __init__(self, info: TaskInfo):
        self._info = info
        self.task_type, self.task_id = info.task_type, info.task_id
        self.cluster_token = info.token

    def cluster_spec(self) -> dict[str, list[str]]:
        return {k: list(v) for k, v in self._info.cluster.items()}


def default_strategy_factory(info: TaskInfo, timeout: float) -> Any:
    """A ``ParameterServerStrategy`` for this worker (its local devices, its own ps client)."""
    return ParameterServerStrategy(_Resolver(info), timeout=timeout)


class WorkerRuntime:
    """State of one worker task across the functions it runs.

    Args:
        info: this task's place in the cluster (``worker:<i>``).
        strategy_factory: ``(info, timeout) -> strategy``; built on first use.
        incarnation: a string that changes when the process restarts.
    """

    def __init__(self, info: TaskInfo, strategy_factory: Callable[[TaskInfo, float], Any] | None
                 = None, incarnation: str = ""):
        self.info = info
        self.incarnation = incarnation
        self._factory = strategy_factory or default_strategy_factory
        self._strategy: Any = None
        self._lock = threading.RLock()
        self.resources: dict[int, Any] = {}
        self._variables: dict[tuple, Any] = {}
        self._functions: OrderedDict[str, Any] = OrderedDict()

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def worker_index(self) -> int:
        """Index in the ``worker`` job (the coordinator is the chief)."""
        return self.info.task_id

    def strategy(self, timeout: float = 60.0) -> Any:
        with self._lock:
            if self._strategy is None:
                self._strategy = self._factory(self.info, timeout)
            return self._strategy

    def cached_function(self, payload: bytes, load: Callable[[bytes], Any]) -> Any:
        """The function pickled as ``payload``, unpickled once (so jit caches keep working).

        It stays cached under the SHA-256 of ``payload`` (``function_by_digest``).
        """
        key = hashlib.sha256(payload).hexdigest()
        with self._lock:
            fn = self._functions.get(key)
            if fn is not None:
                self._functions.move_to_end(key)
                return fn
        fn = load(payload)
        with self._lock:
            self._functions[key] = fn
            while len(self._functions) > 64:
                self._functions.popitem(last=False)
        return fn

    def function_by_digest(self, digest: str) -> Any | None:
        """The cached function whose pickle has SHA-256 ``digest`` (hex); ``None`` if this
        worker does not hold it (never sent, evicted, or the worker restarted)."""
        with self._lock:
            fn = self._functions.get(digest)
            if fn is not None:
                self._functions.move_to_end(digest)
            return fn

    def input_context(self) -> Any:
        """``InputContext`` of this worker: one input pipeline per worker task."""
        from jaxdist._src.input.options import InputContext

        n = max(1, len(self.info.cluster.get("worker", [])))
        return InputContext(num_input_pipelines=n, input_pipeline_id=self.worker_index,
                            num_replicas_in_sync=1)

    def close(self) -> None:
        self.resources.clear()
        self._variables.clear()
        self._functions.clear()


def set_current(runtime: WorkerRuntime | None) -> None:
    """Makes ``runtime`` the one references resolve against (one per worker process)."""
    global _current
    _current = runtime


def current() -> WorkerRuntime:
    if _current is None:
        raise RuntimeError(
            "no worker runtime in this process: coordinator references (strategy, variables, "
            "per-worker resources) only resolve inside a worker task (python -m jaxdist.server)"
        )
    return _current


# ---------------------------------------------------------------------- reference resolvers
def resolve_strategy(timeout: float) -> Any:
    """The executing worker's strategy (stands in for the coordinator's)."""
    return current().strategy(timeout)


def resolve_variables(layout: Any, worker_spec: Any, timeout: float) -> Any:
    """The executing worker's ``PSVariables`` for ``layout`` (one object per collection)."""
    from jaxdist._src.ps.variables import PSVariables

    rt = current()
    key = ("vars", layout.collection, repr([(leaf.name, leaf.shape, leaf.shards)
                                            for leaf in layout.leaves]))
    with rt._lock:
        got = rt._variables.get(key)
        if got is None:
            strategy = rt.strategy(timeout)
            ext = strategy.extended
            got = PSVariables(ext.ps_client, layout, worker_spec, ext.worker_index,
                              getattr(ext, "sum_replicas", None))
            rt._variables[key] = got
        return got


def resolve_embedding(name: str, vocab_size: int, dim: int, dtype: Any, shards: list,
                      timeout: float) -> Any:
    """The executing worker's ``EmbeddingTable`` called ``name``."""
    from jaxdist._src.ps.embedding import EmbeddingTable

    rt = current()
    key = ("emb", name, vocab_size, dim, tuple(shards))
    with rt._lock:
        got = rt._variables.get(key)
        if got is None:
            ext = rt.strategy(timeout).extended
            got = EmbeddingTable(ext.ps_client, name, vocab_size, dim, dtype, shards,
                                 ext.worker_index)
            rt._variables[key] = got
        return got


def lookup_resource(resource_id: int) -> Any:
    """The per-worker resource ``resource_id`` on this worker.

    Raises:
        MissingResourceError: this worker does not hold it (it restarted); the coordinator
            rebuilds its resources and runs the function again.
    """
    rt = current()
    try:
        return rt.resources[resource_id]
    except KeyError:
        raise MissingResourceError(
            f"{rt.name} holds no per-worker resource #{resource_id} (restarted?)", task=rt.name
        ) from None


def make_dataset(dataset_fn: Callable[..., Any]) -> Any:
    """Calls ``dataset_fn()`` (or ``dataset_fn(input_context)``) on this worker."""
    try:
        params = [p for p in inspect.signature(dataset_fn).parameters.values()
                  if p.default is inspect.Parameter.empty
                  and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    if params:
        return dataset_fn(current().input_context())
    return dataset_fn()


def make_iterator(dataset: Any) -> Any:
    """``iter(dataset)`` on this worker."""
    return iter(dataset)


__all__ = [
    "WorkerRuntime",
    "current",
    "default_strategy_factory",
    "lookup_resource",
    "make_dataset",
    "make_iterator",
    "resolve_embedding",
    "resolve_strategy",
    "resolve_variables",
    "set_current",
]
