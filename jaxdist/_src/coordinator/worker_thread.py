"""The coordinator's sender for one worker task: ``WorkerThread``.

``ClusterCoordinator`` makes one per worker. Its ``PIPELINE_DEPTH`` sender threads take batches
of closures from the coordinator's ``ClosureQueue``, build the worker's per-worker resources
first, pickle each closure's function once per worker (then send it by digest), send a batch in
one ``RunClosures`` call over the ``WorkerClient`` and settle each closure as its answer comes:
its ``RemoteValue`` gets the value or the error, and the queue hears that it ended. A call that
is lost (the worker died or hung, and the heartbeats cancelled it) puts the closures without
an answer back at the front of the queue, to run again elsewhere (at-least-once); the answered
ones stay settled (exactly once). ``cancel()`` cancels the calls in flight (an earlier closure
failed).

It gets what it works with as constructor arguments (the worker's ``WorkerState``, the queue,
the client, the ``PerWorkerResources``, the ``SenderSettings`` and the coordinator's stopping
event) and reads no private attribute of another object.

Example:
    >>> from jaxdist._src.coordinator.worker_thread import SenderSettings
    >>> settings = SenderSettings(num_workers=2, rpc_timeout=60.0, closure_timeout=3600.0,
    ...                           ps_rpc_timeout=60.0, join_timeout=600.0)
    >>> w = WorkerThread(state, queue, client, resources, settings, stopping)  # doctest: +SKIP
    >>> w.start()  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import re
import threading
import time
import types
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from jaxdist._src.coordinator import answer_codec, closure_pickle
from jaxdist._src.coordinator.closure_pickle import WorkerResource
from jaxdist._src.coordinator.closure_queue import Closure, ClosureQueue
from jaxdist._src.coordinator.errors import CoordinatorError, RemoteError, WorkerUnavailableError
from jaxdist._src.coordinator.health import WorkerState
from jaxdist._src.coordinator.remote_value import PerWorkerValues
from jaxdist._src.coordinator.resources import PerWorkerResources
from jaxdist._src.coordinator.worker_client import WorkerClient
from jaxdist._src.coordinator.worker_service import (
    BATCH_KEY,
    FN_DIGEST_KEY,
    GROUP_KEY,
    MAX_RESOURCE_ARGS,
    RESOURCES_KEY,
    SEQ_KEY,
    SESSION_KEY,
    answer_value,
    from_bytes_array,
    to_bytes_array,
)

log = logging.getLogger(__name__)

_MAX_RESOURCE_RETRIES = 20


#: Calls in flight to one worker at once: while it runs one, the next one is already there
#: (it waits on the worker until the first ends), so the worker never waits for a round trip
#: to the coordinator. The second sender takes closures only while more are queued than
#: there are workers, so short queues still spread over every worker.
PIPELINE_DEPTH = 2

#: The most closures one call carries to a worker (``RunClosures``). A sender takes
#: ``queued // (workers * PIPELINE_DEPTH)`` closures, at least one: a lone closure is sent at
#: once, a long queue in batches. The worker runs them in order and answers them as they end,
#: so a worker lost mid-batch loses only the closure it was running, the answers it held
#: (``GROUP_ANSWERS``) and the closures not started (which go back to the queue).
MAX_BATCH = 16

#: Whether the worker may answer several closures of a batch in one message: a finished
#: closure's answer waits (``worker_service.GROUP_HOLD_SECONDS``: 0.1 s) for the ones after it,
#: which spares a message, a MAC and a wake-up of this process per closure. The price: a
#: worker lost mid-batch also loses the answers it held, and those closures run again
#: (at-least-once, as for the closure it was running).
GROUP_ANSWERS = True


@dataclasses.dataclass(frozen=True)
class SenderSettings:
    """What a ``WorkerThread`` needs of the coordinator's settings.

    Attributes:
        num_workers: the workers of the cluster (how a queue is shared among their senders).
        rpc_timeout: deadline of the small calls (building a resource), seconds.
        closure_timeout: deadline of one ``RunClosures`` call, seconds.
        ps_rpc_timeout: the strategy's ps timeout, pickled with the functions.
        join_timeout: how long an argument's ``RemoteValue`` is waited for (``None``: as long
            as needed).
    """

    num_workers: int
    rpc_timeout: float
    closure_timeout: float
    ps_rpc_timeout: float
    join_timeout: float | None


class _Slot:
    """One sender of a worker: the closures it has in flight and their call."""

    def __init__(self, index: int):
        self.index = index
        self.batch: list[Closure] = []
        self.call: Any = None
        self.ticket: int | None = None  # the order its batch was taken in (None: sent)


class WorkerThread:
    """Sends queued closures to one worker task (TF's ``Worker``): ``PIPELINE_DEPTH`` sender
    threads, each with one call (a batch of closures) in flight; the worker runs them one at a
    time.

    Everything it works with comes in through the constructor; it reads no private attribute
    of another object.

    Args:
        state: the worker's health (``up``, ``incarnation``, the calls in flight); the
            heartbeats mark it down and cancel its calls when the worker is lost.
        queue: the coordinator's closure queue: batches are taken from it, and each closure
            ends there (``mark_finished``, ``mark_failed``, or ``put_back`` to run again).
        client: the ``WorkerClient`` that calls the worker (``call``, ``call_stream``).
        resources: the per-worker resources (datasets, iterators) to build on the worker
            before it runs closures.
        settings: the number of workers and the timeouts.
        stopping: set when the coordinator shuts down: the sender threads end.

    Example:
        >>> w = WorkerThread(state, queue, client, resources, settings, stopping)  # doctest: +SKIP
        >>> w.start()  # doctest: +SKIP
        >>> w.join(time.monotonic() + 10.0)  # after stop  # doctest: +SKIP
    """

    def __init__(self, state: WorkerState, queue: ClosureQueue, client: WorkerClient,
                 resources: PerWorkerResources, settings: SenderSettings,
                 stopping: threading.Event):
        self.state = state
        self._queue, self._client, self._resources = queue, client, resources
        self._settings, self._stopping = settings, stopping
        self.index = state.index
        self._created: set[int] = set()
        self._created_for: str | None = None
        self.functions_run = 0
        # Functions pickled for this worker (id -> entry) and the digests its process holds.
        self._fn_cache: OrderedDict[int, _ShippedFunction] = OrderedDict()
        self._shipped: set[str] = set()
        self._shipped_for: Any = None
        self._slots = [_Slot(i) for i in range(PIPELINE_DEPTH)]
        # Batches start their calls in the order they were taken (the worker runs them in
        # the order they come): ticket n calls after ticket n - 1 did, or gave up.
        self._turn = threading.Condition()
        self._next_ticket = self._turn_now = 0
        self._session, self._next_seq = uuid.uuid4().hex, 0
        self._current_lock = threading.Lock()
        self._resource_lock = threading.Lock()  # one sender builds resources at a time
        self._fn_lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, args=(slot,), daemon=True,
                                         name=f"jaxdist-coordinator-{state.name}-{slot.index}")
                        for slot in self._slots]

    @property
    def current(self) -> Closure | None:
        """A closure in flight on this worker (``None``: none)."""
        with self._current_lock:
            return next((s.batch[0] for s in self._slots if s.batch), None)

    def batches(self) -> list[list[Closure]]:
        """The closures in flight on each sender (a snapshot; empty lists: idle senders)."""
        with self._current_lock:
            return [list(s.batch) for s in self._slots]

    def start(self) -> None:
        """Starts the sender threads."""
        for t in self.threads:
            t.start()

    def join(self, deadline: float) -> None:
        """Waits for the sender threads to end, until ``deadline`` (``time.monotonic()``)
        but at least 0.1 s each."""
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))

    def is_alive(self) -> bool:
        """Whether a sender thread still runs."""
        return any(t.is_alive() for t in self.threads)

    # -------------------------------------------------------------- resources
    def resources_lost(self) -> None:
        """The worker lost its resources (a new process): build every one again."""
        self._created.clear()
        self._created_for = None

    def _ensure_resources(self) -> bool:
        """Builds the per-worker resources this worker lacks; False if it went down."""
        if self._created_for != self.state.incarnation:
            self._created.clear()
            self._created_for = self.state.incarnation
        for rid, fn, args in self._resources.specs():
            if rid in self._created:
                continue
            broken = self._resources.broken_input(args, self.index)
            if broken is not None:  # built from a resource that failed (TF: InputError)
                self._resources.mark_broken(rid, broken)
                continue
            try:
                payload = closure_pickle.dumps((fn, args), self.index,
                                               self._settings.ps_rpc_timeout)
                meta, arrays = self._client.call(self.index, "CreateResource",
                                                 {"resource_id": rid},
                                                 {"fn": to_bytes_array(payload)},
                                                 timeout=self._settings.rpc_timeout,
                                                 on_start=functools.partial(
                                                     self.state.set_call, slot=-1))
            except CoordinatorError as e:
                self.state.mark_down(e)
                return False
            except Exception as e:  # noqa: BLE001 - the resource function cannot be sent
                # TF: a failed resource surfaces only in the functions that use it.
                self._resources.mark_broken(rid, e)
                continue
            finally:
                self.state.set_call(None, -1)
            if not meta.get("ok"):
                if meta.get("kind") == "missing_resource":
                    self.resources_lost()
                    return False
                self._resources.mark_broken(
                    rid, remote_exception(meta, arrays, self.state.name))
                continue
            if meta.get("incarnation") != self._created_for:
                # The worker restarted under us: start again with its new incarnation.
                self.state.incarnation = meta.get("incarnation")
                self.resources_lost()
                return False
            self._created.add(rid)
        return True

    # -------------------------------------------------------------- main loop
    def _loop(self, slot: _Slot) -> None:
        st, queue, workers = self.state, self._queue, self._settings.num_workers
        while not self._stopping.is_set():
            if not st.up.wait(0.1):
                continue
            with self._resource_lock:
                ready = self._ensure_resources()
            if not ready:
                time.sleep(0.05)
                continue
            # The second sender pipelines only a surplus: more queued than there are workers.
            batch = queue.get_batch(
                MAX_BATCH, timeout=0.1, tag=self.index,
                min_queued=1 if slot.index == 0 else workers + 1,
                share=workers * PIPELINE_DEPTH,
                on_take=functools.partial(self._take_ticket, slot))
            if not batch:
                continue
            with self._current_lock:
                slot.batch, slot.call = list(batch), None
            try:
                with self._resource_lock:  # resources registered while this sender waited
                    ready = self._ensure_resources()
                if not ready:
                    self._forget(slot, batch)
                    for closure in batch:
                        queue.put_back(closure)
                    continue
                self._process(batch, slot)
            finally:
                self._pass_turn(slot)
                # Hold no reference to a finished closure: its arguments (iterators) can go.
                with self._current_lock:
                    slot.batch, slot.call = [], None
                batch = None

    def _take_ticket(self, slot: _Slot, batch: list[Closure]) -> None:
        """``get_batch``'s ``on_take`` (holding the queue's lock): the batch's place."""
        slot.ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1

    def _wait_turn(self, slot: _Slot) -> None:
        """Waits until the batches taken before this slot's started their calls."""
        if slot.ticket is None:
            return
        with self._turn:
            while self._turn_now < slot.ticket and not self._stopping.is_set():
                self._turn.wait(0.1)

    def _pass_turn(self, slot: _Slot) -> None:
        """This slot's batch started its call (or has none to start): the next one may."""
        if slot.ticket is None:
            return
        self._wait_turn(slot)
        with self._turn:
            self._turn_now = max(self._turn_now, slot.ticket + 1)
            slot.ticket = None
            self._turn.notify_all()

    def _function(self, fn: Callable[..., Any]) -> _ShippedFunction:
        """``fn`` pickled for this worker, pickled again only when it may have changed.

        A plain function is pickled once and then sent by its SHA-256 (the worker keeps the
        unpickled function): it is pickled again when the objects its closure cells, defaults
        or global names refer to are other objects (rebinding), as TF retraces for new
        Python values. In-place mutation of a captured object is not seen (as in TF, where a
        traced function keeps the Python values it captured). Other callables (methods,
        partials, objects) are pickled every time.
        """
        key = _fingerprint(fn)
        with self._fn_lock:
            entry = self._fn_cache.get(id(fn)) if key is not None else None
            if entry is not None and entry.fn is fn and _same(entry.key, key):
                self._fn_cache.move_to_end(id(fn))
                return entry
        payload = closure_pickle.dumps(fn, self.index, self._settings.ps_rpc_timeout)
        entry = _ShippedFunction(fn, key, payload, hashlib.sha256(payload).hexdigest())
        if key is not None:
            with self._fn_lock:
                self._fn_cache[id(fn)] = entry
                while len(self._fn_cache) > _MAX_CACHED_FUNCTIONS:
                    self._fn_cache.popitem(last=False)
        return entry

    def cancel(self) -> None:
        """Cancels the closures in flight here (an earlier function failed)."""
        calls = []
        with self._current_lock:
            for slot in self._slots:
                if not slot.batch:
                    continue
                for closure in slot.batch:
                    closure.cancel_requested = True
                if slot.call is not None:
                    calls.append(slot.call)  # that batch's own call, never the next one's
        for call in calls:
            call.cancel()

    def _on_start(self, slot: _Slot, call: Any) -> None:
        self.state.set_call(call, slot.index)  # heartbeats cancel it when the worker is lost
        with self._current_lock:
            slot.call = call
            cancelled = any(closure.cancel_requested for closure in slot.batch)
        # Heartbeats cancel the calls in flight once, when the worker goes down: a call that
        # started later (its connection took long: the worker hung) is cancelled here.
        if cancelled or not self.state.up.is_set():
            call.cancel()  # the cancellation came before the call started

    def _prepare(self, batch: list[Closure], slot: _Slot) -> list[_Item]:
        """Pickles the closures of ``batch`` to send; fails those that cannot be sent.

        A closure (after the first) with a ``RemoteValue`` argument that has no value yet
        goes back to the queue with the ones after it: that value may be the result of a
        closure of this very batch, which has not been sent.
        """
        queue = self._queue
        items: list[_Item] = []
        # A batch is mostly one plain function: its fingerprint is taken once per batch.
        last: _ShippedFunction | None = None
        for k, closure in enumerate(batch):
            closure.attempts += 1
            broken = self._resources.broken_input((closure.args, closure.kwargs), self.index)
            if broken is not None:
                closure.set_error(broken)
                queue.mark_failed(broken)
                continue
            try:
                shipped = last if last is not None and last.fn is closure.fn and (
                    last.key is not None) else self._function(closure.fn)
                last = shipped
                args_payload = self._arguments(closure, wait=not items)
            except closure_pickle.NotReadyError:
                rest = batch[k:]
                for other in rest:
                    other.attempts -= 1  # not started
                self._forget(slot, rest)
                for other in reversed(rest):
                    queue.put_back(other)
                break
            except Exception as e:  # noqa: BLE001 - unpicklable function or a failed input
                closure.set_error(e)
                queue.mark_failed(e)
                continue
            items.append(_Item(closure, shipped, args_payload))
        return items

    def _arguments(self, closure: Closure, wait: bool) -> bytes | tuple[int, ...]:
        """The closure's arguments for this worker: pickled, or the ids of its per-worker
        resources when that is all they are (``schedule(step, args=(iterator,))``, the
        common case: the worker looks them up, nothing is pickled on either side)."""
        ids = _resource_ids(closure.args, closure.kwargs, self.index)
        if ids is not None:
            return ids
        return closure_pickle.dumps((closure.args, closure.kwargs), self.index,
                                    self._settings.ps_rpc_timeout, self._settings.join_timeout,
                                    wait=wait)

    def _forget(self, slot: _Slot, closures: list[Closure]) -> None:
        """``closures`` are no longer in flight on ``slot`` (cancel() leaves them alone)."""
        gone = {id(closure) for closure in closures}
        with self._current_lock:
            slot.batch = [closure for closure in slot.batch if id(closure) not in gone]

    def _answered(self, slot: _Slot, closure: Closure) -> None:
        """``_forget`` of one answered closure (answers come in order: it is first)."""
        with self._current_lock:
            batch = slot.batch
            for i, other in enumerate(batch):
                if other is closure:
                    del batch[i]
                    return

    def _process(self, batch: list[Closure], slot: _Slot) -> None:
        items = self._prepare(batch, slot)
        for _ in range(3):  # a worker that lost a function (restart, eviction) gets it again
            if not items:
                return
            items = self._send(items, slot)
        for item in items:  # unreachable: a closure sent with its function is never refused
            error = RemoteError(f"{self.state.name} refused function #{item.closure.closure_id}"
                                f" three times (missing_function)", task=self.state.name)
            item.closure.set_error(error, self.state.name)
            self._queue.mark_failed(error)

    def _send(self, items: list[_Item], slot: _Slot) -> list[_Item]:
        """Sends ``items`` in one ``RunClosures`` call and settles each closure as its
        answer arrives; returns those the worker did not hold the function of (to send again
        with it)."""
        st = self.state
        # In turn from here: whether a call carries a function depends on what the calls
        # before it carried, and the worker runs the calls in the order they start.
        self._wait_turn(slot)
        closures, arrays = [], {}
        with_fn: set[str] = set()
        for i, item in enumerate(items):
            digest = item.shipped.digest
            closures.append({"closure_id": item.closure.closure_id, FN_DIGEST_KEY: digest})
            if type(item.args_payload) is tuple:
                closures[-1][RESOURCES_KEY] = list(item.args_payload)
            else:
                arrays[f"args.{i}"] = to_bytes_array(item.args_payload)
            if item.with_fn or (digest not in self._shipped and digest not in with_fn):
                # Counted as held from now on: the other sender's next call waits on the
                # worker behind this one (or gets missing_function and sends it again).
                arrays[f"fn.{i}"] = to_bytes_array(item.shipped.payload)
                self._shipped.add(digest)
                with_fn.add(digest)
        request = {BATCH_KEY: closures}
        if GROUP_ANSWERS and len(items) > 1:
            request[GROUP_KEY] = len(items)
        if slot.ticket is not None:  # the worker runs the numbered calls in their order
            request[SESSION_KEY], request[SEQ_KEY] = self._session, self._next_seq
            self._next_seq += 1
        with self._current_lock:
            slot.batch = [item.closure for item in items]
        again: list[_Item] = []
        answered = 0
        try:
            try:
                answers = self._client.call_stream(
                    self.index, "RunClosures", request, arrays,
                    timeout=self._settings.closure_timeout,
                    on_start=functools.partial(self._on_start, slot))
            finally:
                self._pass_turn(slot)
            for meta, out in answers:
                if answered >= len(items):
                    raise WorkerUnavailableError(
                        f"{st.name} sent more answers than the {len(items)} closures it was "
                        f"sent", task=st.name)
                item = items[answered]
                answered += 1
                if meta.get("incarnation") != self._shipped_for:  # a new worker process
                    self._shipped, self._shipped_for = set(with_fn), meta.get("incarnation")
                if meta.get("kind") == "missing_function" and not item.with_fn and (
                        f"fn.{answered - 1}" not in arrays):
                    self._shipped.discard(item.shipped.digest)
                    item.with_fn = True
                    again.append(item)  # it did not run: send it again with its function
                    continue
                self._answered(slot, item.closure)
                self._settle(item.closure, meta, out)
            if answered < len(items):
                raise WorkerUnavailableError(
                    f"{st.name} answered {answered} of the {len(items)} closures it was sent",
                    task=st.name)
        except CoordinatorError as e:
            # The worker died, hung (heartbeats cancelled the call) or is unreachable: the
            # closures without an answer run again elsewhere (at-least-once); those answered
            # are settled (exactly once).
            st.set_call(None, slot.index)
            self._lost([item.closure for item in items[answered:] + again], e)
            return []
        st.set_call(None, slot.index)
        return again

    def _lost(self, closures: list[Closure], e: BaseException) -> None:
        st = self.state
        if not closures:
            return
        if not self._stopping.is_set() and not all(cl.cancel_requested for cl in closures):
            st.mark_down(e)
            log.warning("functions %s lost on %s (%s); scheduling them again",
                        [cl.closure_id for cl in closures], st.name, e)
        # Shutdown, or an earlier error, cancelled the call: the queue cancels the closures
        # (put_back with an error pending); the worker is fine.
        for closure in reversed(closures):  # back at the front, in their order
            self._queue.put_back(closure)

    def _settle(self, closure: Closure, meta: dict, arrays: dict) -> None:
        """Records the worker's answer for ``closure``: its value, error, or a re-run."""
        queue, st = self._queue, self.state
        if meta.get("ok"):
            try:
                value = answer_value(arrays, st.name)
            except Exception as e:  # noqa: BLE001
                closure.set_error(e, st.name)
                queue.mark_failed(e)
                return
            with self._fn_lock:
                self.functions_run += 1
            closure.set_value(value, st.name)
            queue.mark_finished()
            return
        if meta.get("kind") == "missing_resource" and closure.attempts < _MAX_RESOURCE_RETRIES:
            with self._resource_lock:
                if meta.get("incarnation") != self._created_for:
                    self.resources_lost()  # a new worker process: build every resource again
                # Same process: the closure was taken before a resource registered since was
                # built here; the next round builds what is missing, and only that (the
                # others hold state: iterators, accumulators).
            queue.put_back(closure)
            return
        if meta.get("kind") == "cancelled":  # the call was given up before it started
            queue.put_back(closure)
            return
        error = remote_exception(meta, arrays, st.name)
        closure.set_error(error, st.name)
        queue.mark_failed(error)


