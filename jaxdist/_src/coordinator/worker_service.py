"""The worker task's service: runs the functions the coordinator sends (gRPC, token checked).

Methods (bidirectional streams of ``jaxdist._src.transport.wire`` chunks, like the ps service):

* ``Ping`` -> ``{"task", "incarnation", "busy"}``: the coordinator's heartbeat.
* ``RunClosure`` (meta ``closure_id`` and ``fn_digest``, arrays ``fn`` and ``args``:
  cloudpickle bytes as ``uint8``; ``fn`` is left out once the worker holds the function with
  that SHA-256) -> ``{"ok": True}`` plus the result (``value_arrays``: a raw array, or data
  in ``answer_codec``'s format, never a pickle the chief must load), or ``{"ok": False,
  "kind": "user" | "missing_resource" | "missing_function", ...}`` plus ``error`` (the
  exception in that format).
* ``RunClosures`` (meta ``closures``: a list of ``{"closure_id", "fn_digest"}``, arrays
  ``args.<i>`` and optionally ``fn.<i>`` for closure ``i``; instead of ``args.<i>``, a closure
  whose arguments are all per-worker resources names them, ``"resources": [id, ...]``, and
  the worker looks them up): several closures in one call, run
  in order; the answer streams one ``RunClosure`` answer per closure as soon as it ends (each
  message with its own MAC over ``"<nonce>/<i>"``, ``i`` counting messages). With meta
  ``group: n`` a message may carry up to ``n`` answers (``{"answers": [...]}``, see
  ``group_answers``): a finished closure's answer waits, at most ``GROUP_HOLD_SECONDS``, for
  the ones after it. A worker lost mid-batch loses the closure it was running, the answers it
  held, and the closures not started. A closure whose call was cancelled is not started.
  Batches run one at a time, whole; meta ``session`` and ``seq`` number a coordinator's calls,
  which then run in that order.
* ``CreateResource`` (meta ``resource_id``, array ``fn``): builds a per-worker resource.
* ``Stop``: stops the task.

Running code is a separate right from pulling/pushing parameters, and it belongs to the chief
alone: every request must carry the chief's Ed25519 signature for this worker, its
incarnation and a fresh per-worker counter (``jaxdist._src.coordinator.signing``; gRPC metadata
``x-jaxdist-coordinator-auth``), checked with the chief's public key before anything is
unpickled. The worker holds only the public key (``jaxdist._src.security.credentials``), so nothing
it holds or sees lets it run code on another worker. A request with only the cluster (ps)
token is refused with ``PERMISSION_DENIED``, an unsigned, wrongly signed (another worker's,
altered) or replayed one with ``UNAUTHENTICATED``, one signed for the worker's previous
process with ``ABORTED``. Every answer message carries a MAC keyed with this worker's own
answer key over its name, the method, the caller's nonce and every field and array of the
message, so the coordinator accepts only what this worker sent. The transport is mutual TLS
unless plaintext on loopback was asked for (``jaxdist._src.security.tls``).

``RunClosures`` is also served on a second port (``WorkerServer.direct``, named in the ``Ping``
answer as ``direct_port``): the frames of ``jaxdist._src.transport.direct`` over one
mutual-TLS socket per caller, a signed connection credential presented once per connection
(``Connect``, for this worker and incarnation), every request signed as on gRPC, the same
MAC'd answer messages, one frame each. It spares gRPC Python's fixed per-message cost (about
half the CPU of a small closure). ``JAXDIST_COORDINATOR_DIRECT=0`` turns it off.

Example:
    >>> server = WorkerServer(WorkerRuntime(info), "127.0.0.1:2224",  # doctest: +SKIP
    ...                       coordinator=keys.worker_credential("worker:0")).start()
    >>> server.wait_for_stop()  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle
import grpc
import numpy as np

from jaxdist._src.coordinator import answer_codec, closure_pickle
from jaxdist._src.coordinator.answer_codec import UntrustedPickleError
from jaxdist._src.coordinator.errors import MissingResourceError
from jaxdist._src.coordinator.signing import (
    AUTH_KEY,
    AUTH_METADATA_KEY,
    CONNECT_METHOD,
    MAC_KEY,
    Refusal,
    RequestVerifier,
    answer_mac,
    body_digest,
)
from jaxdist._src.coordinator.worker_runtime import WorkerRuntime, lookup_resource, set_current
from jaxdist._src.security.credentials import WorkerCredential, worker_credential
from jaxdist._src.security.tls import TLSConfig, resolve_tls
from jaxdist._src.transport import direct, wire
from jaxdist._src.transport.connections import ConnectionLimits
from jaxdist._src.transport.direct_server import CallFailed, DirectServer
from jaxdist._src.transport.grpc_util import TOKEN_METADATA_KEY, GrpcTaskServer, bind_server
from jaxdist._src.transport.limits import ServerLimits

log = logging.getLogger(__name__)

SERVICE_NAME = "jaxdist.coordinator.WorkerService"
METHODS = ("Ping", "RunClosure", "RunClosures", "CreateResource", "Stop")


def to_bytes_array(payload: bytes) -> np.ndarray:
    return np.frombuffer(payload, dtype=np.uint8)


def from_bytes_array(arr: np.ndarray) -> bytes:
    return np.asarray(arr, dtype=np.uint8).tobytes()


NONCE_KEY = "nonce"
#: RunClosure meta: the SHA-256 (hex) of the pickled function; sent alone once the worker
#: holds that function (it answers ``kind: "missing_function"`` when it does not).
FN_DIGEST_KEY = "fn_digest"
#: RunClosures meta: the closures of the batch, in the order they run.
BATCH_KEY = "closures"
#: The most closures one ``RunClosures`` call may carry.
MAX_BATCH_CLOSURES = 64
#: RunClosures closure meta: its arguments are these per-worker resources (ids), in order,
#: instead of pickled ``args.<i>``.
RESOURCES_KEY = "resources"
#: The most per-worker resources a closure's arguments may name that way.
MAX_RESOURCE_ARGS = 16
#: RunClosures meta: the coordinator's session (a random id) and the call's number in it.
SESSION_KEY, SEQ_KEY = "session", "seq"
#: RunClosures meta: answer up to this many closures per message (``group_answers``);
#: absent: one message per closure.
GROUP_KEY = "group"
#: A grouped message's meta: the answers it carries, in order.
ANSWERS_KEY = "answers"
#: How long a finished closure's answer may wait for the next ones to share its message.
GROUP_HOLD_SECONDS = 0.1
#: A message of grouped answers goes out once its arrays pass this size.
GROUP_MAX_BYTES = 64 << 10
#: How long a call waits for the call numbered just below it that has not arrived.
ORDER_GRACE_SECONDS = 0.25
#: ``0`` / ``false`` / ``no``: no direct transport for ``RunClosures`` (server and client).
ENV_DIRECT = "JAXDIST_COORDINATOR_DIRECT"


def direct_enabled() -> bool:
    """False when ``JAXDIST_COORDINATOR_DIRECT`` is ``0`` / ``false`` / ``no``.

    Example:
        >>> from jaxdist._src.coordinator.worker_service import direct_enabled
        >>> direct_enabled()
        True
    """
    return direct.enabled(ENV_DIRECT)


def item_nonce(nonce: str, index: int) -> str:
    """The nonce the answer of closure ``index`` of a ``RunClosures`` call is MAC'd over."""
    return f"{nonce}/{index}"


