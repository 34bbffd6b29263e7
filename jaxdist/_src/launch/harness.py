"""The implementation of ``jaxdist.testing.LocalCluster``: a cluster of real processes for tests
(ports, TF_CONFIG, start / kill / restart, join).

Example:
    >>> import sys
    >>> from jaxdist.testing import LocalCluster
    >>> with LocalCluster(workers=2, devices_per_process=1) as c:
    ...     c.start([sys.executable, "-c", "import os; print(os.environ['TF_CONFIG'][:11])"])
    ...     codes = c.join(timeout=60)
    ...     print(codes, c.output("worker:1"))
    {'worker:0': 0, 'worker:1': 0} {"cluster":
"""

from __future__ import annotations

import re
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from typing import IO

from jaxdist._src.cluster.errors import ClusterTimeoutError
from jaxdist._src.cluster.validation import task_name
from jaxdist._src.launch.local import (
    TaskProcess,
    local_cluster,
    new_token,
    task_env,
    task_list,
)
from jaxdist._src.security.credentials import new_coordinator_token
from jaxdist._src.security.pki import LOOPBACK_NAMES, LocalPKI, apply_task_security, local_pki
from jaxdist._src.security.tls import TLSConfig

Command = Sequence[str] | Callable[[str, int], Sequence[str]]


