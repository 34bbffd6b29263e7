"""``ClusterCoordinator``: TF2-style parameter-server training with scheduled functions.

The coordinator (the chief) holds a ``ParameterServerStrategy``; the variables live on the ps
tasks. ``schedule(fn, args)`` queues a function and returns a ``RemoteValue`` at once; one
thread per worker sends queued functions (cloudpickle, over the mutual-TLS channel, with the
coordinator token, see ``jaxdist._src.cluster.credentials``) to its
worker task (``python -m jaxdist.server`` with a ``worker`` TF_CONFIG), which runs them
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
import hashlib
import itertools
import logging
import threading
import time
import types
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxdist._src.coordinator import answer_pickle, closure_pickle
from jaxdist._src.coordinator.closure_pickle import WorkerResource
from jaxdist._src.coordinator.closure_queue import Closure, ClosureQueue
from jaxdist._src.coordinator.errors import (
    ClosureInputError,
    CoordinatorError,
    JoinTimeoutError,
    RemoteError,
    WorkerUnavailableError,
)
from jaxdist._src.coordinator.health import HealthWatcher, WorkerState
from jaxdist._src.coordinator.remote_value import PerWorkerValues, RemoteValue
from jaxdist._src.coordinator.worker_client import WorkerClient
from jaxdist._src.coordinator.worker_runtime import make_dataset, make_iterator, resolve_strategy
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


class _Slot:
    """One sender of a worker: the closures it has in flight and their call."""

    def __init__(self, index: int):
        self.index = index
        self.batch: list[Closure] = []
        self.call: Any = None
        self.ticket: int | None = None  # the order its batch was taken in (None: sent)


class _WorkerThread:
    """Sends queued closures to one worker task (TF's ``Worker``): ``PIPELINE_DEPTH`` sender
    threads, each with one call (a batch of closures) in flight; the worker runs them one at a
    time."""

    def __init__(self, coordinator: ClusterCoordinator, state: WorkerState):
        self._c = coordinator
        self.state = state
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
            broken = c._broken_input(args, self.index)
            if broken is not None:  # built from a resource that failed (TF: InputError)
                c._broken_resource(rid, broken)
                continue
            try:
                payload = closure_pickle.dumps((fn, args), self.index, c._ps_rpc_timeout)
                meta, arrays = c._client.call(self.index, "CreateResource",
                                              {"resource_id": rid},
                                              {"fn": to_bytes_array(payload)},
                                              timeout=c._rpc_timeout,
                                              on_start=functools.partial(
                                                  self.state.set_call, slot=-1))
            except CoordinatorError as e:
                self.state.mark_down(e)
                return False
            except Exception as e:  # noqa: BLE001 - the resource function cannot be sent
                # TF: a failed resource surfaces only in the functions that use it.
                c._broken_resource(rid, e)
                continue
            finally:
                self.state.set_call(None, -1)
            if not meta.get("ok"):
                if meta.get("kind") == "missing_resource":
                    self.resources_lost()
                    return False
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
    def _loop(self, slot: _Slot) -> None:
        c, st = self._c, self.state
        while not c._stopping.is_set():
            if not st.up.wait(0.1):
                continue
            with self._resource_lock:
                ready = self._ensure_resources()
            if not ready:
                time.sleep(0.05)
                continue
            # The second sender pipelines only a surplus: more queued than there are workers.
            batch = c._queue.get_batch(
                MAX_BATCH, timeout=0.1, tag=self.index,
                min_queued=1 if slot.index == 0 else c.num_workers + 1,
                share=c.num_workers * PIPELINE_DEPTH,
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
                        c._queue.put_back(closure)
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
            while self._turn_now < slot.ticket and not self._c._stopping.is_set():
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
        payload = closure_pickle.dumps(fn, self.index, self._c._ps_rpc_timeout)
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
        c = self._c
        items: list[_Item] = []
        # A batch is mostly one plain function: its fingerprint is taken once per batch.
        last: _ShippedFunction | None = None
        for k, closure in enumerate(batch):
            closure.attempts += 1
            broken = c._broken_input((closure.args, closure.kwargs), self.index)
            if broken is not None:
                closure.remote_value._set_error(broken)
                c._queue.mark_failed(broken)
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
                    c._queue.put_back(other)
                break
            except Exception as e:  # noqa: BLE001 - unpicklable function or a failed input
                closure.remote_value._set_error(e)
                c._queue.mark_failed(e)
                continue
            items.append(_Item(closure, shipped, args_payload))
        return items

    def _arguments(self, closure: Closure, wait: bool) -> bytes | tuple[int, ...]:
        """The closure's arguments for this worker: pickled, or the ids of its per-worker
        resources when that is all they are (``schedule(step, args=(iterator,))``, the
        common case: the worker looks them up, nothing is pickled on either side)."""
        c = self._c
        ids = _resource_ids(closure.args, closure.kwargs, self.index)
        if ids is not None:
            return ids
        return closure_pickle.dumps((closure.args, closure.kwargs), self.index,
                                    c._ps_rpc_timeout, c._join_timeout, wait=wait)

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
            item.closure.remote_value._set_error(error, self.state.name)
            self._c._queue.mark_failed(error)

    def _send(self, items: list[_Item], slot: _Slot) -> list[_Item]:
        """Sends ``items`` in one ``RunClosures`` call and settles each closure as its
        answer arrives; returns those the worker did not hold the function of (to send again
        with it)."""
        c, st = self._c, self.state
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
                answers = c._client.call_stream(
                    self.index, "RunClosures", request, arrays,
                    timeout=c._closure_timeout,
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
        c, st = self._c, self.state
        if not closures:
            return
        if not c._stopping.is_set() and not all(cl.cancel_requested for cl in closures):
            st.mark_down(e)
            log.warning("functions %s lost on %s (%s); scheduling them again",
                        [cl.closure_id for cl in closures], st.name, e)
        # Shutdown, or an earlier error, cancelled the call: the queue cancels the closures
        # (put_back with an error pending); the worker is fine.
        for closure in reversed(closures):  # back at the front, in their order
            c._queue.put_back(closure)

    def _settle(self, closure: Closure, meta: dict, arrays: dict) -> None:
        """Records the worker's answer for ``closure``: its value, error, or a re-run."""
        c, st = self._c, self.state
        if meta.get("ok"):
            try:
                value = answer_value(arrays)
            except Exception as e:  # noqa: BLE001
                closure.remote_value._set_error(e, st.name)
                c._queue.mark_failed(e)
                return
            with self._fn_lock:
                self.functions_run += 1
            closure.remote_value._set_value(value, st.name)
            c._queue.mark_finished()
            return
        if meta.get("kind") == "missing_resource" and closure.attempts < _MAX_RESOURCE_RETRIES:
            with self._resource_lock:
                if meta.get("incarnation") != self._created_for:
                    self.resources_lost()  # a new worker process: build every resource again
                # Same process: the closure was taken before a resource registered since was
                # built here; the next round builds what is missing, and only that (the
                # others hold state: iterators, accumulators).
            c._queue.put_back(closure)
            return
        if meta.get("kind") == "cancelled":  # the call was given up before it started
            c._queue.put_back(closure)
            return
        error = _remote_exception(meta, arrays)
        closure.remote_value._set_error(error, st.name)
        c._queue.mark_failed(error)


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


def _remote_exception(meta: dict, arrays: dict) -> BaseException:
    """The exception a worker sent back, as itself (its type and message), with one note line
    naming the task and the worker's innermost frame; the worker's whole traceback is its
    ``remote_traceback`` attribute (and in the worker's log), not printed on the chief."""
    task = meta.get("task")
    tb = str(meta.get("traceback") or "")
    error: BaseException | None = None
    if "error" in arrays:
        try:
            # Data and exception types only: a worker cannot run code here.
            error = answer_pickle.loads(from_bytes_array(arrays["error"]))
        except Exception:  # noqa: BLE001 - fall back to RemoteError
            error = None
    if not isinstance(error, BaseException):
        error = RemoteError(f"{task}: {meta.get('type')}: {meta.get('message')}", task=task,
                            remote_type=str(meta.get("type")), remote_traceback=tb)
    if tb:
        try:
            error.remote_traceback = tb  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - an exception type that refuses attributes
            pass
        if hasattr(error, "add_note"):
            error.add_note(f"raised on {task}{_innermost_frame(tb)} (the worker's traceback: "
                           f"the error's remote_traceback, and that task's log)")
    return error


def _innermost_frame(tb: str) -> str:
    """`` at FILE:LINE in FUNCTION`` of a formatted traceback's last frame (or ``""``)."""
    import re

    frames = re.findall(r'^  File "([^"]+)", line (\d+), in (.+)$', tb, re.MULTILINE)
    if not frames:
        return ""
    path, line, fn = frames[-1]
    return f" at {path}:{line} in {fn}"


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
    from jaxdist._src.input.distributed import DistributedDataset, DistributedDatasetsFromFunction

    if isinstance(dataset_or_fn, DistributedDataset):
        return functools.partial(_redistribute, dataset_or_fn._dataset, dataset_or_fn.options)
    if isinstance(dataset_or_fn, DistributedDatasetsFromFunction):
        return functools.partial(_redistribute_from_function, dataset_or_fn._dataset,
                                 dataset_or_fn._options)
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
        existing = getattr(strategy, "_jaxdist_coordinator", None)
        if isinstance(existing, cls) and not existing._stopping.is_set():
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
        self._ps_rpc_timeout = float(getattr(ext, "_timeout", 60.0))
        self._queue = ClosureQueue(on_cancel=self._cancel_inflight)
        self._num_replicas: int | None = None
        self._num_replicas_lock = threading.Lock()
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
            for t in w.threads:
                t.start()
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

    def _cancel_inflight(self) -> None:
        """The queue's ``on_cancel``: an error cancels every function in flight (TF)."""
        for w in self._workers:
            w.cancel()

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
            for w in self._workers:
                try:
                    counts[w.state.name] = self._probe_replicas(w.index)
                except Exception as e:  # noqa: BLE001 - a worker down: ask the others
                    errors.append(f"{w.state.name}: {e}")
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
            raise _remote_exception(meta, arrays)
        return int(answer_value(arrays))

    def _fetch_resource(self, resource: WorkerResource) -> Any:
        """The value of a per-worker resource, copied from its worker (TF fetches the
        per-worker ``RemoteValue``); waits up to ``rpc_timeout`` for the worker to build it."""
        deadline = time.monotonic() + self._rpc_timeout
        while True:
            with self._resources_lock:
                broken = self._broken.get(resource.resource_id)
            if broken is not None:
                raise broken
            meta, arrays = self._run_direct(resource.worker_index, _identity_value, (resource,))
            if meta.get("ok"):
                return answer_value(arrays)
            if meta.get("kind") != "missing_resource" or time.monotonic() > deadline:
                raise _remote_exception(meta, arrays)
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

    def _release_resource(self, rid: int) -> None:
        """Forgets a per-worker resource nobody holds: restarted workers do not rebuild it."""
        with self._resources_lock:
            self._resources = [r for r in self._resources if r[0] != rid]
            self._broken.pop(rid, None)

    def _live_resources(self, kind: str | None = None) -> list[int]:
        """Ids of the per-worker resources (of ``kind``) restarted workers would rebuild."""
        with self._resources_lock:
            return [rid for rid, fn, _ in self._resources
                    if kind is None or (kind == "iterator") == (fn is make_iterator)]

    def _broken_input(self, structure: Any, worker_index: int) -> ClosureInputError | None:
        """TF's ``InputError``: a per-worker resource in ``structure`` failed to build."""
        with self._resources_lock:
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
            for t in w.threads:
                t.join(max(0.1, deadline - time.monotonic()))
        self._health.stop(max(0.1, deadline - time.monotonic()))
        self._client.close()
        alive = [w.state.name for w in self._workers if any(t.is_alive() for t in w.threads)]
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
