"""Local clusters: free ports, TF_CONFIG for each task, and task processes with prefixed output.

Used by ``python -m jaxdist.launch`` and by ``jaxdist.testing``. Everything binds to 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import IO, Any

from jaxdist._src.cluster.errors import ClusterConfigError
from jaxdist._src.cluster.resolver import TOKEN_ENV

HOST = "127.0.0.1"


# Ports are drawn from [_PORT_FLOOR, the kernel's first ephemeral port): the kernel hands
# ephemeral ports to outgoing connections, so a port it picked for us (bind to port 0) and that
# we release again can be taken by any process's next connect() before our server binds it.
_PORT_FLOOR = 10000
_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def _ephemeral_range() -> tuple[int, int] | None:
    """The kernel's ephemeral port range (Linux), or None where it cannot be read."""
    try:
        with open(_EPHEMERAL_RANGE_FILE) as f:
            low, high = (int(v) for v in f.read().split()[:2])
    except (OSError, ValueError):
        return None
    return low, high


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def pick_free_ports(n: int, host: str = HOST) -> list[int]:
    """Distinct free ports that no outgoing connection can take before a server binds them.

    Where the kernel's ephemeral range is known (Linux), the ports come from below it, so no
    process's outgoing connection can take one before the server that gets it binds it; a port
    is never handed out twice by one process. Elsewhere the OS picks them.

    Example:
        >>> from jaxdist.testing import pick_free_ports
        >>> a, b = pick_free_ports(2)
        >>> a != b and 0 < a < 65536
        True
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    ephemeral = _ephemeral_range()
    if ephemeral is None or ephemeral[0] - _PORT_FLOOR < 1000:
        return _os_picked_ports(n, host)
    ports: list[int] = []
    with _handed_out_lock:
        for _ in range(64 * max(n, 1)):
            if len(ports) == n:
                break
            port = secrets.randbelow(ephemeral[0] - _PORT_FLOOR) + _PORT_FLOOR
            if port in _handed_out or port in ports or not _bindable(host, port):
                continue
            ports.append(port)
        _handed_out.update(ports)
    if len(ports) < n:
        ports += _os_picked_ports(n - len(ports), host, avoid=ports)
    return ports


def _os_picked_ports(n: int, host: str, avoid: Sequence[int] = ()) -> list[int]:
    """``n`` distinct ports that were free on ``host`` a moment ago (the OS picked them)."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
            port = s.getsockname()[1]
            if port not in ports and port not in avoid:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


def new_token() -> str:
    """A fresh random cluster token."""
    return secrets.token_hex(16)


def local_cluster(workers: int = 1, ps: int = 0, chief: bool = False, evaluator: bool = False,
                  host: str = HOST) -> dict[str, list[str]]:
    """A cluster dict with free ports on ``host``.

    Example:
        >>> from jaxdist._src.launch.local import local_cluster
        >>> local_cluster(workers=2, ps=1)   # free ports of this host
        {'worker': ['127.0.0.1:...', '127.0.0.1:...'], 'ps': ['127.0.0.1:...']}
    """
    if workers < 0 or ps < 0 or (workers == 0 and not chief):
        raise ClusterConfigError(
            f"a local cluster needs at least one chief or worker task (workers={workers}, "
            f"chief={chief}, ps={ps})"
        )
    counts = {"chief": int(chief), "worker": workers, "ps": ps, "evaluator": int(evaluator)}
    ports = iter(pick_free_ports(sum(counts.values()), host))
    return {job: [f"{host}:{next(ports)}" for _ in range(n)] for job, n in counts.items() if n}


def tf_config(cluster: dict[str, Any], task_type: str, task_id: int,
              token: str | None = None) -> str:
    """The ``TF_CONFIG`` JSON for one task (with the jaxdist ``"token"`` when given)."""
    config: dict[str, Any] = {"cluster": cluster, "task": {"type": task_type, "index": task_id}}
    if token:
        config["token"] = token
    return json.dumps(config)


def task_env(cluster: dict[str, Any], task_type: str, task_id: int, token: str | None = None,
             devices_per_process: int | None = None,
             base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one task: ``TF_CONFIG``, the token, and forced CPU devices."""
    env = dict(os.environ if base is None else base)
    env["TF_CONFIG"] = tf_config(cluster, task_type, task_id, token)
    if token:
        env[TOKEN_ENV] = token
    if devices_per_process:
        env["JAX_NUM_CPU_DEVICES"] = str(devices_per_process)
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if "xla_force_host_platform_device_count" not in f]
        flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
        env["XLA_FLAGS"] = " ".join(flags)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def task_list(cluster: dict[str, Any]) -> list[tuple[str, int]]:
    """Every task of a cluster: chief, workers, ps, evaluator."""
    order = ("chief", "worker", "ps", "evaluator")
    jobs = sorted(cluster, key=lambda j: order.index(j) if j in order else len(order))
    return [(job, i) for job in jobs for i in range(len(cluster[job]))]


class TaskProcess:
    """One task's process, its output captured line by line (and optionally echoed, prefixed).

    Args:
        name: the task name (``"worker:1"``).
        command: the argv to run.
        env: its environment.
        echo: a stream to copy each output line to as ``[name] line`` (``None``: keep only).
        echo_lock: serialises writes of several tasks to ``echo``.
        cwd: working directory.
        on_line: called with ``(name, line)`` for each output line.
        die_with_parent: the process gets SIGKILL when the thread that started it ends
            (Linux's ``PR_SET_PDEATHSIG``; start it from a thread that lives as long as its
            process, e.g. the main thread), so it never outlives a launcher that is killed.
    """

    def __init__(self, name: str, command: Sequence[str], env: dict[str, str],
                 echo: IO[str] | None = None, echo_lock: AbstractContextManager | None = None,
                 cwd: str | None = None, on_line: Callable[[str, str], None] | None = None,
                 die_with_parent: bool = False):
        self.name = name
        self.command = list(command)
        self.lines: list[str] = []
        self._echo = echo
        self._lock = echo_lock or threading.Lock()
        self._on_line = on_line
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            self.command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, text=True, errors="replace", bufsize=1,
            start_new_session=True,  # its own process group: we can stop all it started
            preexec_fn=_kill_me_with_parent if die_with_parent else None,
        )
        self._reader = threading.Thread(target=self._read, name=f"out-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            if self._on_line is not None:
                self._on_line(self.name, line)
            if self._echo is not None:
                with self._lock:
                    self._echo.write(f"[{self.name}] {line}\n")
                    self._echo.flush()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def running(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """Sends ``sig`` to the task's process group (the task and what it started)."""
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def stop(self, grace_seconds: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after ``grace_seconds``; returns the exit code."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_seconds)
            except subprocess.TimeoutExpired:
                self.kill()
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            pass
        self._reader.join(2.0)
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code, or ``None`` if still running after ``timeout``."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(5.0)
        return code


def _kill_me_with_parent() -> None:
    """In a child before ``exec``: SIGKILL it when its parent thread ends (Linux only)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def exit_status(code: int | None) -> int:
    """A shell exit status for a child's return code (``-9`` -> 137)."""
    if code is None:
        return 1
    return 128 - code if code < 0 else code


PYTHON = sys.executable

__all__ = [
    "HOST",
    "PYTHON",
    "TaskProcess",
    "exit_status",
    "local_cluster",
    "new_token",
    "pick_free_ports",
    "task_env",
    "task_list",
    "tf_config",
]
