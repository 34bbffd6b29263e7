"""The implementation of ``jaxdist.testing.slurm``: a real Slurm cluster on one machine.

``LocalSlurm(nodes=("n1", "n2"))`` writes a ``slurm.conf`` in a new private directory and
starts Slurm's own daemons from the distribution's packages (``slurm-wlm``, ``munge``): one
``munged`` with a fresh key and its own socket, one ``slurmctld``, and one ``slurmd -N <node>``
per node name, every node with a loopback address of its own (``n1`` -> 127.0.0.1, ``n2`` ->
127.0.0.2) and a slurmd port of its own, so ``srun -N2`` places one task on each "node" of this
machine and the tasks of two nodes can listen on the same port, as on two machines. The node
names must resolve: ``LocalSlurm`` adds a marked line to ``/etc/hosts`` for each name that does
not resolve to loopback, and removes it again. ``close()`` (also at exit) cancels the
cluster's jobs, stops the daemons it started, by their process ids, SIGKILLs whatever is left
of its jobs (the processes whose environment names its ``slurm.conf``: a step daemon outlives
slurmd), and deletes the directory. ``env`` is the environment
Slurm's commands need (``SLURM_CONF``); ``run("sbatch", ...)`` runs one with it.

Needs root (Slurm runs the jobs as the submitting user; slurmd must be root to start them)
and the packages; ``unavailable_reason()`` says why it cannot work here (``None`` where it can).

Example:
    >>> with LocalSlurm(("n1", "n2")) as slurm:                    # doctest: +SKIP
    ...     out = slurm.run("srun", "-N2", "-n2", "hostname").stdout
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence

from jaxdist._src.launch.local import pick_free_ports

_HOSTS_FILE = "/etc/hosts"
_MARK = "# jaxdist.testing.slurm"
_DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "squeue", "scontrol")


class SlurmUnavailable(RuntimeError):
    """A local Slurm cluster cannot be started here (not root, packages missing, a daemon
    did not come up)."""


def unavailable_reason() -> str | None:
    """Why ``LocalSlurm`` cannot run here, or ``None`` when it can (the cheap checks only).

    Example:
        >>> from jaxdist.testing.slurm import unavailable_reason
        >>> unavailable_reason() is None or isinstance(unavailable_reason(), str)
        True
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "a local Slurm cluster needs root (slurmd starts the jobs): not running as root"
    missing = [d for d in _DAEMONS if shutil.which(d) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not on PATH; "
                f"apt-get install slurm-wlm munge)")
    return None