class LocalCluster:
    """Real task processes on 127.0.0.1 with a correct ``TF_CONFIG`` each.

    Its tasks are stopped by ``stop()`` / ``close()``, and, at the latest, when the object
    goes or the program that made it exits (a notebook kernel after a failed cell).

    Args:
        workers: number of worker tasks.
        ps: number of parameter-server tasks.
        chief: add a chief task.
        evaluator: add an evaluator task.
        devices_per_process: forced CPU devices per process (``JAX_PLATFORMS=cpu`` is set).
        env: extra environment variables for every task.
        echo: a stream to copy prefixed output lines to (``None``: only collect them).
        cwd: working directory of the tasks.
        tls: mutual TLS between the tasks with a throwaway CA (default); ``False``: plaintext
            on loopback (``JAXDIST_INSECURE=1``).
        cluster: the cluster spec to use (``{"worker": ["host:port", ...], ...}``) instead of
            free ports on 127.0.0.1 (``jaxdist.testing.netns.NetnsCluster`` names its hosts').
        tls_hosts: the addresses the certificates are valid for (loopback by default).
        wrap: ``wrap(task, argv)`` is the command that runs ``argv`` as ``task`` (e.g. inside
            its host's network namespace); default: ``argv`` itself.

    Attributes:
        token: the cluster (ps) token every task holds.
        coordinator_token: the right to run code on the workers (the chief holds it; each
            worker holds the chief's public key and its own answer key).
        tls: the test process's own client identity (``TLSConfig``; ``"insecure"`` when
            plaintext), to build ``PSClient`` / ``WorkerClient`` in the test.
    """

    def __init__(self, workers: int = 2, ps: int = 0, chief: bool = False,
                 evaluator: bool = False, devices_per_process: int | None = 1,
                 env: dict[str, str] | None = None, echo: IO[str] | None = None,
                 cwd: str | None = None, tls: bool = True,
                 cluster: dict[str, list[str]] | None = None,
                 tls_hosts: Sequence[str] = LOOPBACK_NAMES,
                 wrap: Callable[[str, Sequence[str]], Sequence[str]] | None = None):
        self.cluster = cluster or local_cluster(workers, ps, chief, evaluator)
        self.token = new_token()
        self.coordinator_token = new_coordinator_token()
        self.pki: LocalPKI | None = (
            local_pki([task_name(j, i) for j, i in task_list(self.cluster)] + ["client"],
                      hosts=tls_hosts)
            if tls else None)
        self.tls: TLSConfig | str = self.pki.identities["client"] if self.pki else "insecure"
        if self.pki is not None:  # the keys go when the cluster object does, at the latest
            weakref.finalize(self, self.pki.cleanup)
        self.devices_per_process = devices_per_process
        self.extra_env = dict(env or {})
        self.echo = echo
        self.cwd = cwd
        self._wrap = wrap
        self.tasks: dict[str, TaskProcess] = {}
        # A program (a notebook's kernel) that ends without stop() (an error in a later cell)
        # still stops every task: when this object goes, or at interpreter exit.
        weakref.finalize(self, _stop_tasks, self.tasks)
        self._commands: dict[str, list[str]] = {}
        self.history: dict[str, list[TaskProcess]] = {}

    # ------------------------------------------------------------------ tasks
    @property
    def task_names(self) -> list[str]:
        return [task_name(j, i) for j, i in task_list(self.cluster)]

    def env_for(self, name: str) -> dict[str, str]:
        job, _, idx = name.partition(":")
        env = task_env(self.cluster, job, int(idx), self.token, self.devices_per_process)
        apply_task_security(env, job, int(idx), self.pki, self.coordinator_token)
        if self.devices_per_process:
            env.setdefault("JAX_PLATFORMS", "cpu")
        env.update(self.extra_env)
        return env

    def security_env(self, name: str) -> dict[str, str]:
        """Task ``name``'s TLS identity and coordinator credential as environment variables.

        A test that plays a task in its own process (e.g. the chief) applies them with
        ``os.environ.update(c.security_env("chief:0"))``.

        Example:
            >>> from jaxdist.testing import LocalCluster
            >>> import os
            >>> cluster = LocalCluster(workers=1, chief=True)
            >>> os.environ.update(cluster.security_env("chief:0"))
            >>> cluster.close()
        """
        self._check(name)
        job, _, idx = name.partition(":")
        return apply_task_security({}, job, int(idx), self.pki, self.coordinator_token)

    def _check(self, name: str) -> None:
        if name not in self.task_names:
            raise KeyError(f"no task {name!r} in this cluster; tasks: {self.task_names}")

    def start_task(self, name: str, command: Command | None = None) -> TaskProcess:
        """Starts (or restarts with the same command) one task."""
        self._check(name)
        if command is None:
            argv = self._commands[name]
        else:
            job, _, idx = name.partition(":")
            argv = list(command(job, int(idx)) if callable(command) else command)
        self._commands[name] = argv
        old = self.tasks.get(name)
        if old is not None and old.running():
            raise RuntimeError(f"{name} is still running (pid {old.pid}); kill it first")
        if self._wrap is not None:
            argv = list(self._wrap(name, argv))
        proc = TaskProcess(name, argv, self.env_for(name), echo=self.echo, cwd=self.cwd)
        self.tasks[name] = proc
        self.history.setdefault(name, []).append(proc)
        return proc

    def start(self, command: Command, tasks: Sequence[str] | None = None) -> None:
        """Starts ``command`` as every task (or the ``tasks`` named)."""
        for name in tasks or self.task_names:
            self.start_task(name, command)

    def kill(self, name: str, sig: int | None = None) -> None:
        """Kills one task (SIGKILL by default) and waits for it to be gone."""
        import signal as _signal

        t = self.tasks[name]
        t.signal(_signal.SIGKILL if sig is None else sig)
        if sig in (None, _signal.SIGKILL, _signal.SIGTERM):
            t.wait(10.0)

    def restart(self, name: str) -> TaskProcess:
        """Kills the task if it runs, then starts it again with the same command."""
        if name in self.tasks and self.tasks[name].running():
            self.kill(name)
        return self.start_task(name)

    # ------------------------------------------------------------------ results
    def output(self, name: str) -> str:
        """Everything the task printed (stdout and stderr, current run)."""
        return self.tasks[name].output

    def returncode(self, name: str) -> int | None:
        return self.tasks[name].returncode

    def wait_for_output(self, name: str, pattern: str, timeout: float) -> re.Match:
        """Waits until a line of ``name``'s output matches ``pattern``.

        Raises:
            ClusterTimeoutError: no match within ``timeout`` (or the task exited without one).
        """
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            t = self.tasks[name]
            for line in list(t.lines):
                m = rx.search(line)
                if m:
                    return m
            if not t.running() and t.wait(0.5) is not None:
                for line in list(t.lines):
                    m = rx.search(line)
                    if m:
                        return m
                break
            time.sleep(0.05)
        raise ClusterTimeoutError(
            f"{name} printed no line matching {pattern!r} within {timeout:g} s (exit code "
            f"{self.tasks[name].returncode}); output tail:\n{_tail(self.output(name))}",
            tasks=(name,), timeout_seconds=timeout,
        )

    def wait(self, name: str, timeout: float) -> int:
        """Waits for one task to exit; returns its exit code.

        Raises:
            ClusterTimeoutError: it still runs after ``timeout`` (it is left running).
        """
        code = self.tasks[name].wait(timeout)
        if code is None:
            raise ClusterTimeoutError(
                f"{name} did not exit within {timeout:g} s; output tail:\n"
                f"{_tail(self.output(name))}", tasks=(name,), timeout_seconds=timeout,
            )
        return code

    def join(self, timeout: float, tasks: Sequence[str] | None = None) -> dict[str, int]:
        """Waits for every started task (or ``tasks``); returns their exit codes.

        Raises:
            ClusterTimeoutError: some still run after ``timeout``; it names them (they are
                killed).
        """
        names = list(tasks or self.tasks)
        deadline = time.monotonic() + timeout
        codes: dict[str, int] = {}
        for name in names:
            code = self.tasks[name].wait(max(0.0, deadline - time.monotonic()))
            if code is not None:
                codes[name] = code
        late = [n for n in names if n not in codes]
        if late:
            tails = "\n".join(f"--- {n}:\n{_tail(self.output(n))}" for n in late)
            for n in late:
                self.tasks[n].kill()
            raise ClusterTimeoutError(
                f"tasks {late} did not exit within {timeout:g} s (killed):\n{tails}",
                tasks=tuple(late), timeout_seconds=timeout,
            )
        return codes

    def stop(self) -> None:
        """Stops every running task (SIGTERM, then SIGKILL)."""
        _stop_tasks(self.tasks)

    def describe(self) -> str:
        """Every task's exit code and output tail (for assertion messages)."""
        return "\n".join(
            f"--- {n} (exit {t.returncode}):\n{_tail(t.output)}" for n, t in self.tasks.items()
        )

    def __enter__(self) -> LocalCluster:
        return self

    def close(self) -> None:
        """Stops every task and deletes the generated keys."""
        self.stop()
        if self.pki is not None:
            self.pki.cleanup()

    def __exit__(self, *exc) -> None:
        self.close()


def _stop_tasks(tasks: dict[str, TaskProcess]) -> None:
    """Stops the tasks still running (SIGTERM, then SIGKILL after 3 s)."""
    running = [t for t in tasks.values() if t.running()]
    for t in running:
        t.signal(15)
    for t in running:
        t.stop(grace_seconds=3.0)


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:])


def python_command(module: str, *args: str) -> list[str]:
    """``[sys.executable, "-m", module, *args]``."""
    return [sys.executable, "-m", module, *args]


__all__ = ["LocalCluster", "python_command"]
