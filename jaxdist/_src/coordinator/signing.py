"""Signed requests to the worker tasks, and answers MAC'd with a per-worker key.

The right to run code on a worker belongs to the chief alone, and nothing the chief sends a
worker lets that worker (or anyone who watches it) run code elsewhere:

* **Requests** carry an ``auth`` object (gRPC metadata ``x-jaxdist-coordinator-auth`` as
  JSON, or the ``"auth"`` key of a direct-port request's meta, and the direct port's
  connection credential): the chief's Ed25519 signature (``CoordinatorKeys``) over the
  target task's name (``"worker:1"``), the worker process's incarnation, the method, the
  chief's session (a random id and its start time), a per-worker counter, the time the
  request was signed (the chief's clock) and the SHA-256 of the request's meta and arrays.
  A worker checks the signature with the chief's public key, then that the request names it
  and its incarnation (a restarted worker refuses requests signed for its predecessor with
  ``ABORTED``), then that it was signed at most ``max_age`` seconds before it arrived and
  not in the future (both give or take ``clock_skew``), then that the counter is new for
  that session (``ReplayGuard``: a replayed request is refused), all before anything is
  unpickled. A request captured at one worker is refused by every other (it names the
  first), by the same worker (replay) or its next incarnation, and by every worker once it
  is older than ``max_age``. The chief signs each request as it sends it (a retry is signed
  again), so a request's age is the time it spends on the way.
* **Answers** carry a MAC keyed with the worker's own answer key over the worker's name,
  the method, the chief's per-call nonce (and the message's place in the call), the answer's
  meta (every field) and its arrays (names, dtypes, shapes, bytes). A worker holds only its
  own key, so it cannot answer in another worker's name.

Example:
    >>> from jaxdist._src.coordinator.signing import RequestSigner, RequestVerifier, body_digest
    >>> from jaxdist.coordinator import CoordinatorKeys
    >>> keys = CoordinatorKeys("c0")
    >>> signer = RequestSigner(keys, ["worker:0"])
    >>> auth = signer.sign(0, "inc-1", "Ping", {"nonce": "n"}, {})
    >>> guard = RequestVerifier(keys.worker_credential("worker:0"), "worker:0", "inc-1")
    >>> guard.check("Ping", auth, body_digest({"nonce": "n"}, {})) is None
    True
    >>> guard.check("Ping", auth, body_digest({"nonce": "n"}, {})).code   # replayed
    'UNAUTHENTICATED'
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxdist._src.security.credentials import CoordinatorKeys, WorkerCredential

#: A direct-port request's meta key holding the request's ``auth``.
AUTH_KEY = "auth"
#: The gRPC metadata key holding a request's ``auth`` (JSON).
AUTH_METADATA_KEY = "x-jaxdist-coordinator-auth"
#: The answer meta key holding the worker's MAC.
MAC_KEY = "mac"
#: The method name a direct-port connection's credential is signed for.
CONNECT_METHOD = "Connect"
#: Counters more than this far below the highest seen in a session are refused as too old.
REPLAY_WINDOW = 4096
#: Sessions a worker remembers; the oldest is forgotten past this, and sessions started
#: before a forgotten one are refused from then on.
MAX_SESSIONS = 64
#: The environment variable of the oldest request a worker accepts, in seconds.
ENV_MAX_AGE = "JAXDIST_COORDINATOR_REQUEST_MAX_AGE"
#: The environment variable of the clock difference tolerated between chief and worker.
ENV_CLOCK_SKEW = "JAXDIST_COORDINATOR_CLOCK_SKEW"
#: A request signed longer ago than this (plus the skew) when it arrives is refused.
DEFAULT_MAX_AGE_SECONDS = 300.0
#: How far the chief's clock may be off the worker's, either way.
DEFAULT_CLOCK_SKEW_SECONDS = 30.0
_REQUEST_DOMAIN = "jaxdist-worker-request-v2"
_ANSWER_DOMAIN = b"jaxdist-worker-answer-v1\0"
_ONE_SHOT_MAC_BYTES = 64 << 10


def _canonical(meta: dict, drop: str) -> bytes:
    return json.dumps({k: v for k, v in meta.items() if k != drop}, sort_keys=True,
                      separators=(",", ":"), allow_nan=True).encode()


def _array_parts(arrays: dict) -> tuple[list[Any], int]:
    parts: list[Any] = []
    size = 0
    for name in sorted(arrays):
        data = np.ascontiguousarray(arrays[name])
        parts.append(f"\0{name}:{data.dtype.str}:{data.shape}:{data.nbytes}\0".encode())
        parts.append(memoryview(data).cast("B"))
        size += data.nbytes
    return parts, size


def body_digest(meta: dict, arrays: dict) -> str:
    """The SHA-256 (hex) a request's signature covers: its meta (every key but ``auth``, as
    canonical JSON) and its arrays (names, dtypes, shapes and bytes, sorted by name).

    Example:
        >>> from jaxdist._src.coordinator.signing import body_digest
        >>> body_digest({"a": 1}, {}) == body_digest({"a": 1, "auth": {}}, {})
        True
    """
    h = hashlib.sha256(_canonical(meta, AUTH_KEY))
    parts, _ = _array_parts(arrays)
    for part in parts:
        h.update(part)
    return h.hexdigest()


def _request_message(task: str, incarnation: str, method: str, session: str, started: int,
                     counter: int, issued: int, digest: str) -> bytes:
    return json.dumps([_REQUEST_DOMAIN, task, incarnation, method, session, started, counter,
                       issued, digest], separators=(",", ":")).encode()


class RequestSigner:
    """The chief's signer of requests to the tasks ``names`` (one session, one counter per
    task).

    Args:
        keys: the chief's ``CoordinatorKeys``.
        names: the tasks' names, by index (``["worker:0", "worker:1"]``).

    Attributes:
        clock: the wall clock a request's issue time is read from (``time.time_ns``).
    """

    def __init__(self, keys: CoordinatorKeys, names: Sequence[str]):
        self._keys = keys
        self._names = list(names)
        self.clock: Callable[[], int] = time.time_ns
        self.session = secrets.token_hex(16)
        self.started = time.time_ns()
        self._counters = [0] * len(self._names)
        self._lock = threading.Lock()

    def sign(self, task: int, incarnation: str, method: str, meta: dict,
             arrays: dict) -> dict:
        """The ``auth`` of a request to task ``task`` (its current ``incarnation``)."""
        return self.sign_digest(task, incarnation, method, body_digest(meta, arrays))

    def sign_digest(self, task: int, incarnation: str, method: str, digest: str) -> dict:
        """The ``auth`` of a request whose ``body_digest`` is ``digest``, issued now."""
        with self._lock:
            self._counters[task] += 1
            counter = self._counters[task]
        issued = int(self.clock())
        message = _request_message(self._names[task], incarnation, method, self.session,
                                   self.started, counter, issued, digest)
        return {"s": self.session, "t": self.started, "n": counter, "at": issued,
                "i": incarnation, "sig": self._keys.sign(message).hex()}

    def answer_key(self, task: int) -> bytes:
        """The key task ``task``'s answers are MAC'd with."""
        return self._keys.answer_key(self._names[task])


@dataclass(frozen=True)
class Refusal:
    """Why a request was refused: a ``grpc.StatusCode`` name and a message."""

    code: str
    details: str


class ReplayGuard:
    """Which (session, counter) pairs a worker has accepted: each at most once.

    A session's counters may arrive a little out of order (several calls in flight): a
    counter is accepted once, and only while it is within ``window`` of the highest seen in
    its session. At most ``max_sessions`` sessions are remembered; forgetting one raises the
    floor below which a session's start time is refused, so a forgotten session cannot be
    replayed either.

    Example:
        >>> from jaxdist._src.coordinator.signing import ReplayGuard
        >>> g = ReplayGuard()
        >>> g.admit("s", 5, 1), g.admit("s", 5, 1)
        (None, 'counter 1 of this session was already used (a replayed request)')
    """

    def __init__(self, window: int = REPLAY_WINDOW, max_sessions: int = MAX_SESSIONS):
        self.window, self.max_sessions = window, max_sessions
        self._sessions: dict[str, list[Any]] = {}  # session -> [started, highest, seen]
        self._floor = -1
        self._lock = threading.Lock()

    def admit(self, session: str, started: int, counter: int) -> str | None:
        """``None`` when (``session``, ``counter``) is new (it is then used up); else why not."""
        with self._lock:
            state = self._sessions.get(session)
            if state is None:
                if started <= self._floor:
                    return (f"session {session[:40]!r} started before the oldest one this "
                            f"worker has forgotten (a replayed or stale request)")
                state = self._sessions[session] = [started, 0, set()]
                if len(self._sessions) > self.max_sessions:
                    oldest = min(self._sessions, key=lambda s: self._sessions[s][0])
                    self._floor = max(self._floor, self._sessions.pop(oldest)[0])
                    if oldest == session:
                        return (f"session {session[:40]!r} is older than the "
                                f"{self.max_sessions} this worker remembers")
            if state[0] != started:
                return f"session {session[:40]!r} was given another start time"
            _, highest, seen = state
            if counter <= highest - self.window:
                return (f"counter {counter} is more than {self.window} below the highest of "
                        f"this session ({highest}): too old")
            if counter in seen:
                return f"counter {counter} of this session was already used (a replayed request)"
            seen.add(counter)
            if counter > highest:
                state[1] = counter
                if len(seen) > 2 * self.window:
                    state[2] = {c for c in seen if c > counter - self.window}
            return None


def _env_seconds(name: str, default: float) -> float:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ValueError(f"{name}={text!r}: expected a number of seconds >= 0 "
                         f"(default {default:g})")
    return value


def request_max_age() -> tuple[float, float]:
    """``(max_age, clock_skew)`` in seconds: ``JAXDIST_COORDINATOR_REQUEST_MAX_AGE`` (300)
    and ``JAXDIST_COORDINATOR_CLOCK_SKEW`` (30), else the defaults.

    Raises:
        ValueError: a variable is not a number of seconds >= 0 (it is named).

    Example:
        >>> from jaxdist._src.coordinator.signing import request_max_age
        >>> request_max_age()
        (300.0, 30.0)
    """
    return (_env_seconds(ENV_MAX_AGE, DEFAULT_MAX_AGE_SECONDS),
            _env_seconds(ENV_CLOCK_SKEW, DEFAULT_CLOCK_SKEW_SECONDS))


class RequestVerifier:
    """A worker's check of the requests it is sent (see the module docstring).

    Args:
        credential: the worker's ``WorkerCredential`` (the chief's public key).
        task: this worker's name (``"worker:0"``).
        incarnation: this worker process's incarnation.
        max_age: the oldest request accepted, in seconds from its signing to its arrival
            (``None``: ``request_max_age()``, from the environment).
        clock_skew: how far the chief's clock may differ from this worker's, in seconds,
            either way (``None``: from the environment).

    Attributes:
        clock: this worker's wall clock (``time.time_ns``).

    Raises:
        ValueError: a bad ``JAXDIST_COORDINATOR_REQUEST_MAX_AGE`` / ``_CLOCK_SKEW``.
    """

    def __init__(self, credential: WorkerCredential, task: str, incarnation: str,
                 max_age: float | None = None, clock_skew: float | None = None):
        self._credential, self.task, self.incarnation = credential, task, incarnation
        self.replay = ReplayGuard()
        env_age, env_skew = request_max_age()
        self.max_age = env_age if max_age is None else float(max_age)
        self.clock_skew = env_skew if clock_skew is None else float(clock_skew)
        self.clock: Callable[[], int] = time.time_ns

    def check(self, method: str, auth: Any, digest: str,
              arrived: int | None = None) -> Refusal | None:
        """``None`` when ``auth`` is the chief's fresh signature of this request to this
        worker (``method``, ``digest`` = ``body_digest``); else the ``Refusal``.

        ``Ping`` may be signed for any incarnation (it is how the chief learns it).
        ``arrived``: when the request arrived (``clock()`` nanoseconds; default: now).
        """
        fields = _auth_fields(auth)
        if fields is None:
            return Refusal("UNAUTHENTICATED", f"{self.task} refused {method}: the request "
                           f"carries no well-formed coordinator signature")
        session, started, counter, issued, incarnation, signature = fields
        message = _request_message(self.task, incarnation, method, session, started, counter,
                                   issued, digest)
        if not self._credential.verify(signature, message):
            return Refusal("UNAUTHENTICATED", f"{self.task} refused {method}: the coordinator "
                           f"signature does not match (not signed by the chief, signed for "
                           f"another task or method, or the request was altered)")
        if incarnation != self.incarnation and method != "Ping":
            return Refusal("ABORTED", f"{self.task} refused {method}: it was signed for "
                           f"incarnation {incarnation[:40]!r}, this process is "
                           f"{self.incarnation!r} (the worker restarted)")
        reason = self._age_refusal(issued, self.clock() if arrived is None else arrived)
        if reason is None:
            reason = self.replay.admit(session, started, counter)
        if reason is not None:
            return Refusal("UNAUTHENTICATED", f"{self.task} refused {method}: {reason}")
        return None

    def _age_refusal(self, issued: int, arrived: int) -> str | None:
        age = (arrived - issued) / 1e9
        if age > self.max_age + self.clock_skew:
            return (f"it was signed {age:.1f} s before it arrived (by the chief's clock), "
                    f"more than the {self.max_age:g} s a request may take (+ {self.clock_skew:g}"
                    f" s clock skew): a delayed or relayed request, or the two hosts' clocks "
                    f"differ (synchronise them, or raise {ENV_MAX_AGE} / {ENV_CLOCK_SKEW} on "
                    f"the worker)")
        if age < -self.clock_skew:
            return (f"it was signed {-age:.1f} s in the future (by the chief's clock), more "
                    f"than the {self.clock_skew:g} s clock skew tolerated: the two hosts' "
                    f"clocks differ (synchronise them, or raise {ENV_CLOCK_SKEW} on the "
                    f"worker)")
        return None


def _auth_fields(auth: Any) -> tuple[str, int, int, int, str, bytes] | None:
    if isinstance(auth, str):
        try:
            auth = json.loads(auth)
        except ValueError:
            return None
    if not isinstance(auth, dict):
        return None
    session, started, counter = auth.get("s"), auth.get("t"), auth.get("n")
    issued, incarnation, sig = auth.get("at"), auth.get("i"), auth.get("sig")
    if not (isinstance(session, str) and len(session) <= 64 and type(started) is int
            and type(counter) is int and counter > 0 and type(issued) is int
            and isinstance(incarnation, str)
            and len(incarnation) <= 64 and isinstance(sig, str) and len(sig) == 128):
        return None
    try:
        signature = bytes.fromhex(sig)
    except ValueError:
        return None
    return session, started, counter, issued, incarnation, signature


def answer_mac(key: bytes, task: str, method: str, nonce: str, meta: dict,
               arrays: dict) -> str:
    """HMAC-SHA256 of one answer message: the worker's name, the method, ``nonce`` (the
    chief's per-call nonce, ``"<nonce>/<i>"`` for message ``i`` of a stream), every field of
    ``meta`` but ``"mac"`` (canonical JSON) and the arrays (names, dtypes, shapes and bytes).

    Example:
        >>> from jaxdist._src.coordinator.signing import answer_mac
        >>> mac = answer_mac(b"k" * 32, "worker:0", "Ping", "n", {"ok": True}, {})
        >>> mac == answer_mac(b"k" * 32, "worker:0", "Ping", "n", {"ok": False}, {})
        False
    """
    parts: list[Any] = [_ANSWER_DOMAIN, f"{task}\0{method}\0{nonce}\0".encode(),
                        _canonical(meta, MAC_KEY)]
    array_parts, size = _array_parts(arrays)
    parts += array_parts
    if size <= _ONE_SHOT_MAC_BYTES:  # a small answer (a loss): one C call, the same MAC
        return hmac.digest(key, b"".join(parts), "sha256").hex()
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.hexdigest()


__all__ = ["AUTH_KEY", "AUTH_METADATA_KEY", "CONNECT_METHOD", "DEFAULT_CLOCK_SKEW_SECONDS",
           "DEFAULT_MAX_AGE_SECONDS", "ENV_CLOCK_SKEW", "ENV_MAX_AGE", "MAC_KEY",
           "MAX_SESSIONS", "REPLAY_WINDOW", "Refusal", "ReplayGuard", "RequestSigner",
           "RequestVerifier", "answer_mac", "body_digest", "request_max_age"]
