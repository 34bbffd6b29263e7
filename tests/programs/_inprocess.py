"""An in-process stand-in for ``ClusterCoordinator``: the 1-device reference of the
parameter-server programs.

It offers the calls those programs make (``create_per_worker_dataset``, ``schedule``,
``join``, ``done``, ``fetch``) and runs each scheduled function at once, in this process,
against a ``ParameterServerStrategy`` without a cluster (variables in an in-process
parameter service, compute on the strategy's devices). A program thus runs unchanged with a
real cluster (its functions on a worker task, its variables on ps tasks) and here.
"""

from __future__ import annotations

import inspect
from typing import Any

from jaxdist import InputContext


class _Done:
    def __init__(self, value: Any):
        self._value = value

    def fetch(self) -> Any:
        return self._value


class InProcessCoordinator:
    """Runs ``schedule(fn, args)`` immediately as ``fn(*args)`` (one "worker": this process).

    Example:
        >>> coordinator = InProcessCoordinator(jaxdist.ParameterServerStrategy(
        ...     compute_devices=jax.local_devices()[:1]))
        >>> coordinator.schedule(step_fn, args=(iter(per_worker_dataset),)).fetch()
    """

    def __init__(self, strategy: Any):
        self.strategy = strategy

    def create_per_worker_dataset(self, dataset_fn: Any) -> Any:
        if not callable(dataset_fn):
            return dataset_fn
        if inspect.signature(dataset_fn).parameters:
            return dataset_fn(InputContext(1, 0, self.strategy.num_replicas_in_sync))
        return dataset_fn()

    def schedule(self, fn: Any, args: Any = None, kwargs: Any = None) -> _Done:
        return _Done(fn(*(args or ()), **(kwargs or {})))

    def join(self) -> None:
        return None

    def done(self) -> bool:
        return True

    def fetch(self, value: Any) -> Any:
        return value.fetch() if isinstance(value, _Done) else value