def request_refusal(verifier: RequestVerifier, method: str, auth: Any, meta: dict,
                    arrays: dict, metadata: dict | None = None,
                    arrived: int | None = None) -> Refusal | None:
    """Why a request to this worker is refused (``None``: the chief signed it, for this
    worker, its incarnation and ``method``, not too long before it ``arrived``
    (``time.time_ns()``; default: now), and it is not a replay).

    Example:
        >>> request_refusal(  # doctest: +SKIP
        ...     verifier, "RunClosures", meta.get("auth"), meta, arrays)
    """
    if auth is None:
        if metadata and TOKEN_METADATA_KEY in metadata:
            return Refusal(
                "PERMISSION_DENIED",
                f"{verifier.task} refused {method}: the cluster (ps) token allows pulling and "
                f"pushing parameters only; running code on a worker needs a request signed by "
                f"the chief (metadata {AUTH_METADATA_KEY!r})")
        return Refusal("UNAUTHENTICATED", f"{verifier.task} refused {method}: the request "
                                          f"carries no coordinator signature")
    return verifier.check(method, auth, body_digest(meta, arrays), arrived)


def _host_value(value: Any) -> Any:
    """The result with device arrays copied to numpy (only if jax is loaded)."""
    import sys

    jax = sys.modules.get("jax")
    if jax is None:
        return value
    if isinstance(value, jax.Array):  # the common result, a loss: what device_get returns
        return np.asarray(value)
    if isinstance(value, (np.ndarray, np.generic)):
        return value
    return jax.device_get(value)


#: A numeric numpy result up to this size is sent as a raw array, not encoded.
RAW_VALUE_BYTES = 1 << 20


