"""jaxdist owns SIGTERM: a preemption notice on any process stops every process at one step.

``PreemptionWatcher`` is this process's one listener for termination notices: SIGTERM (its
Python handler), a platform's watcher function (``TerminationConfig.termination_watcher_fn``)
and, in a multi-process job, a notice any other process published in JAX's coordination
service. A training loop asks it at every step boundary, before starting a step:
``should_stop(step)``; the answer is True at the same step on every process, and the loop then
saves that step's checkpoint (the chief writes, the others wait: ``finish``) and exits with the
restart code.

The agreement ("the next step none has started"):

1. a process that receives a notice publishes it (first writer wins) under
   ``jaxdist/preemption/notice``; every process's listener thread polls that key (every
   ``POLL_SECONDS``) and so learns of it within a fraction of a second, without any help from
   its training thread;
2. each listener then, under the lock the training thread takes to start a step, reads the
   first step its process has not started, promises not to start it (``stop_at``) and
   publishes it as ``promise/<process id>``;
3. each listener reads every process's promise (bounded by the grace period); the agreed step is
   their maximum: no process started it, and every process can reach it, since the steps below
   it were started by the process that promised it and need only the others to join them. The
   listener raises ``stop_at`` to it; a training thread waiting at its own promise continues.

A single process has no one to agree with: the agreed step is its own next one. No step is
lost beyond the one in flight; the checkpoint holds every step before the agreed one.

The watcher never leaves SIGTERM unanswered: while no training loop consumes notices
(``consume``), a SIGTERM ends the process as the default action does; a second SIGTERM, or the
grace period running out before the exit, ends it at once with the restart code and one line.
JAX's own preemption service (XLA's notifier, which caught SIGTERM and told nobody) is not
started (``jaxdist._src.distributed.runtime``).

Example:
    >>> from jaxdist import TerminationConfig
    >>> from jaxdist._src.distributed.preemption import PreemptionWatcher
    >>> watcher = PreemptionWatcher(TerminationConfig(grace_period=10))
    >>> watcher.should_stop(0), watcher.should_stop(1)
    (False, False)
    >>> watcher.notice("a test")          # what SIGTERM does
    >>> watcher.wait_for_agreement(5.0)
    2
    >>> watcher.should_stop(2)
    True
    >>> watcher.close()
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from jaxdist._src.compat import jax_internals
from jaxdist._src.distributed import bringup
from jaxdist._src.distributed.runtime import write_line
from jaxdist._src.distributed.termination import TerminationConfig, TerminationConfigError

log = logging.getLogger(__name__)

#: How often a listener looks for a notice in the coordination service, and for its own.
POLL_SECONDS = 0.1
#: How often a ``termination_watcher_fn`` is called (TF calls it every second).
WATCHER_POLL_SECONDS = 1.0
#: The longest one wait inside the coordination service's client lasts on the listener thread:
#: a thread blocked in there cannot be joined, and one still in there when the interpreter exits
#: aborts the process ("terminate called ... FATAL: exception not rethrown", exit -6), so the
#: listener waits for its peers in pieces and ``close()`` stops it between two.
WAIT_PIECE_SECONDS = 0.5
#: Seconds past a timed-out wait for agreement that the training thread still waits for the
#: listener's verdict (which names the silent peer).
VERDICT_SECONDS = 1.0
_PREFIX = "jaxdist/preemption/"
_NOTICE_KEY = _PREFIX + "notice"
_SAVED_KEY = _PREFIX + "saved"


class PreemptionError(RuntimeError):
    """The processes could not agree on the step to stop at (a peer did not answer within the
    grace period), or the chief's preemption checkpoint failed."""