def _loopback_address(name: str) -> str | None:
    """The loopback IPv4 address ``name`` resolves to, else ``None``."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET)
    except OSError:
        return None
    addrs = {i[4][0] for i in infos}
    return addrs.pop() if len(addrs) == 1 and next(iter(addrs)).startswith("127.") else None


class LocalSlurm:
    """A Slurm cluster of ``nodes`` (names) on this machine: ``run("sbatch", ...)``, ``wait_job``,
    ``job_field``, ``stop_node``, ``close()``.

    Args:
        nodes: the node names (``("n1", "n2")``).
        cpus: CPUs each node offers (tasks per node at most).
        slurmd_timeout: ``SlurmdTimeout``: seconds before slurmctld declares a silent node down.
        start_timeout: seconds to wait for every node to be idle.
        extra_conf: lines appended to ``slurm.conf``.

    Attributes:
        directory: the private directory (config, state, logs).
        env: ``os.environ`` plus ``SLURM_CONF``, for Slurm's commands.
        startup_seconds: how long the daemons took to be ready.
    """

    def __init__(self, nodes: Sequence[str] = ("n1", "n2"), cpus: int = 2,
                 slurmd_timeout: int = 10, start_timeout: float = 60.0,
                 extra_conf: Sequence[str] = ()):
        reason = unavailable_reason()
        if reason is not None:
            raise SlurmUnavailable(reason)
        self.nodes = list(nodes)
        self.directory = tempfile.mkdtemp(prefix="jaxdist-slurm-")
        os.chmod(self.directory, 0o755)  # the job's user (root) and slurmd read slurm.conf
        self._procs: list[tuple[str, subprocess.Popen]] = []
        self._hosts_added: list[str] = []
        self.conf = os.path.join(self.directory, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        for k in list(self.env):
            if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF":
                del self.env[k]
        self.startup_seconds = 0.0
        atexit.register(self.close)
        t0 = time.monotonic()
        try:
            self._add_hosts()
            self._write_conf(cpus, slurmd_timeout, extra_conf)
            self._start(start_timeout)
        except BaseException:
            self.close()
            raise
        self.startup_seconds = time.monotonic() - t0

    # -- setup -------------------------------------------------------------------------------
    def _add_hosts(self) -> None:
        """Node ``i`` is 127.0.0.<i+1> (its own loopback address: tasks of two nodes may use
        one port, as on two machines), unless its name already resolves to loopback."""
        self.addresses: dict[str, str] = {}
        lines = []
        for i, n in enumerate(self.nodes):
            current = _loopback_address(n)
            self.addresses[n] = current or f"127.0.0.{i + 1}"
            if current is None:
                lines.append(f"{self.addresses[n]} {n} {_MARK} {os.getpid()}\n")
        if lines:
            with open(_HOSTS_FILE, "a") as f:
                f.writelines(lines)
            self._hosts_added = [ln.split()[1] for ln in lines]

    def _remove_hosts(self) -> None:
        if not self._hosts_added:
            return
        tag = f"{_MARK} {os.getpid()}"
        try:
            with open(_HOSTS_FILE) as f:
                lines = f.readlines()
            with open(_HOSTS_FILE, "w") as f:
                f.writelines(ln for ln in lines if not ln.rstrip().endswith(tag))
        except OSError:
            pass
        self._hosts_added = []

    def _write_conf(self, cpus: int, slurmd_timeout: int, extra: Sequence[str]) -> None:
        d = self.directory
        for sub in ("state", "spool", "log"):
            os.makedirs(os.path.join(d, sub), mode=0o755)
        key = os.path.join(d, "munge.key")
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(1024))
        self.munge_socket = os.path.join(d, "munge.socket")
        ports = pick_free_ports(1 + len(self.nodes))
        self.ctld_port = ports[0]
        host = socket.gethostname().split(".")[0]
        lines = [
            "ClusterName=jaxdist",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: how long Slurm keeps a requeued job pending (120 s by default)
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=2",  # pending jobs tried every 2 s (not 60)
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SlurmdParameters=config_overrides",
            f"SlurmdTimeout={slurmd_timeout}",
            "SlurmctldTimeout=10",
            "MessageTimeout=10",
            "KillWait=10",
            "MinJobAge=300",
            "InactiveLimit=0",
            "JobRequeue=1",
        ]
        for name, port in zip(self.nodes, ports[1:]):
            os.makedirs(os.path.join(d, "spool", name), mode=0o755)
            lines.append(f"NodeName={name} NodeHostname={host} NodeAddr={self.addresses[name]} "
                         f"Port={port} CPUs={cpus} State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES "
                     f"MaxTime=INFINITE State=UP")
        lines.extend(extra)
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(d, "cgroup.conf"), "w") as f:
            f.write("CgroupPlugin=autodetect\nCgroupMountpoint=/sys/fs/cgroup\n")

    def _daemon(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.directory, "log", f"{name}.out"), "ab")
        p = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self._procs.append((name, p))
        return p

    def _start(self, timeout: float) -> None:
        d = self.directory
        self._daemon("munged", ["munged", "-F", "--force", f"--key-file={d}/munge.key",
                                f"--socket={self.munge_socket}",
                                f"--pid-file={d}/munged.pid", f"--log-file={d}/log/munged.log",
                                f"--seed-file={d}/munged.seed"])
        self._wait(lambda: os.path.exists(self.munge_socket), 20.0, "munged")
        self._daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf])
        self._wait(lambda: self.run("scontrol", "ping", check=False).returncode == 0
                   and "UP" in self.run("scontrol", "ping", check=False).stdout,
                   timeout, "slurmctld")
        for n in self.nodes:
            self._daemon(f"slurmd-{n}", ["slurmd", "-D", "-N", n, "-f", self.conf])
        self._wait(self._nodes_idle, timeout, "slurmd")

    def _nodes_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split("\n")
        states = dict(line.split() for line in out if len(line.split()) == 2)
        return all(states.get(n) == "idle" for n in self.nodes)

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self._procs:
                if p.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited with {p.returncode} while starting: "
                                           f"{self.log_tail(name)}")
            if ready():
                return
            time.sleep(0.2)
        raise SlurmUnavailable(f"{what} was not ready within {timeout:g} s: "
                               f"{self.log_tail(what)}")

    # -- use ---------------------------------------------------------------------------------
    def run(self, *argv: str, check: bool = True, timeout: float = 60.0,
            **kwargs) -> subprocess.CompletedProcess:
        """Runs a Slurm command (``sbatch``, ``squeue``, ...) against this cluster."""
        return subprocess.run(list(argv), env=kwargs.pop("env", self.env), capture_output=True,
                              text=True, timeout=timeout, check=check, **kwargs)

    def log_tail(self, name: str, chars: int = 2000) -> str:
        """The end of a daemon's log (``slurmctld``, ``slurmd-n1``, ``munged``)."""
        text = ""
        for fname in (f"{name}.log", f"{name}.out"):
            try:
                with open(os.path.join(self.directory, "log", fname), errors="replace") as f:
                    text += f.read()
            except OSError:
                pass
        return text[-chars:]

    def stop_node(self, node: str, sig: int = signal.SIGKILL) -> None:
        """Sends ``sig`` to node ``node``'s slurmd (the node goes silent)."""
        for name, p in self._procs:
            if name == f"slurmd-{node}" and p.poll() is None:
                p.send_signal(sig)

    def job_state(self, job_id: str) -> str:
        """The job's state (``PENDING``, ``RUNNING``, ``COMPLETED``, ``FAILED``, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def job_field(self, job_id: str, key: str) -> str:
        """One field of ``scontrol show job`` (``ExitCode``, ``Restarts``, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False).stdout
        for field in out.split():
            if field.startswith(f"{key}="):
                return field.split("=", 1)[1]
        return ""

    def wait_job(self, job_id: str, timeout: float,
                 states: Sequence[str] = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                          "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                                          "BOOT_FAIL", "DEADLINE")) -> str:
        """Waits until job ``job_id`` is in one of ``states``; returns the state."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in states:
                return state
            time.sleep(0.3)
        raise TimeoutError(f"Slurm job {job_id} still {state} after {timeout:g} s; "
                           f"slurmctld: {self.log_tail('slurmctld', 800)}")

    def _cancel_jobs(self, timeout: float = 15.0) -> None:
        """Cancels every job of this cluster and waits (bounded) until none is left."""
        try:
            ids = self.run("squeue", "-h", "-o", "%A", check=False, timeout=10).stdout.split()
            if ids:
                self.run("scancel", "--full", "--signal=KILL", *ids, check=False, timeout=10)
                self.run("scancel", *ids, check=False, timeout=10)
            deadline = time.monotonic() + timeout
            while ids and time.monotonic() < deadline:
                left = self.run("squeue", "-h", "-o", "%A", check=False, timeout=10).stdout
                if not left.split():
                    break
                time.sleep(0.3)
        except (OSError, subprocess.SubprocessError):
            pass

    def _kill_leftovers(self) -> None:
        """SIGKILLs what still runs from this cluster: every process whose environment names
        this cluster's ``slurm.conf`` (the daemons, step daemons, batch scripts and tasks it
        started); found by process id, never by name."""
        mark = f"SLURM_CONF={self.conf}\0".encode()
        me = os.getpid()
        for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
            if int(pid) == me:
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if mark not in f.read() + b"\0":
                        continue
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                continue

    def close(self) -> None:
        """Cancels the cluster's jobs, stops the daemons this object started (and anything
        left of the jobs) and deletes its directory."""
        if self._procs and any(n == "slurmctld" and p.poll() is None for n, p in self._procs):
            self._cancel_jobs()
        for _name, p in reversed(self._procs):
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
                except OSError:
                    pass
        self._procs = []
        self._kill_leftovers()
        self._remove_hosts()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> LocalSlurm:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["LocalSlurm", "SlurmUnavailable", "unavailable_reason"]
