"""The implementation of ``jaxdist.testing.netns``: a multi-host test cluster on one Linux
machine, hosts as network namespaces.

``NetworkNamespaces(3)`` creates three namespaces, the *hosts*, and a fourth holding a bridge;
each host has one veth link (``eth0``, address ``10.213.0.<i + 1>/24``) to the bridge and its
own loopback, and nothing else: no interface of the root namespace is touched, so traffic
between the hosts stays on this private network and cannot reach any other address. The names
are unique per object (``jaxdist-<pid>-<random>-h0``), so parallel or leftover runs never
collide; ``close()`` (also at exit, and when the object is collected) deletes the namespaces
and with them the veths and the bridge, and ``sweep_stale()`` removes those of dead processes.
``set_link(i, up=False)`` takes host ``i``'s link down (its cable pulled); ``wrap(i, argv)`` is
the command that runs ``argv`` on host ``i`` (``ip netns exec``).

``NetnsCluster`` is ``jaxdist.testing.LocalCluster`` with one task per host, the cluster spec
(``TF_CONFIG``) naming the hosts' addresses and TLS certificates valid for those addresses.

Creating namespaces needs root and iproute2 (``ip``); ``unavailable_reason()`` says why it
cannot work here (``None`` where it can), for a test to skip with.

Example:
    >>> from jaxdist.testing.netns import address_plan
    >>> plan = address_plan(3)
    >>> plan
    ['10.213.0.1', '10.213.0.2', '10.213.0.3']
    >>> with NetworkNamespaces(3) as net:           # doctest: +SKIP
    ...     out = subprocess.run(net.wrap(1, ["ip", "-br", "addr"]), capture_output=True)
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import weakref
from collections.abc import Sequence

from jaxdist._src.cluster.validation import task_name
from jaxdist._src.launch.harness import LocalCluster
from jaxdist._src.launch.local import task_list

SUBNET = "10.213.0"  # the hosts' private /24 (it exists only inside the namespaces)
PREFIX = "jaxdist-"
_IP_TIMEOUT = 20.0
_NAME = re.compile(r"^jaxdist-(\d+)-[0-9a-f]+-(?:h\d+|br)$")
# The reachability check: a listener on host 0 that accepts N connections, and a client.
_LISTEN = ("import socket, sys\n"
           "s = socket.create_server((sys.argv[1], 23000)); s.settimeout(20)\n"
           "print('ready', flush=True)\n"
           "for _ in range(int(sys.argv[2])): s.accept()[0].close()\n")
_CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], 23000), timeout=5).close()"


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no ``ip``, or the kernel refused).

    Example:
        >>> from jaxdist.testing.netns import NetnsUnavailable
        >>> isinstance(NetnsUnavailable("not root"), RuntimeError)
        True
    """