class _Peers:
    """The coordination service's key-value store, as the agreement uses it."""

    def __init__(self, client: Any, process_id: int, num_processes: int, names: list[str]):
        self.client, self.process_id, self.num_processes = client, process_id, num_processes
        self.names = names

    def publish(self, key: str, value: str) -> None:
        """Sets ``key`` unless it is set already (the first writer wins)."""
        try:
            self.client.key_value_set(key, value)
        except Exception as e:  # noqa: BLE001 - ALREADY_EXISTS: another process was first
            if "ALREADY_EXISTS" not in str(e) and "already exists" not in str(e).lower():
                raise

    def peek(self, key: str) -> str | None:
        """``key``'s value, or ``None`` while it is not set (never waits)."""
        try:
            return self.client.key_value_try_get(key)
        except Exception as e:  # noqa: BLE001 - NOT_FOUND; anything else is the service's
            if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
                return None
            raise

    def wait(self, key: str, timeout: float, stop: threading.Event | None = None) -> str | None:
        """``key``'s value once set, or ``None`` after ``timeout`` seconds; with ``stop``, also
        ``None`` soon after ``stop`` is set (the wait is made of ``WAIT_PIECE_SECONDS`` pieces)."""
        deadline = time.monotonic() + timeout
        while True:
            piece = timeout if stop is None else min(deadline - time.monotonic(),
                                                     WAIT_PIECE_SECONDS)
            try:
                return self.client.blocking_key_value_get(key, max(1, int(piece * 1000)))
            except Exception as e:  # noqa: BLE001 - DEADLINE_EXCEEDED, or the service is gone
                message = str(e).splitlines()[0] if str(e) else repr(e)
                if ("DEADLINE_EXCEEDED" not in message or stop is None or stop.is_set()
                        or time.monotonic() >= deadline):
                    log.info("waiting for %s: %s", key, message)
                    return None


def _peers() -> _Peers | None:
    """The key-value store of the joined multi-process group, or ``None`` (one process)."""
    group = bringup.current_group()
    if group is None or not group.multi_process or group.process_id is None:
        return None
    client = jax_internals.distributed_module().global_state.client
    if client is None:
        return None
    names = [group.task_name(i) for i in range(group.num_processes)]
    return _Peers(client, group.process_id, group.num_processes, names)


def _this_task() -> tuple[str, bool]:
    """This process's task name and whether it writes checkpoints (the chief)."""
    group = bringup.current_group()
    if group is None or not group.multi_process or group.process_id is None:
        return "this process", True
    return group.task_name(group.process_id), bool(group.is_chief)


