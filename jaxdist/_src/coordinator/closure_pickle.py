"""Pickling of scheduled functions and their arguments for one worker (cloudpickle).

Objects bound to the coordinator's process travel as references that the worker resolves
against its own objects (``jaxdist._src.coordinator.worker_runtime``):

* a ``ParameterServerStrategy`` -> the worker's strategy;
* ``PSVariables`` / ``EmbeddingTable`` -> the same variables through the worker's ps client;
* ``PerWorkerValues`` -> the executing worker's part;
* a per-worker resource (dataset, iterator) -> the worker's instance;
* a ``RemoteValue`` -> its value (waited for; a failed one raises ``ClosureInputError``).

Only the authenticated coordinator <-> worker channel carries these bytes.

Example:
    >>> import numpy as np
    >>> from jaxdist._src.coordinator.closure_pickle import dumps
    >>> args, kwargs = (np.ones(3),), {"lr": 0.1}
    >>> payload = dumps((args, kwargs), worker_index=1)
    >>> isinstance(payload, bytes)
    True
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import cloudpickle

from jaxdist._src.coordinator import worker_runtime as wr
from jaxdist._src.coordinator.errors import ClosureInputError
from jaxdist._src.coordinator.remote_value import PerWorkerValues, RemoteValue, RemoteValueStatus


class WorkerResource:
    """A handle to a per-worker resource (dataset, iterator) living on one worker.

    Attributes:
        resource_id: the coordinator-wide id.
        worker_index: the worker holding it.
        kind: ``"dataset"``, ``"iterator"``, or ``"resource"``.
    """

    def __init__(self, resource_id: int, worker_index: int, kind: str = "resource"):
        self.resource_id, self.worker_index, self.kind = resource_id, worker_index, kind

    def __repr__(self) -> str:
        return f"WorkerResource(#{self.resource_id} {self.kind} on worker:{self.worker_index})"


def _is_strategy(obj: Any) -> bool:
    ext = getattr(type(obj), "extended", None)
    return (ext is not None and type(obj).__name__.endswith("ParameterServerStrategy")
            and hasattr(obj, "create_variables"))


class NotReadyError(Exception):
    """``dumps(..., wait=False)`` met a ``RemoteValue`` argument that has no value yet."""


class _Pickler(cloudpickle.Pickler):
    def __init__(self, file: io.BytesIO, worker_index: int, timeout: float,
                 input_timeout: float | None, wait: bool = True):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.worker_index = worker_index
        self.timeout = timeout
        self.input_timeout = input_timeout
        self.wait = wait

    def reducer_override(self, obj: Any) -> Any:
        from jaxdist._src.ps.embedding import EmbeddingTable
        from jaxdist._src.ps.variables import PSVariables

        if isinstance(obj, PerWorkerValues):
            if not 0 <= self.worker_index < len(obj.values):
                raise ValueError(
                    f"PerWorkerValues has {len(obj.values)} parts, but worker "
                    f"{self.worker_index} runs this function: expected one part per worker"
                )
            return _identity, (obj.values[self.worker_index],)
        if isinstance(obj, WorkerResource):
            return wr.lookup_resource, (obj.resource_id,)
        if isinstance(obj, RemoteValue):
            if not self.wait and obj.status is RemoteValueStatus.NOT_READY:
                raise NotReadyError(repr(obj))
            try:
                value = obj.fetch(self.input_timeout)
            except Exception as e:  # noqa: BLE001 - re-raised as the input's failure
                raise ClosureInputError(f"an argument {obj!r} failed: {e}") from e
            return _identity, (value,)
        if isinstance(obj, PSVariables):
            return wr.resolve_variables, (obj.layout, obj.worker_transform, self.timeout)
        if isinstance(obj, EmbeddingTable):
            return wr.resolve_embedding, (obj.name, obj.vocab_size, obj.dim, obj.dtype,
                                          list(obj.shards), self.timeout)
        if _is_strategy(obj):
            return wr.resolve_strategy, (self.timeout,)
        return super().reducer_override(obj)


def _identity(x: Any) -> Any:
    return x


def dumps(obj: Any, worker_index: int = 0, timeout: float = 60.0,
          input_timeout: float | None = None, wait: bool = True) -> bytes:
    """Pickles ``obj`` for worker ``worker_index`` (see the module docstring).

    Args:
        obj: a function, or arguments.
        worker_index: picks the part of every ``PerWorkerValues``.
        timeout: the worker strategy's RPC timeout (when the worker builds it).
        input_timeout: how long to wait for ``RemoteValue`` arguments.
        wait: ``False``: raise ``NotReadyError`` at a ``RemoteValue`` without a value instead
            of waiting for it.
    """
    buf = io.BytesIO()
    _Pickler(buf, worker_index, timeout, input_timeout, wait).dump(obj)
    return buf.getvalue()


def loads(payload: bytes) -> Any:
    """Unpickles on a worker (references resolve against ``worker_runtime.current()``)."""
    return pickle.loads(payload)


__all__ = ["NotReadyError", "WorkerResource", "dumps", "loads"]
