"""The coordinator's registry of per-worker resources (jaxdist._src.coordinator.resources)."""

import gc
import threading
import weakref

from jaxdist._src.coordinator.resources import PerWorkerResources
from jaxdist._src.coordinator.worker_runtime import make_iterator


class _CollectingLock:
    """A lock that runs the garbage collector once held: what happens when an allocation
    inside one of the registry's locked sections triggers a collection."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __enter__(self):
        self._lock.acquire()
        gc.collect()
        return self

    def __exit__(self, *exc):
        self._lock.release()


def test_an_iterator_finalized_inside_a_locked_call_is_released_without_deadlock():
    """``iter(per_worker_dataset)`` registers a finalizer that releases the iterator's resource;
    the collector runs finalizers in whichever thread allocates, also inside the registry's
    own locked sections, where taking its (non-reentrant) lock again would hang the thread."""
    resources = PerWorkerResources()
    kept = resources.create(make_iterator, ((),), "iterator", num_workers=2)
    dropped = resources.create(make_iterator, ((),), "iterator", num_workers=2)
    rid = dropped.values[0].resource_id

    class Cycle:  # garbage only the collector frees, as an iterator in a reference cycle
        pass

    c = Cycle()
    c.self = c
    weakref.finalize(c, resources.release, rid)
    del c
    resources._lock = _CollectingLock()
    got: list = []
    t = threading.Thread(target=lambda: got.append(resources.live("iterator")), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "live() deadlocked: a finalizer took the lock its thread held"
    assert resources.live("iterator") == [kept.values[0].resource_id]
    assert [rid for rid, _, _ in resources.specs()] == [kept.values[0].resource_id]


def test_a_released_resource_is_not_rebuilt_and_its_breakage_is_forgotten():
    resources = PerWorkerResources()
    a = resources.create(make_iterator, ((),), "iterator", num_workers=1)
    b = resources.create(list, ((),), "dataset", num_workers=1)
    ra, rb = a.values[0].resource_id, b.values[0].resource_id
    resources.mark_broken(ra, ValueError("bad input"))
    assert isinstance(resources.broken(ra), ValueError)
    resources.release(ra)
    assert resources.broken(ra) is None
    assert resources.live() == [rb] and resources.live("iterator") == []
    assert [rid for rid, _, _ in resources.specs()] == [rb]