class PreemptionWatcher:
    """Listens for termination notices and agrees with the other processes where to stop.

    Args:
        config: the ``TerminationConfig`` (grace period, watcher function, exit).
        clock: a monotonic clock (tests).
        peers: ``fn() -> _Peers | None``: the other processes (default: the joined group's
            coordination service; tests give a store of their own).
        task: ``fn() -> (task name, is chief)`` (default: the joined group's).
        hard_exit: ends the process at once (``os._exit``; tests record instead).

    Example:
        >>> from jaxdist import TerminationConfig
        >>> from jaxdist._src.distributed.preemption import PreemptionWatcher
        >>> watcher = PreemptionWatcher(TerminationConfig())
        >>> watcher.should_stop(0)
        False
        >>> watcher.close()
    """

    def __init__(self, config: TerminationConfig | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 peers: Callable[[], _Peers | None] | None = None,
                 task: Callable[[], tuple[str, bool]] | None = None,
                 hard_exit: Callable[[int], Any] = os._exit):
        self.config = config or TerminationConfig()
        self._clock = clock
        self._peers = peers or _peers
        self._task = task or _this_task
        self._hard_exit = hard_exit
        self._lock = threading.Lock()
        self._next = 0                    # the first step this process has not started
        self._stop_at: int | None = None  # this process starts no step >= this
        self._agreed: int | None = None   # the step every process stops at
        self._agreed_event = threading.Event()
        self._error: str | None = None
        self._own = threading.Event()     # this process received a notice
        self._noticed_at: float | None = None
        self.notice_from: str | None = None   # the task that received the notice
        self.reason: str | None = None
        self._closed = threading.Event()
        self._consumers = 0
        self._signals = 0
        self._grace_timer: threading.Timer | None = None
        self._thread = threading.Thread(target=self._listen, name="jaxdist-preemption",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ notices
    def notice(self, reason: str = "SIGTERM") -> None:
        """This process received a termination notice (the SIGTERM handler calls this)."""
        if self.reason is None:
            self.reason = reason
        self._own.set()

    @property
    def noticed(self) -> bool:
        """Some process of the job received a notice (known here)."""
        return self._noticed_at is not None

    @property
    def agreed_step(self) -> int | None:
        """The step every process stops at, once agreed."""
        return self._agreed

    def _listen(self) -> None:
        next_watch = self._clock()
        fn = self.config.termination_watcher_fn
        while not self._closed.is_set():
            if self._own.wait(POLL_SECONDS):
                break
            try:
                peers = self._peers()
                if peers is not None and peers.peek(_NOTICE_KEY) is not None:
                    break
                if fn is not None and self._clock() >= next_watch:
                    next_watch = self._clock() + WATCHER_POLL_SECONDS
                    if fn():
                        self.notice("the termination watcher")
                        break
            except Exception as e:  # noqa: BLE001 - the service is unreachable right now:
                # keep listening (this process's own notice still counts; the agreement then
                # fails loudly, within the grace period, if the service stays away)
                log.info("preemption listener: %s", str(e).splitlines()[0] if str(e) else e)
                self._closed.wait(1.0)
        if self._closed.is_set():
            return
        try:
            self._agree()
        except Exception as e:  # noqa: BLE001 - reported to the training thread
            self._fail(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

    def _fail(self, error: str) -> None:
        with self._lock:
            self._error = error
        self._agreed_event.set()

    def _agree(self) -> None:
        """Steps 1-3 of the module docstring, on the listener thread."""
        self._noticed_at = self._clock()
        self._start_grace_timer()
        me, _ = self._task()
        peers = self._peers()
        if self._own.is_set():
            self.notice_from = me
            if peers is not None:
                peers.publish(_NOTICE_KEY, f"{me}|{self.reason or 'notice'}")
        if peers is not None:
            first = peers.peek(_NOTICE_KEY)
            if first:  # the first process to publish names itself and its reason
                self.notice_from, _, reason = first.partition("|")
                self.reason = reason or self.reason
        with self._lock:
            promise = self._next
            self._stop_at = promise
        write_line(f"jaxdist: {me}: {self.reason or 'termination notice'} on "
                    f"{self.notice_from or me}: this process starts no step from {promise} on "
                    f"until the processes agree where to stop")
        if peers is None:
            agreed = promise
        else:
            peers.publish(f"{_PREFIX}promise/{peers.process_id}", str(promise))
            promises = []
            for q in range(peers.num_processes):
                value = peers.wait(f"{_PREFIX}promise/{q}", self.remaining(), self._closed)
                if value is None and self._closed.is_set():
                    return  # the process is leaving: nothing waits for the verdict
                if value is None:
                    raise PreemptionError(
                        f"{peers.names[q]} did not say where it stops within the "
                        f"{self.config.grace_period:g} s grace period (it may be lost)")
                promises.append(int(value))
            agreed = max(promises)
        with self._lock:
            self._stop_at = self._agreed = agreed
        self._agreed_event.set()

    def remaining(self) -> float:
        """Seconds left of the grace period (the whole period before any notice)."""
        if self._noticed_at is None:
            return self.config.grace_period
        return max(0.0, self.config.grace_period - (self._clock() - self._noticed_at))

    # ------------------------------------------------------------------ the training thread
    def should_stop(self, step: int, count: int = 1) -> bool:
        """Called before starting steps ``[step, step + count)``: True when the process must
        stop here (save this step's checkpoint and ``finish``), False when it may run them.

        Waits (at most the rest of the grace period) when this process reached its own promise
        before the processes agreed.

        Raises:
            PreemptionError: the processes did not agree within the grace period.
        """
        with self._lock:
            if self._stop_at is None or step < self._stop_at:
                self._next = step + count
                return False
        self.wait_for_agreement(self.remaining())
        with self._lock:
            if step < self._agreed:  # another process promised a later step
                self._next = step + count
                return False
        return True

    def wait_for_agreement(self, timeout: float) -> int:
        """Waits until the processes agreed; returns the agreed step.

        Raises:
            PreemptionError: no agreement within ``timeout`` seconds, or it failed.
        """
        # The listener waits on the same deadline and knows which peer stayed silent: past the
        # deadline it gets a moment to say so before the general message is raised.
        if not (self._agreed_event.wait(timeout) or self._agreed_event.wait(VERDICT_SECONDS)):
            raise PreemptionError(
                f"the processes did not agree on a step to stop at within {timeout:g} s of "
                f"the termination notice from {self.notice_from or 'a process'}")
        if self._error is not None:
            raise PreemptionError(f"preemption: {self._error}")
        assert self._agreed is not None
        return self._agreed

    def finish(self, step: int, save: Callable[[], Any] | None, is_chief: bool | None = None,
               what: str = "checkpoint") -> None:
        """After ``should_stop(step)``: the chief runs ``save``, the other processes wait for it
        (at most the rest of the grace period); then every process exits as configured.

        Args:
            step: the agreed step.
            save: writes the checkpoint of ``step`` (``None``: nothing to save).
            is_chief: whether this process saves (default: the chief of the joined group).
            what: what ``save`` writes, for the exit line.
        """
        me, chief = self._task()
        is_chief = chief if is_chief is None else is_chief
        peers = self._peers()
        outcome = f"no {what} was configured"
        if self.config.save_fn is not None and is_chief:
            save = self.config.save_fn
        if is_chief and save is not None:
            try:
                save()
                outcome = f"the {what} of step {step} is written"
            except BaseException as e:
                if peers is not None:
                    peers.publish(_SAVED_KEY, f"failed: {type(e).__name__}")
                raise
            if peers is not None:
                peers.publish(_SAVED_KEY, str(step))
        elif peers is not None and save is not None:
            value = peers.wait(_SAVED_KEY, self.remaining())
            if value is None:
                outcome = (f"the chief did not report its {what} within the grace period; the "
                           f"job resumes from the last complete one")
            elif value.startswith("failed"):
                outcome = f"the chief's {what} of step {step} failed ({value[8:]})"
            else:
                outcome = f"the chief wrote the {what} of step {step}"
        self._cancel_grace_timer()
        write_line(
            f"jaxdist: {me}: preempted ({self.reason or 'notice'} on "
            f"{self.notice_from or me}); stopped before step {step}: {outcome}; exiting with "
            f"{self.config.exit_code} (restart the job to resume)")
        self.config.exit()

    # ------------------------------------------------------------------ consumers, signals
    @contextlib.contextmanager
    def consume(self) -> Iterator[PreemptionWatcher]:
        """A training loop that answers notices runs inside this (SIGTERM outside it ends the
        process as by default)."""
        with self._lock:
            self._consumers += 1
        try:
            yield self
        finally:
            with self._lock:
                self._consumers -= 1

    @property
    def consumed(self) -> bool:
        """A training loop answers notices right now."""
        return self._consumers > 0

    def on_sigterm(self, signum: int, frame: Any) -> None:
        """The SIGTERM handler (installed by ``install``)."""
        self._signals += 1
        if self._signals > 1:
            self.exit_now("a second SIGTERM")
            return
        if not self.consumed and not self.noticed:
            # No loop saves anything: end the process as SIGTERM's default action does.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.notice("SIGTERM")

    def exit_now(self, why: str) -> None:
        """Ends the process at once with the restart code and one line (no checkpoint)."""
        me, _ = self._task()
        stop = (f"before the checkpoint of step {self._agreed}" if self._agreed is not None
                else "without a checkpoint")
        write_line(f"jaxdist: {me}: {why}: exiting with {self.config.exit_code} at once, "
                    f"{stop}; restart the job to resume from its last checkpoint")
        self._hard_exit(self.config.exit_code)

    def _start_grace_timer(self) -> None:
        margin = min(2.0, 0.1 * self.config.grace_period)
        timer = threading.Timer(max(0.0, self.config.grace_period - margin),
                                self.exit_now, args=(
                                    f"the {self.config.grace_period:g} s grace period ran out",))
        timer.daemon = True
        self._grace_timer = timer
        timer.start()

    def _cancel_grace_timer(self) -> None:
        if self._grace_timer is not None:
            self._grace_timer.cancel()

    def close(self) -> None:
        """Stops listening (before the coordination service's client goes away).

        A process that leaves (its training ended, the exit hook closes the watcher) starts no
        step from its next one on, and says so: a notice that reached another process after
        this one ended agrees on where this one stopped instead of waiting out the grace
        period (TF's corner case of a notice at the end of training).
        """
        self._closed.set()
        self._cancel_grace_timer()
        self._promise_on_leaving()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * POLL_SECONDS + WAIT_PIECE_SECONDS + 1.0)

    def _promise_on_leaving(self) -> None:
        try:
            peers = self._peers()
            if peers is None:
                return
            with self._lock:
                step = self._next if self._stop_at is None else self._stop_at
            # a promise already made stays (the first writer wins)
            peers.publish(f"{_PREFIX}promise/{peers.process_id}", str(step))
        except Exception as e:  # noqa: BLE001 - the service is gone: nobody waits for it
            log.info("preemption watcher: no promise on leaving: %s",
                     str(e).splitlines()[0] if str(e) else e)


class DispatchTimer:
    """Checks a loop's grace period against its measured step time, at the start of training.

    The first dispatch compiles; the second is timed (``before`` ... ``after`` with the
    dispatch's outputs, which it waits for) and must take less than the grace period: a
    preempted process has to finish the dispatch in flight, reach the agreed step and save
    before the platform's SIGKILL.

    Example:
        >>> from jaxdist import TerminationConfig
        >>> from jaxdist._src.distributed.preemption import DispatchTimer
        >>> timer = DispatchTimer(TerminationConfig(grace_period=30))
        >>> for _ in range(3):
        ...     timer.before()
        ...     timer.after(None)
    """

    def __init__(self, config: TerminationConfig, clock: Callable[[], float] = time.perf_counter):
        self.config, self._clock = config, clock
        self.count = 0
        self._t0 = 0.0

    def before(self) -> None:
        if self.count < 2:
            self._t0 = self._clock()

    def after(self, outputs: Any, steps: int = 1) -> None:
        """After a dispatch of ``steps`` steps whose results are ``outputs``.

        Raises:
            TerminationConfigError: the grace period is shorter than the dispatch.
        """
        if self.count >= 2:
            return
        self.count += 1
        if self.count < 2:
            return
        import jax

        jax.block_until_ready(outputs)
        took = self._clock() - self._t0
        grace = self.config.grace_period
        if took >= grace:
            what = "one step" if steps == 1 else f"one dispatch of {steps} steps"
            raise TerminationConfigError(
                f"preemption grace period {grace:g} s is shorter than {what} of this "
                f"training loop ({took:.3g} s measured): a preempted job could not stop "
                f"and save before the platform's SIGKILL; expected a grace period of at "
                f"least {2 * took:.2g} s (preemption.grace_period, "
                f"TerminationConfig(grace_period=...)) or fewer steps_per_execution")


_installed: PreemptionWatcher | None = None
_install_lock = threading.Lock()


def install(config: TerminationConfig | None = None) -> PreemptionWatcher:
    """This process's watcher, created (and SIGTERM's handler installed) on the first call.

    A later call with a ``config`` replaces the configuration (grace period, exit, watcher
    function) while no notice has arrived. Only the main thread can install a signal handler:
    from another thread the watcher still listens to the other processes and the watcher
    function, and SIGTERM keeps its handler.

    Example:
        >>> from jaxdist import TerminationConfig
        >>> from jaxdist._src.distributed.preemption import install
        >>> watcher = install(TerminationConfig(grace_period=20))
        >>> watcher is install()
        True
    """
    global _installed
    with _install_lock:
        watcher = _installed
        if watcher is None or watcher._closed.is_set():
            watcher = _installed = PreemptionWatcher(config)
            bringup.add_shutdown_hook(watcher.close)
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, watcher.on_sigterm)
        elif config is not None and not watcher.noticed and config is not watcher.config:
            watcher.config = config
        return watcher


def installed() -> PreemptionWatcher | None:
    """The process's watcher, if ``install`` ran."""
    return _installed


def uninstall() -> None:
    """Closes the watcher and gives SIGTERM its default action back (tests)."""
    global _installed
    with _install_lock:
        watcher, _installed = _installed, None
    if watcher is not None:
        watcher.close()
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGTERM) == watcher.on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


__all__ = ["POLL_SECONDS", "DispatchTimer", "PreemptionError", "PreemptionWatcher", "install",
           "installed", "uninstall"]