def value_arrays(value: Any) -> dict[str, np.ndarray]:
    """The answer arrays of a function's result.

    The common result, a loss (a numpy array or scalar of a numeric dtype), goes as a raw
    array (``"array"`` / ``"scalar"``). Other data goes in ``answer_codec``'s format
    (``"data"``): the chief rebuilds it from dtypes, shapes and bytes, never by unpickling.
    A result that is not data goes as a marker naming its type (``"data"``) plus its
    cloudpickle (``"pickle"``), which only a chief that trusts every worker unpickles.
    ``answer_value`` inverts it.

    Example:
        >>> import numpy as np
        >>> from jaxdist._src.coordinator.worker_service import answer_value, value_arrays
        >>> answer_value(value_arrays(np.float32(0.5)))
        np.float32(0.5)
        >>> answer_value(value_arrays({"loss": 0.5, "ids": [1, 2]}))
        {'loss': 0.5, 'ids': [1, 2]}
    """
    kind = "array" if type(value) is np.ndarray else (
        "scalar" if isinstance(value, np.generic) else None)
    if kind is not None:
        arr = np.asarray(value)
        if arr.dtype.kind in "biufc" and arr.dtype.isnative and arr.nbytes <= RAW_VALUE_BYTES:
            return {kind: arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)}
    try:
        return {"data": to_bytes_array(answer_codec.encode(value))}
    except answer_codec.NotDataError as e:
        where = str(e)
    return {"data": to_bytes_array(answer_codec.encode_opaque(value, where)),
            "pickle": to_bytes_array(cloudpickle.dumps(value))}


def answer_value(arrays: dict, sender: str = "") -> Any:
    """The result carried by an answer's arrays (``value_arrays``' inverse), rebuilt as data
    (``answer_codec``): a worker cannot run code here nor corrupt this process' memory.

    Args:
        arrays: the answer's arrays, after its MAC was checked.
        sender: the worker's name, for messages.

    Raises:
        UntrustedPickleError: the answer holds no value, bytes that do not decode, a dtype
            with no raw-bytes form, or a result that is not data (unless every worker is
            trusted: ``JAXDIST_COORDINATOR_TRUST_WORKER_PICKLES=1``); it names ``sender``.
    """
    if "array" in arrays:
        return np.array(arrays["array"])
    if "scalar" in arrays:
        return np.array(arrays["scalar"])[()]
    if "data" not in arrays:
        raise UntrustedPickleError(
            f"{sender or 'a worker'} answered with no value (arrays "
            f"{sorted(arrays)[:8]}): expected 'array', 'scalar' or 'data'", sender)
    if "pickle" in arrays and answer_codec.trusted():
        return answer_codec.loads_trusted(from_bytes_array(arrays["pickle"]))
    return answer_codec.decode(from_bytes_array(arrays["data"]), sender)


def group_answers(answers: Iterator[tuple[dict, dict]], count: int, group: int,
                  hold_seconds: float | None = None,
                  started: Callable[[], float] | None = None) -> Iterator[tuple[dict, dict]]:
    """The answers of a ``RunClosures`` batch of ``count`` closures, several to a message.

    An answer is held back while closures of the batch are still to run, at most ``group``
    answers to a message, and only while the next closure should end (if it takes as long as
    the last one) within ``hold_seconds`` (``GROUP_HOLD_SECONDS``) of the first held answer;
    an error, a refusal or a large result goes out at once with those held before it. A
    message is ``{ANSWERS_KEY: [meta, ...]}`` with the arrays of answer ``j`` named
    ``"<j>.<name>"``, or, when every answer is one array of the same name, dtype and shape
    (a loss), one array ``"*.<name>"`` that stacks them; ``split_answers`` inverts it.

    ``started()`` gives the ``time.monotonic()`` at which the closure just answered started
    (``WorkerService.closure_started``), so that a wait before it (the batch queued behind
    another) does not count as its duration; without it, the time since the previous answer.

    Example:
        >>> import numpy as np
        >>> from jaxdist._src.coordinator.worker_service import group_answers
        >>> answers = [({"ok": True}, {"value": np.float32(i)}) for i in range(3)]  # 3 losses
        >>> frames = list(group_answers((a for a in answers), len(answers), 8))  # a generator
        >>> len(frames), sorted(frames[0][1])                     # one message, one stack
        (1, ['*.value'])
    """
    hold = GROUP_HOLD_SECONDS if hold_seconds is None else hold_seconds
    held: list[tuple[dict, dict]] = []
    size, since = 0, 0.0
    last = time.monotonic()
    try:
        for done, (meta, arrays) in enumerate(answers, 1):
            now = time.monotonic()
            took, last = now - (last if started is None else started()), now
            if not held:
                since = now
            held.append((meta, arrays))
            size += sum(a.nbytes for a in arrays.values())
            if (len(held) >= group or done >= count or not meta.get("ok")
                    or size > GROUP_MAX_BYTES or now + took - since > hold):
                yield _grouped(held)
                held, size = [], 0
                last = time.monotonic()  # the send is not the next closure's time
        if held:  # the caller went away mid-batch: what ran is still answered
            yield _grouped(held)
    finally:
        answers.close()