def address_plan(hosts: int) -> list[str]:
    """The hosts' addresses: ``10.213.0.1`` for host 0, and so on.

    Example:
        >>> from jaxdist.testing.netns import address_plan
        >>> address_plan(2)
        ['10.213.0.1', '10.213.0.2']
    """
    if not 1 <= hosts <= 250:
        raise ValueError(f"hosts must be in [1, 250], got {hosts}")
    return [f"{SUBNET}.{i + 1}" for i in range(hosts)]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Runs ``ip ARGS`` (bounded by a timeout); raises ``NetnsUnavailable`` on failure."""
    try:
        done = subprocess.run(["ip", *args], capture_output=True, text=True,
                              timeout=_IP_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {e}") from e
    if check and done.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed with exit code "
                               f"{done.returncode}: {done.stderr.strip()}")
    return done


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be used here, or ``None`` when they can.

    Only the cheap checks (root, ``ip`` on PATH); creating one may still fail (e.g. in a
    container without ``CAP_SYS_ADMIN``), which ``NetworkNamespaces`` raises as
    ``NetnsUnavailable``.

    Example:
        >>> from jaxdist.testing.netns import unavailable_reason
        >>> unavailable_reason() is None or isinstance(unavailable_reason(), str)
        True
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (ip netns add): not running as root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's `ip` command, which is not on PATH"
    return None


def sweep_stale() -> list[str]:
    """Deletes the namespaces ``NetworkNamespaces`` left behind in processes that are gone.

    Returns:
        The names deleted.

    Example:
        >>> from jaxdist.testing.netns import sweep_stale, unavailable_reason
        >>> sweep_stale() if unavailable_reason() is None else []   # doctest: +ELLIPSIS
        [...]
    """
    listing = _ip("netns", "list", check=False).stdout
    deleted = []
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        if _ip("netns", "del", name, check=False).returncode == 0:
            deleted.append(name)
    return deleted


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class NetworkNamespaces:
    """Host namespaces joined by a bridge in a namespace of its own; ``set_link(i, up)``, ``wrap(i,
    argv)``, ``close()``.

    Args:
        hosts: how many host namespaces.

    Attributes:
        names: the host namespaces' names.
        bridge: the bridge namespace's name.
        addresses: the hosts' IPv4 addresses (``address_plan(hosts)``).

    Raises:
        NetnsUnavailable: not root, no ``ip``, a namespace or link could not be created, or
            the hosts cannot reach each other over TCP (whatever was created is removed
            again).

    Example:
        >>> net = NetworkNamespaces(2)                  # doctest: +SKIP
        >>> net.set_link(1, up=False)                   # doctest: +SKIP
        >>> net.close()                                 # doctest: +SKIP
    """

    def __init__(self, hosts: int = 3):
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsUnavailable(reason)
        self.addresses = address_plan(hosts)
        tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.names = [f"{tag}-h{i}" for i in range(hosts)]
        self.bridge = f"{tag}-br"
        self._created: list[str] = []
        self._finalizer = weakref.finalize(self, _delete, self._created)
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        for ns in [self.bridge, *self.names]:
            _ip("netns", "add", ns)
            self._created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            port = f"p{i}"
            # Both ends are created inside the new namespaces: none ever exists in the root one.
            _ip("-n", self.bridge, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            _ip("-n", self.bridge, "link", "set", port, "master", "br0")
            _ip("-n", self.bridge, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        self._check_reachable()

    def _check_reachable(self) -> None:
        """Every host reaches host 0 over TCP (a kernel or firewall that drops bridged
        traffic would make every test time out instead of skipping)."""
        if len(self.names) < 2:
            return
        listener = subprocess.Popen(
            self.wrap(0, [sys.executable, "-c", _LISTEN, self.addresses[0],
                          str(len(self.names) - 1)]),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ready = listener.stdout.readline().strip() if listener.stdout else ""
            if ready != "ready":
                raise NetnsUnavailable(f"a program cannot listen inside {self.names[0]}: "
                                       f"{ready or _last_line(listener.stderr.read())}")
            for host in range(1, len(self.names)):
                try:
                    done = subprocess.run(
                        self.wrap(host, [sys.executable, "-c", _CONNECT, self.addresses[0]]),
                        capture_output=True, text=True, timeout=_IP_TIMEOUT)
                except subprocess.TimeoutExpired as e:
                    raise NetnsUnavailable(f"host {host} cannot reach host 0 "
                                           f"({self.addresses[0]}): no answer") from e
                if done.returncode != 0:
                    raise NetnsUnavailable(f"host {host} cannot reach host 0 "
                                           f"({self.addresses[0]}): {_last_line(done.stderr)}")
        finally:
            listener.kill()
            listener.wait(_IP_TIMEOUT)

    def wrap(self, host: int, argv: Sequence[str]) -> list[str]:
        """The command that runs ``argv`` on host ``host`` (``ip netns exec NAME ...``).

        The environment passes through unchanged.

        Example:
            >>> net.wrap(0, ["python", "train.py"])      # doctest: +SKIP
            ['ip', 'netns', 'exec', 'jaxdist-...-h0', 'python', 'train.py']
        """
        return ["ip", "netns", "exec", self.names[host], *argv]

    def set_link(self, host: int, up: bool) -> None:
        """Takes host ``host``'s link down (its cable pulled) or brings it back up.

        Example:
            >>> net.set_link(2, up=False)                # doctest: +SKIP
        """
        _ip("-n", self.names[host], "link", "set", "eth0", "up" if up else "down")

    def pids(self, host: int) -> list[int]:
        """The processes running on host ``host`` (``ip netns pids``).

        Example:
            >>> net.pids(0)                              # doctest: +SKIP
            [12345, 12377]
        """
        out = _ip("netns", "pids", self.names[host], check=False).stdout
        return [int(p) for p in out.split() if p.isdigit()]

    def kill_all(self) -> list[int]:
        """SIGKILLs every process left on the hosts (e.g. a coordination service that outlived
        its task), by pid; returns the pids.

        Only processes inside these namespaces are touched: they were all started into them.

        Example:
            >>> net.kill_all()                           # doctest: +SKIP
            []
        """
        killed = []
        for host in range(len(self.names)):
            for pid in self.pids(host):
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
        return killed

    def close(self) -> None:
        """Kills the processes left on the hosts and deletes the namespaces (their veths and
        the bridge go with them). Idempotent."""
        if self._created:
            self.kill_all()
        self._finalizer()

    def __enter__(self) -> NetworkNamespaces:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _last_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[-1] if lines else "no output"


def _delete(names: list[str]) -> None:
    for ns in reversed(names):
        _ip("netns", "del", ns, check=False)
    names.clear()


class NetnsCluster(LocalCluster):
    """``LocalCluster`` with one task per namespace host, ``TF_CONFIG`` naming the hosts' addresses,
    TLS certificates for those addresses.

    The tasks are placed in ``task_list`` order (chief, workers, ps, evaluator) on hosts 0, 1,
    ... (wrapping around when there are more tasks than hosts); each listens on its host's
    address, which ``TF_CONFIG`` names, and the TLS certificates are valid for those
    addresses. ``close()`` stops the tasks, then deletes the namespaces.

    Args:
        net: the hosts (``NetworkNamespaces``); closed with the cluster.
        workers, ps, chief, evaluator, devices_per_process, env, echo, cwd, tls: as for
            ``LocalCluster``.

    Attributes:
        net: the hosts.
        host_of: task name -> host index.

    Example:
        >>> with NetnsCluster(NetworkNamespaces(2), workers=2) as c:   # doctest: +SKIP
        ...     c.start(python_command("jaxdist.testing.workloads", "linreg"))
        ...     c.net.set_link(c.host_of["worker:1"], up=False)
    """

    def __init__(self, net: NetworkNamespaces, workers: int = 2, ps: int = 0,
                 chief: bool = False, evaluator: bool = False,
                 devices_per_process: int | None = 1, env: dict[str, str] | None = None,
                 echo=None, cwd: str | None = None, tls: bool = True):
        counts = {"chief": int(chief), "worker": workers, "ps": ps, "evaluator": int(evaluator)}
        jobs = {job: n for job, n in counts.items() if n}
        order = task_list({job: [""] * n for job, n in jobs.items()})
        self.host_of = {task_name(j, i): k % len(net.names) for k, (j, i) in enumerate(order)}
        ports: dict[int, int] = {}
        cluster: dict[str, list[str]] = {job: [] for job in jobs}
        for j, i in order:
            host = self.host_of[task_name(j, i)]
            # Fresh namespaces have no other listener: any port below the ephemeral range.
            ports[host] = ports.get(host, 23000) + 1
            cluster[j].append(f"{net.addresses[host]}:{ports[host]}")
        self.net = net
        super().__init__(workers, ps, chief, evaluator, devices_per_process, env, echo, cwd,
                         tls, cluster=cluster, tls_hosts=net.addresses,
                         wrap=lambda name, argv: net.wrap(self.host_of[name], argv))

    def close(self) -> None:
        """Stops every task, deletes the keys, then the namespaces."""
        try:
            super().close()
        finally:
            self.net.close()


__all__ = ["NetnsCluster", "NetnsUnavailable", "NetworkNamespaces", "address_plan",
           "sweep_stale", "unavailable_reason"]
