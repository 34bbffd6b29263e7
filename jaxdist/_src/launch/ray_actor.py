"""The Ray actor that runs one task of ``python -m jaxdist.launch --backend ray``.

``TaskRunner`` is a plain class; ``ray_launch`` makes it an actor (``ray.remote``) with the
task's resources, one per task. On its node it reports where it is (the node's address and a
port free there), receives the task's environment and TLS files as arguments of ``start``
(through Ray's object store, never in the actor's options, name or runtime_env), writes the
files to a private directory (0700; files 0600), runs the command as a child process in its
own process group with the secrets in that child's environment only (killed with the actor:
``ray_launch`` gives the actor one thread, the process's main thread, which starts it), keeps
its output for the launcher to fetch (``poll``) and deletes the directory once the command has
ended.
Nothing it holds is printed: Ray's worker logs never see a secret.

Example:
    >>> from jaxdist._src.launch.ray_actor import TaskRunner
    >>> runner = TaskRunner("worker:0")
    >>> runner.where()["address"] != ""
    True
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Mapping, Sequence

from jaxdist._src.launch.local import TaskProcess, pick_free_ports
from jaxdist._src.security.pki import write_task_identity

#: Inherited variables a task never keeps from its node: the launcher sets its own.
_DROPPED_PREFIXES = ("JAXDIST_TLS_", "JAXDIST_COORDINATOR_")
_DROPPED = ("JAXDIST_INSECURE", "JAXDIST_CLUSTER_TOKEN", "TF_CONFIG")
#: Ray's default worker ports (``ray start --min-worker-port/--max-worker-port``): a Ray worker
#: started later may bind one, so a task's port is never drawn from them.
RAY_WORKER_PORTS = range(10002, 20000)
#: The most output lines one ``poll`` returns (the rest come with the next).
MAX_LINES_PER_POLL = 2000


def node_address() -> str:
    """This node's address as Ray knows it (the raylet's ``--node-ip-address``), else the
    address this host reaches others from.

    Example:
        >>> from jaxdist._src.launch.ray_actor import node_address
        >>> isinstance(node_address(), str)
        True
    """
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


def task_environment(base: Mapping[str, str], overlay: Mapping[str, str],
                     tls_dir: str | None) -> dict[str, str]:
    """A task's environment: its node's ``base`` without inherited jaxdist credentials, plus
    ``overlay`` (``TF_CONFIG``, tokens, forced devices ...) and the TLS files in ``tls_dir``.

    Example:
        >>> from jaxdist._src.launch.ray_actor import task_environment
        >>> env = task_environment({"PATH": "/bin", "JAXDIST_INSECURE": "1"},
        ...                        {"TF_CONFIG": "{}"}, "/run/t")
        >>> sorted(env)
        ['JAXDIST_TLS_CA', 'JAXDIST_TLS_CERT', 'JAXDIST_TLS_KEY', 'PATH', 'TF_CONFIG']
    """
    env = {k: v for k, v in base.items()
           if not k.startswith(_DROPPED_PREFIXES) and k not in _DROPPED}
    env.update(overlay)
    if tls_dir is not None:
        env.update({"JAXDIST_TLS_CA": os.path.join(tls_dir, "ca.pem"),
                    "JAXDIST_TLS_CERT": os.path.join(tls_dir, "cert.pem"),
                    "JAXDIST_TLS_KEY": os.path.join(tls_dir, "key.pem")})
    return env


class TaskRunner:
    """Runs one task's command on the node Ray placed it on (see the module docstring).

    Args:
        name: the task's name (``"worker:1"``), for messages only.
    """

    def __init__(self, name: str):
        self.name = name
        self._proc: TaskProcess | None = None
        self._cursor = 0
        self._dir: str | None = None

    def where(self) -> dict[str, object]:
        """This actor's node: ``{"address", "node_id", "hostname", "pid"}``."""
        node_id = ""
        try:
            import ray

            if ray.is_initialized():
                node_id = ray.get_runtime_context().get_node_id()
        except ImportError:
            pass
        return {"address": node_address(), "node_id": node_id,
                "hostname": socket.gethostname(), "pid": os.getpid()}

    def free_port(self) -> int:
        """A port free on this node's address now (the task's server binds it), outside Ray's
        default worker ports."""
        host = node_address()
        for _ in range(8):
            ports = [p for p in pick_free_ports(16, host=host) if p not in RAY_WORKER_PORTS]
            if ports:
                return ports[0]
        return pick_free_ports(1, host=host)[0]

    def start(self, argv: Sequence[str], overlay: Mapping[str, str],
              pems: tuple[bytes, bytes, bytes] | None, cwd: str | None = None) -> int:
        """Starts the task's command; returns its pid.

        Args:
            argv: the command.
            overlay: the variables the launcher sets (secrets among them).
            pems: ``(ca, cert, key)`` PEM bytes of the task's TLS identity; ``None`` for
                plaintext (``--insecure``).
            cwd: the working directory, when it exists on this node (else the actor's).

        Raises:
            RuntimeError: a command of this actor is still running.
        """
        if self._proc is not None and self._proc.running():
            raise RuntimeError(f"{self.name}: its command (pid {self._proc.pid}) still runs")
        self._cleanup_files()
        tls_dir = None
        if pems is not None:
            self._dir = tempfile.mkdtemp(prefix="jaxdist-ray-")  # mode 0700
            tls_dir = os.path.join(self._dir, "tls")
            write_task_identity(tls_dir, *pems)
        env = task_environment(os.environ, overlay, tls_dir)
        self._cursor = 0
        try:
            self._proc = TaskProcess(self.name, list(argv), env,
                                     cwd=cwd if cwd and os.path.isdir(cwd) else None,
                                     die_with_parent=True)
        except OSError as e:
            self._cleanup_files()
            raise RuntimeError(f"{self.name}: cannot start {argv[0]!r} on "
                               f"{node_address()}: {e.strerror or e}") from None
        return self._proc.pid

    def poll(self) -> tuple[int | None, list[str]]:
        """``(exit code or None while running, output lines since the last poll)``; the exit
        code as ``Popen.returncode`` gives it (negative: killed by that signal)."""
        if self._proc is None:
            return None, []
        code = self._proc.returncode
        if code is not None:
            self._proc.wait(5.0)  # the reader has the last lines
            self._cleanup_files()
        lines = self._proc.lines[self._cursor:self._cursor + MAX_LINES_PER_POLL]
        self._cursor += len(lines)
        if code is not None and self._cursor < len(self._proc.lines):
            code = None  # more lines to hand over first
        return code, lines

    def signal(self, signum: int) -> None:
        """Sends ``signum`` to the command's process group (nothing once it ended)."""
        if self._proc is not None:
            self._proc.signal(signum)

    def shutdown(self, grace: float = 5.0) -> int | None:
        """Stops the command (SIGTERM, SIGKILL after ``grace`` s), deletes its files; returns
        its exit code."""
        code = None
        if self._proc is not None:
            code = self._proc.stop(grace)
        self._cleanup_files()
        return code

    def _cleanup_files(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __del__(self):
        proc = getattr(self, "_proc", None)  # ray.remote's class wrapper has none
        if proc is not None and proc.running():
            proc.signal(signal.SIGKILL)
        if getattr(self, "_dir", None) is not None:
            self._cleanup_files()


__all__ = ["MAX_LINES_PER_POLL", "RAY_WORKER_PORTS", "TaskRunner", "node_address",
           "task_environment"]