class _Item:
    """A closure of a batch, pickled for one worker."""

    __slots__ = ("args_payload", "closure", "shipped", "with_fn")

    def __init__(self, closure: Closure, shipped: _ShippedFunction,
                 args_payload: bytes | tuple[int, ...]):
        self.closure, self.shipped, self.args_payload = closure, shipped, args_payload
        self.with_fn = False


_MAX_CACHED_FUNCTIONS = 32


def _resource_ids(args: tuple, kwargs: dict, worker_index: int) -> tuple[int, ...] | None:
    """The ids of worker ``worker_index``'s resources when every argument is a per-worker
    resource (a ``PerWorkerValues`` of resources, e.g. an iterator, or one resource) and
    there are no keyword arguments; ``None`` otherwise (the arguments are pickled)."""
    if kwargs or not args or len(args) > MAX_RESOURCE_ARGS:
        return None
    ids = []
    for a in args:
        if isinstance(a, PerWorkerValues):  # as the pickler sees them
            if not 0 <= worker_index < len(a.values):
                return None  # pickling raises the error that says so
            a = a.values[worker_index]
        if not isinstance(a, WorkerResource):
            return None
        ids.append(a.resource_id)
    return tuple(ids)


class _ShippedFunction:
    """A function pickled for one worker: its pickle, the pickle's SHA-256, and what it
    was pickled from (``key``: the objects it refers to)."""

    __slots__ = ("digest", "fn", "key", "payload")

    def __init__(self, fn: Any, key: tuple | None, payload: bytes, digest: str):
        self.fn, self.key, self.payload, self.digest = fn, key, payload, digest


