"""``PerWorkerResources``: the per-worker resources (datasets, iterators) a coordinator keeps.

``create_per_worker_dataset`` and ``iter()`` of it register a resource here: a function and its
arguments, built on every worker (and built again on a worker that restarted). A resource whose
build failed is broken: the closures that take it fail with ``ClosureInputError`` (TF's
``InputError``) instead of running. The coordinator and its ``WorkerThread``s share one registry.

Example:
    >>> from jaxdist._src.coordinator.resources import PerWorkerResources
    >>> resources = PerWorkerResources()
    >>> values = resources.create(  # doctest: +SKIP
    ...     make_dataset, (dataset_fn,), "dataset", num_workers=2)
    >>> [rid for rid, fn, args in resources.specs()]  # doctest: +SKIP
    [0]
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jaxdist._src.coordinator.closure_pickle import WorkerResource
from jaxdist._src.coordinator.errors import ClosureInputError
from jaxdist._src.coordinator.remote_value import PerWorkerValues
from jaxdist._src.coordinator.worker_runtime import make_iterator


class PerWorkerResources:
    """The per-worker resources of one coordinator: what each worker must build, and which
    builds failed. Thread-safe."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._resources: list[tuple[int, Callable, tuple]] = []
        self._broken: dict[int, BaseException] = {}
        self._lock = threading.Lock()
        # ids released by finalizers, applied under the lock by the next call (see release)
        self._released: collections.deque[int] = collections.deque()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Holds the lock, with the released resources forgotten first."""
        with self._lock:
            while self._released:
                rid = self._released.popleft()
                self._resources = [r for r in self._resources if r[0] != rid]
                self._broken.pop(rid, None)
            yield

    def create(self, fn: Callable[..., Any], args: tuple, kind: str,
               num_workers: int) -> PerWorkerValues:
        """Registers ``fn(*args)`` to build on every worker; its reference for each worker.

        Example:
            >>> it = resources.create(  # doctest: +SKIP
            ...     make_iterator, (datasets,), "iterator", num_workers=2)
        """
        rid = next(self._ids)
        with self._locked():
            self._resources.append((rid, fn, args))
        return PerWorkerValues([WorkerResource(rid, i, kind) for i in range(num_workers)])

    def specs(self) -> list[tuple[int, Callable, tuple]]:
        """``(resource_id, fn, args)`` of every resource a worker should hold (not broken)."""
        with self._locked():
            return [r for r in self._resources if r[0] not in self._broken]

    def mark_broken(self, rid: int, error: BaseException) -> None:
        """Resource ``rid`` failed to build with ``error`` (the first error is kept)."""
        with self._locked():
            self._broken.setdefault(rid, error)

    def broken(self, rid: int) -> BaseException | None:
        """The error resource ``rid`` failed with (``None``: not broken)."""
        with self._locked():
            return self._broken.get(rid)

    def release(self, rid: int) -> None:
        """Forgets a resource nobody holds: restarted workers do not rebuild it.

        Called by a finalizer (an iterator nobody holds), which the garbage collector runs in
        whichever thread allocates, possibly inside one of this registry's own locked sections:
        it takes no lock (the lock is not reentrant; taking it there would deadlock the
        thread), it queues the id, and the next call applies it under the lock."""
        self._released.append(rid)

    def live(self, kind: str | None = None) -> list[int]:
        """Ids of the resources (of ``kind``: ``"iterator"`` or another) restarted workers
        would rebuild."""
        with self._locked():
            return [rid for rid, fn, _ in self._resources
                    if kind is None or (kind == "iterator") == (fn is make_iterator)]

    def broken_input(self, structure: Any, worker_index: int) -> ClosureInputError | None:
        """TF's ``InputError``: a per-worker resource in ``structure`` failed to build."""
        with self._locked():
            if not self._broken:
                return None
            broken = dict(self._broken)
        for leaf in jax.tree.leaves(structure, is_leaf=lambda x: isinstance(x, PerWorkerValues)):
            if isinstance(leaf, PerWorkerValues) and worker_index < len(leaf.values):
                leaf = leaf.values[worker_index]
            rid = getattr(leaf, "resource_id", None)
            if rid in broken:
                if isinstance(broken[rid], ClosureInputError):
                    return broken[rid]
                original = broken[rid]
                return ClosureInputError(
                    f"Input has an error, the original exception is {original!r}, error "
                    f"message is {original}.")
        return None


__all__ = ["PerWorkerResources"]