def _grouped(held: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    metas = [meta for meta, _ in held]
    first = held[0][1]
    if len(held) > 1 and len(first) == 1:
        # The common case, a loss per closure: one array of every answer's value stacked
        # ("*.<name>"), not one array each (each costs a spec, a MAC entry and a check).
        (name, arr), = first.items()
        if all(len(a) == 1 and name in a and a[name].dtype == arr.dtype
               and a[name].shape == arr.shape for _, a in held):
            return {ANSWERS_KEY: metas}, {f"*.{name}": np.stack([a[name] for _, a in held])}
    arrays = {f"{j}.{name}": arr for j, (_, a) in enumerate(held) for name, arr in a.items()}
    return {ANSWERS_KEY: metas}, arrays


def split_answers(meta: dict, arrays: dict, most: int) -> list[tuple[dict, dict]]:
    """The answers a grouped ``RunClosures`` message carries (``group_answers``' inverse).

    Raises:
        ValueError: not a list of 1 to ``most`` answer dicts, or an array that belongs to
            none of them.
    """
    metas = meta.get(ANSWERS_KEY)
    if not isinstance(metas, list) or not 1 <= len(metas) <= most or not all(
            isinstance(m, dict) for m in metas):
        raise ValueError(f"expected {ANSWERS_KEY!r}: a list of 1 to {most} answers, got "
                         f"{str(metas)[:100]}")
    out: list[tuple[dict, dict]] = [(m, {}) for m in metas]
    for key, arr in arrays.items():
        index, dot, name = key.partition(".")
        if dot and index == "*":  # one value per answer, stacked
            if arr.ndim < 1 or arr.shape[0] != len(out):
                raise ValueError(f"array {key[:80]!r} of shape {arr.shape} does not stack "
                                 f"one value for each of the {len(out)} answers")
            for j, (_, answer) in enumerate(out):
                answer[name] = arr[j]
            continue
        if not (dot and index.isdigit() and int(index) < len(out)):
            raise ValueError(f"array {key[:80]!r} belongs to none of the {len(out)} answers")
        out[int(index)][1][name] = arr
    return out


def error_arrays(e: BaseException) -> dict[str, np.ndarray]:
    """An exception's answer arrays: ``"error"`` in ``answer_codec``'s format (its type's
    names, args and attributes as data), and, for a type the chief does not rebuild, its
    cloudpickle (``"error_pickle"``) for a chief that trusts every worker."""
    out = {"error": to_bytes_array(answer_codec.encode(e))}
    if answer_codec.exception_type(type(e).__module__, type(e).__qualname__) is None:
        try:
            payload = cloudpickle.dumps(e)
            pickle.loads(payload)
            out["error_pickle"] = to_bytes_array(payload)
        except Exception:  # noqa: BLE001 - the data form is enough
            pass
    return out


class WorkerService:
    """Executes closures and builds resources for one worker task (transport-free).

    Args:
        runtime: the worker's runtime (strategy, resources, caches).
    """

    def __init__(self, runtime: WorkerRuntime):
        self.runtime = runtime
        self._task = runtime.name
        self.incarnation = runtime.incarnation or uuid.uuid4().hex
        runtime.incarnation = self.incarnation
        self._run_lock = threading.Lock()
        # One RunClosures batch at a time, whole, in each coordinator session's order.
        self._order = threading.Condition()
        self._batch_running = False
        self._last_seq: dict[str, int] = {}
        self._waiting: dict[str, set[int]] = {}
        self.busy = False
        self.closure_started = 0.0  # time.monotonic() when the last closure started
        self.stopped = threading.Event()
        self.functions_run = 0

    @property
    def task(self) -> str:
        return self._task

    def ping(self, meta: dict, arrays: dict) -> tuple[dict, dict]:
        return {"task": self.task, "incarnation": self.incarnation, "busy": self.busy,
                "functions_run": self.functions_run}, {}

    def _failure(self, kind: str, e: BaseException) -> tuple[dict, dict]:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        if kind == "user":  # the chief prints one line: the whole story is in this log
            log.warning("%s: a function failed (%s: %s):\n%s", self.task, type(e).__name__,
                        e, tb)
        meta = {"ok": False, "kind": kind, "type": type(e).__name__, "message": str(e),
                "traceback": tb[-8000:], "task": self.task, "incarnation": self.incarnation}
        return meta, error_arrays(e)

    def run_closure(self, meta: dict, arrays: dict,
                    active: Callable[[], bool] | None = None) -> tuple[dict, dict]:
        """Runs one closure (one at a time; ``active() == False``: the caller gave up on
        this call while it waited for the previous closure, so it is not run)."""
        with self._run_lock:
            if active is not None and not active():
                return {"ok": False, "kind": "cancelled", "task": self.task,
                        "incarnation": self.incarnation}, {}
            self.busy = True
            self.closure_started = time.monotonic()
            try:
                try:
                    fn = self._function(meta, arrays)
                    if fn is None:
                        return {"ok": False, "kind": "missing_function", "task": self.task,
                                "incarnation": self.incarnation}, {}
                    if RESOURCES_KEY in meta:  # the arguments are per-worker resources
                        args, kwargs = tuple(map(lookup_resource, meta[RESOURCES_KEY])), {}
                    else:
                        args, kwargs = closure_pickle.loads(from_bytes_array(arrays["args"]))
                except MissingResourceError as e:
                    return self._failure("missing_resource", e)
                except Exception as e:  # noqa: BLE001 - sent back to the coordinator
                    return self._failure("user", e)
                try:
                    value = _host_value(fn(*args, **kwargs))
                except MissingResourceError as e:
                    return self._failure("missing_resource", e)
                except Exception as e:  # noqa: BLE001 - sent back to the coordinator
                    return self._failure("user", e)
                self.functions_run += 1
                try:
                    out = value_arrays(value)
                except Exception as e:  # noqa: BLE001
                    return self._failure("user", TypeError(
                        f"the result of function #{meta.get('closure_id')} cannot be sent "
                        f"back: {type(e).__name__}: {e}"))
                return {"ok": True, "task": self.task, "incarnation": self.incarnation}, out
            finally:
                self.busy = False

    def batch_items(self, meta: dict, arrays: dict) -> list[tuple[dict, dict]]:
        """The ``(meta, arrays)`` of each closure of a ``RunClosures`` request.

        Raises:
            ValueError: the request is not a list of closures with their arguments.
        """
        items = meta.get(BATCH_KEY)
        if not isinstance(items, list) or not 1 <= len(items) <= MAX_BATCH_CLOSURES:
            raise ValueError(f"RunClosures needs {BATCH_KEY!r}: a list of 1 to "
                             f"{MAX_BATCH_CLOSURES} closures, got {str(items)[:100]}")
        out = []
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise ValueError(f"RunClosures closure {i}: expected a dict, got "
                                 f"{str(item)[:100]}")
            sub_meta = {"closure_id": item.get("closure_id"),
                        FN_DIGEST_KEY: item.get(FN_DIGEST_KEY)}
            if RESOURCES_KEY in item:
                ids = item[RESOURCES_KEY]
                if not isinstance(ids, list) or not 1 <= len(ids) <= MAX_RESOURCE_ARGS or any(
                        type(r) is not int for r in ids):
                    raise ValueError(f"RunClosures closure {i}: {RESOURCES_KEY!r} must be a "
                                     f"list of 1 to {MAX_RESOURCE_ARGS} resource ids, got "
                                     f"{str(ids)[:100]}")
                sub_meta[RESOURCES_KEY] = ids
                sub = {}
            elif f"args.{i}" in arrays:
                sub = {"args": arrays[f"args.{i}"]}
            else:
                raise ValueError(f"RunClosures closure {i}: expected array 'args.{i}' or "
                                 f"{RESOURCES_KEY!r}, got {str(item)[:100]}")
            if f"fn.{i}" in arrays:
                sub["fn"] = arrays[f"fn.{i}"]
            out.append((sub_meta, sub))
        return out

    def run_closures(self, items: list[tuple[dict, dict]],
                     active: Callable[[], bool] | None = None, session: str | None = None,
                     seq: int | None = None) -> Iterator[tuple[dict, dict]]:
        """Runs the closures of a batch in order, yielding each one's answer when it ends;
        stops when ``active()`` turns ``False`` (the caller cancelled the call).

        A batch runs whole before the next one starts (the coordinator's second call waits
        here behind the first). Calls of one coordinator ``session`` run in the order of
        their ``seq`` (the order it took their closures from its queue): a call that arrives
        before the one numbered just below it waits for it (up to ``ORDER_GRACE_SECONDS``,
        in case that call never comes). The batch's turn ends when the generator ends or is
        closed (gRPC drops it when the call ends).
        """
        if not self._enter(active, session, seq):
            return
        try:
            for meta, arrays in items:
                answer = self.run_closure(meta, arrays, active)
                if answer[0].get("kind") == "cancelled":
                    return  # the caller went away: nothing more starts
                yield answer
        finally:
            with self._order:
                self._batch_running = False
                self._order.notify_all()

    def _enter(self, active: Callable[[], bool] | None, session: str | None,
               seq: int | None) -> bool:
        """Waits for this batch's turn (see ``run_closures``); False: the caller went away."""
        ordered = isinstance(session, str) and isinstance(seq, int)
        with self._order:
            waiting = self._waiting.setdefault(session, set()) if ordered else None
            if waiting is not None:
                waiting.add(seq)
            grace = time.monotonic() + ORDER_GRACE_SECONDS
            try:
                while True:
                    if active is not None and not active():
                        return False
                    if not self._batch_running and (not ordered or (
                            not any(s < seq for s in waiting)
                            and (self._last_seq.get(session, -1) >= seq - 1
                                 or time.monotonic() >= grace))):
                        break
                    self._order.wait(0.05)
                self._batch_running = True
                if ordered:
                    self._last_seq[session] = max(self._last_seq.get(session, -1), seq)
                return True
            finally:
                if waiting is not None:
                    waiting.discard(seq)
                    if not waiting:
                        self._waiting.pop(session, None)

    def _function(self, meta: dict, arrays: dict) -> Any:
        """The function of a ``RunClosure``: unpickled from ``fn`` (then cached under its
        SHA-256), or the cached one named by ``fn_digest`` (``None`` when not cached)."""
        digest = meta.get(FN_DIGEST_KEY)
        if "fn" in arrays:
            payload = from_bytes_array(arrays["fn"])
            if digest is not None and digest != hashlib.sha256(payload).hexdigest():
                raise ValueError(f"{FN_DIGEST_KEY} {str(digest)[:80]!r} is not the SHA-256 of "
                                 f"the function sent with it")
            return self.runtime.cached_function(payload, closure_pickle.loads)
        if not isinstance(digest, str):
            raise ValueError(f"RunClosure needs the function ('fn') or its {FN_DIGEST_KEY}")
        return self.runtime.function_by_digest(digest)

    def create_resource(self, meta: dict, arrays: dict) -> tuple[dict, dict]:
        rid = int(meta["resource_id"])
        with self._run_lock:
            try:
                fn, args = closure_pickle.loads(from_bytes_array(arrays["fn"]))
                self.runtime.resources[rid] = fn(*args)
            except MissingResourceError as e:
                return self._failure("missing_resource", e)
            except Exception as e:  # noqa: BLE001 - sent back to the coordinator
                return self._failure("user", e)
        return {"ok": True, "incarnation": self.incarnation}, {}

    def stop(self, meta: dict, arrays: dict) -> tuple[dict, dict]:
        self.stopped.set()
        return {}, {}

    def handle(self, method: str, meta: dict, arrays: dict,
               active: Callable[[], bool] | None = None) -> tuple[dict, dict]:
        if method == "RunClosure":
            return self.run_closure(meta, arrays, active)
        table = {"Ping": self.ping, "CreateResource": self.create_resource, "Stop": self.stop}
        return table[method](meta, arrays)


class WorkerServer(GrpcTaskServer):
    """Serves a ``WorkerService`` over gRPC on ``address`` (loopback unless the spec says).

    Args:
        runtime: the worker runtime (made current for reference resolution).
        address: ``host:port`` from the cluster spec.
        coordinator: the worker's ``WorkerCredential`` (the chief's public key and this
            worker's answer key), or the coordinator token itself (tests; a worker that
            holds it could act as the chief); ``None`` reads TF_CONFIG
            ``"coordinator_public_key"`` and ``"coordinator_answer_key"`` /
            ``JAXDIST_COORDINATOR_PUBLIC_KEY`` and ``JAXDIST_COORDINATOR_ANSWER_KEY``.
            Required.
        max_workers: gRPC handler threads (pings are answered while a function runs).
        tls: the mutual-TLS identity; ``"insecure"`` for plaintext on loopback; ``None`` reads
            TF_CONFIG / the environment.
        direct_transport: also serve ``RunClosures`` on a second port over one authenticated
            socket per caller, no gRPC per call (``jaxdist._src.transport.direct``: the same TLS
            identity, a connection credential signed by the chief, every request signed);
            its port is in the ``Ping`` answer. ``None``: unless
            ``JAXDIST_COORDINATOR_DIRECT=0``. Its limits are the ps direct port's
            (``JAXDIST_PS_MAX_REQUEST_BYTES``: larger requests go over gRPC;
            ``JAXDIST_PS_MAX_CALL_SECONDS``: to receive a request, and to send each answer).
        connections: what connections may hold on both ports (default
            ``ConnectionLimits.from_env()``, see ``jaxdist._src.transport.connections``).

    Raises:
        ValueError: no coordinator credential configured.
        ClusterConfigError: a malformed credential, or only the coordinator token's SHA-256.
        TLSConfigError: no TLS material and plaintext not asked for.
    """

    def __init__(self, runtime: WorkerRuntime, address: str,
                 coordinator: WorkerCredential | str | None = None,
                 max_workers: int = 8, *, tls: TLSConfig | str | None = None,
                 direct_transport: bool | None = None,
                 connections: ConnectionLimits | None = None):
        credential = worker_credential(runtime.name, coordinator)
        if credential is None:
            raise ValueError(
                f"{runtime.name}: needs the coordinator's public key and its answer key "
                f"because a worker task runs the functions the chief signs: set TF_CONFIG "
                f"'coordinator_public_key' and 'coordinator_answer_key' (or "
                f"JAXDIST_COORDINATOR_PUBLIC_KEY and JAXDIST_COORDINATOR_ANSWER_KEY; "
                f"jaxdist._src.security.credentials.CoordinatorKeys(token).worker_env"
                f"({runtime.name!r}) computes them); python -m jaxdist.launch --coordinator "
                f"sets them")
        self._answer_key = credential.answer_key
        self.tls = resolve_tls(tls, runtime.name)
        self.service = WorkerService(runtime)
        self._verifier = RequestVerifier(credential, runtime.name, self.service.incarnation)
        set_current(runtime)
        self.connection_limits = connections or ConnectionLimits.from_env()
        self._server, self.address = bind_server(
            runtime.name, address, SERVICE_NAME, METHODS, self._make_handler, max_workers,
            "jaxdist-worker", tls=self.tls, connections=self.connection_limits)
        use_direct = direct_enabled() if direct_transport is None else direct_transport
        self.direct = DirectServer(
            runtime.name, self.address.rsplit(":", 1)[0], b"", self.tls,
            ServerLimits.from_env(), self._refuse_direct, self.service.incarnation,
            authenticate=self._direct_credential, stream=self._direct_stream,
            stream_methods=frozenset({"RunClosures"}), connections=self.connection_limits,
            # Only the chief's signed credential authenticates here: one peer, every slot.
            max_connections_per_peer=64) if use_direct else None
        self._init_lifecycle()

    def start(self):
        if self.direct is not None:
            self.direct.start()
        return super().start()

    def _mac(self, method: str, nonce: str, meta: dict, arrays: dict) -> dict:
        """``meta`` with this worker's MAC over the whole answer message."""
        return {**meta, MAC_KEY: answer_mac(self._answer_key, self.service.task, method, nonce,
                                            meta, arrays)}

    def _make_handler(self, method: str):
        def handler(request_iterator, context):
            arrived = self._verifier.clock()  # a request's age excludes its upload
            metadata = dict(context.invocation_metadata() or ())
            auth = metadata.get(AUTH_METADATA_KEY)
            if auth is None:  # refused before a byte of the request is read
                refusal = request_refusal(self._verifier, method, None, {}, {}, metadata)
                context.abort(getattr(grpc.StatusCode, refusal.code), refusal.details)
            try:
                meta, arrays = wire.decode(request_iterator)
            except wire.WireError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{self.service.task} {method}: {type(e).__name__}: {e}")
            # Before any byte is unpickled.
            refusal = request_refusal(self._verifier, method, auth, meta, arrays, metadata,
                                      arrived)
            if refusal is not None:
                context.abort(getattr(grpc.StatusCode, refusal.code), refusal.details)
            if method == "RunClosures":
                yield from self._run_batch(meta, arrays, context)
                return
            try:
                out_meta, out_arrays = self.service.handle(method, meta, arrays,
                                                           context.is_active)
            except (KeyError, ValueError, TypeError) as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{self.service.task} {method}: {type(e).__name__}: {e}")
            nonce = meta.get(NONCE_KEY)
            if isinstance(nonce, str):
                if method == "Ping" and self.direct is not None:
                    # Larger requests go over gRPC (the client checks before sending).
                    out_meta = {**out_meta, "direct_port": self.direct.port,
                                "max_request_bytes": self.direct.limits.max_request_bytes}
                out_meta = self._mac(method, nonce, out_meta, out_arrays)
            if method == "Stop":
                threading.Thread(target=self.stop, args=(0.5,), daemon=True,
                                 name="jaxdist-worker-stop").start()
            yield from wire.encode(out_meta, out_arrays)

        return handler

    def _run_batch(self, meta: dict, arrays: dict, context):
        """``RunClosures``: one MAC'd answer message per closure, sent as each one ends."""
        try:
            answers = self._batch_answers(meta, arrays, context.is_active)
        except (KeyError, ValueError, TypeError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{self.service.task} RunClosures: {type(e).__name__}: {e}")
        try:
            for out_meta, out_arrays in answers:
                yield from wire.encode(out_meta, out_arrays)
        finally:
            answers.close()

    def _batch_answers(self, meta: dict, arrays: dict, active: Callable[[], bool]
                       ) -> Iterator[tuple[dict, dict]]:
        """The MAC'd answers of a ``RunClosures`` request, checked here before anything runs.

        Raises:
            KeyError / ValueError / TypeError: a malformed request.
        """
        nonce = meta.get(NONCE_KEY)
        if not isinstance(nonce, str):
            raise ValueError(f"RunClosures needs a {NONCE_KEY!r} string")
        items = self.service.batch_items(meta, arrays)
        group = meta.get(GROUP_KEY, 1)
        if type(group) is not int or not 1 <= group <= MAX_BATCH_CLOSURES:
            raise ValueError(f"RunClosures {GROUP_KEY!r} must be an int from 1 to "
                             f"{MAX_BATCH_CLOSURES}, got {str(group)[:40]}")
        answers = self.service.run_closures(items, active, meta.get(SESSION_KEY),
                                            meta.get(SEQ_KEY))
        if GROUP_KEY not in meta:
            return self._macd(answers, nonce)
        return self._macd(group_answers(answers, len(items), group,
                                        started=lambda: self.service.closure_started), nonce)

    def _macd(self, answers: Iterator[tuple[dict, dict]], nonce: str
              ) -> Iterator[tuple[dict, dict]]:
        try:
            for i, (out_meta, out_arrays) in enumerate(answers):
                yield self._mac("RunClosures", item_nonce(nonce, i), out_meta,
                                out_arrays), out_arrays
        finally:
            answers.close()  # the batch's turn ends with the call

    # ------------------------------------------------------------------ direct transport
    def _direct_credential(self, presented: Any) -> CallFailed | None:
        """A direct connection must present the chief's signed ``Connect`` credential for
        this worker and incarnation (checked before any byte of a request is read)."""
        if presented is None or presented == "":
            refusal = Refusal("UNAUTHENTICATED", f"{self.service.task} refused the connection: "
                                                 f"it carries no coordinator credential")
        else:
            refusal = self._verifier.check(CONNECT_METHOD, presented, body_digest({}, {}))
        return None if refusal is None else CallFailed(refusal.code, refusal.details)

    def _refuse_direct(self, method: str, meta: dict, arrays: dict) -> tuple[dict, dict]:
        raise CallFailed("UNIMPLEMENTED", f"{self.service.task}: method {method[:64]!r} is "
                                          f"served on gRPC only")

    def _direct_stream(self, method: str, meta: dict, arrays: dict,
                       active: Callable[[], bool]) -> Iterator[tuple[dict, dict]]:
        refusal = request_refusal(self._verifier, method, meta.get(AUTH_KEY), meta, arrays)
        if refusal is not None:
            raise CallFailed(refusal.code, refusal.details)
        try:
            return self._batch_answers(meta, arrays, active)
        except (KeyError, ValueError, TypeError) as e:
            raise CallFailed("INVALID_ARGUMENT", f"{self.service.task} RunClosures: "
                                                 f"{type(e).__name__}: {e}") from None

    _stop_wait_seconds = 1.0

    def _after_stop(self) -> None:
        if self.direct is not None:
            self.direct.stop()
        set_current(None)


__all__ = ["ANSWERS_KEY", "BATCH_KEY", "ENV_DIRECT", "FN_DIGEST_KEY", "GROUP_HOLD_SECONDS",
           "GROUP_KEY", "GROUP_MAX_BYTES", "MAC_KEY", "MAX_BATCH_CLOSURES", "MAX_RESOURCE_ARGS",
           "METHODS", "NONCE_KEY", "RAW_VALUE_BYTES", "RESOURCES_KEY", "SEQ_KEY", "SERVICE_NAME",
           "SESSION_KEY", "WorkerServer", "WorkerService", "answer_value", "direct_enabled",
           "error_arrays", "group_answers", "item_nonce", "request_refusal", "split_answers",
           "value_arrays"]