def _code_names(code: types.CodeType, out: set[str]) -> set[str]:
    out.update(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code_names(const, out)
    return out


def _fingerprint(fn: Any) -> tuple | None:
    """The objects a plain function's pickle is made from (``None``: not a plain function)."""
    if not isinstance(fn, types.FunctionType):
        return None
    try:
        cells = tuple(c.cell_contents for c in fn.__closure__ or ())
    except ValueError:  # an empty cell
        return None
    names = _CODE_NAMES.get(fn.__code__)
    if names is None:
        names = tuple(sorted(_code_names(fn.__code__, set())))
        if len(_CODE_NAMES) >= 256:
            _CODE_NAMES.clear()
        _CODE_NAMES[fn.__code__] = names
    glob = fn.__globals__
    refs = tuple(glob.get(n, _MISSING) for n in names)
    return (fn.__code__, cells, fn.__defaults__, fn.__kwdefaults__, names, refs)


_MISSING = object()
#: The global names each code object reads (its own and its nested code's), sorted.
_CODE_NAMES: dict[types.CodeType, tuple[str, ...]] = {}


def _same(a: tuple | None, b: tuple | None) -> bool:
    """Whether two fingerprints refer to the very same objects (identity, not equality)."""
    if a is None or b is None or len(a) != len(b):
        return False
    code_a, cells_a, defs_a, kw_a, names_a, refs_a = a
    code_b, cells_b, defs_b, kw_b, names_b, refs_b = b
    return (code_a is code_b and defs_a is defs_b and kw_a is kw_b and names_a == names_b
            and len(cells_a) == len(cells_b) and all(x is y for x, y in zip(cells_a, cells_b))
            and all(x is y for x, y in zip(refs_a, refs_b)))


def remote_exception(meta: dict, arrays: dict, sender: str | None = None) -> BaseException:
    """The exception a worker sent back, as itself (its type and message), with one note line
    naming the task and the worker's innermost frame; the worker's whole traceback is its
    ``remote_traceback`` attribute (and in the worker's log), not printed on the chief.

    ``sender`` is the worker the answer came from (``None``: the name its meta gives)."""
    task = sender or meta.get("task")
    tb = str(meta.get("traceback") or "")
    error: Any = None
    if "error_pickle" in arrays and answer_codec.trusted():
        try:
            error = answer_codec.loads_trusted(from_bytes_array(arrays["error_pickle"]))
        except Exception:  # noqa: BLE001 - fall back to the data form
            error = None
    if not isinstance(error, BaseException) and "error" in arrays:
        try:
            # Rebuilt from data (answer_codec): a worker cannot run code here.
            error = answer_codec.decode(from_bytes_array(arrays["error"]), str(task))
        except answer_codec.UntrustedPickleError as e:
            error = RemoteError(f"{task}: {meta.get('type')}: {meta.get('message')} (its "
                                f"encoded form was refused: {e})", task=task,
                                remote_type=str(meta.get("type")), remote_traceback=tb)
    if isinstance(error, answer_codec.RemoteException):  # a type the chief does not rebuild
        error = RemoteError(f"{task}: {error.module}.{error.name}: {meta.get('message')}",
                            task=task, remote_type=str(meta.get("type")),
                            remote_traceback=tb)
    if not isinstance(error, BaseException):
        error = RemoteError(f"{task}: {meta.get('type')}: {meta.get('message')}", task=task,
                            remote_type=str(meta.get("type")), remote_traceback=tb)
    if tb:
        try:
            error.remote_traceback = tb  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - an exception type that refuses attributes
            pass
        try:
            error.add_note(f"raised on {task}{_innermost_frame(tb)} (the worker's traceback: "
                           f"the error's remote_traceback, and that task's log)")
        except Exception:  # noqa: BLE001 - __notes__ that is not a list
            pass
    return error


def _innermost_frame(tb: str) -> str:
    """`` at FILE:LINE in FUNCTION`` of a formatted traceback's last frame (or ``""``)."""
    frames = re.findall(r'^  File "([^"]+)", line (\d+), in (.+)$', tb, re.MULTILINE)
    if not frames:
        return ""
    path, line, fn = frames[-1]
    return f" at {path}:{line} in {fn}"


__all__ = ["GROUP_ANSWERS", "MAX_BATCH", "PIPELINE_DEPTH", "SenderSettings", "WorkerThread",
           "remote_exception"]
