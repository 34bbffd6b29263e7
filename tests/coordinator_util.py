"""Helpers for the coordinator tests: a real cluster (ps + workers running
``python -m jaxdist.server``) on 127.0.0.1 with this test process as the chief.

Every task is small: JAX on CPU with one device. Heartbeats are short so failures are seen
within a second.
"""

from __future__ import annotations

import os
import sys
import time

import cloudpickle

import jaxdist
from jaxdist.coordinator import ClusterCoordinator
from jaxdist.testing import LocalCluster

SERVER = [sys.executable, "-m", "jaxdist.server"]


class ChiefResolver:
    """A duck-typed resolver for this (test) process as ``chief:0``."""

    def __init__(self, cluster: dict, token: str):
        self._cluster, self.cluster_token = cluster, token
        self.task_type, self.task_id = "chief", 0

    def cluster_spec(self) -> dict:
        return {k: list(v) for k, v in self._cluster.items()}


def start_cluster(workers: int = 2, ps: int = 1, ps_args: tuple[str, ...] = (),
                  devices_per_process: int = 1, env: dict[str, str] | None = None
                  ) -> LocalCluster:
    """Starts ps and worker tasks (not the chief: that is this process), each with
    ``devices_per_process`` forced CPU devices and ``env`` added to its environment."""
    c = LocalCluster(workers=workers, ps=ps, chief=True, devices_per_process=devices_per_process,
                     env={"JAX_NUM_CPU_DEVICES": str(devices_per_process), **(env or {})})
    # This process is the chief: its TLS identity and the coordinator token.
    for key in ("JAXDIST_INSECURE", "JAXDIST_COORDINATOR_TOKEN_SHA256",
                "JAXDIST_COORDINATOR_PUBLIC_KEY", "JAXDIST_COORDINATOR_ANSWER_KEY"):
        os.environ.pop(key, None)
    os.environ.update(c.security_env("chief:0"))
    names = [n for n in c.task_names if not n.startswith("chief")]
    for n in names:
        c.start_task(n, [*SERVER, *ps_args] if n.startswith("ps") else SERVER)
    for n in names:
        wait_listening(c, n)
    return c


def wait_listening(c: LocalCluster, name: str, timeout: float = 60.0) -> None:
    c.wait_for_output(name, r"listening on", timeout)


def restart(c: LocalCluster, name: str) -> None:
    c.restart(name)
    wait_listening(c, name)


def strategy_for(c: LocalCluster, timeout: float = 30.0) -> jaxdist.ParameterServerStrategy:
    return jaxdist.ParameterServerStrategy(ChiefResolver(c.cluster, c.token), timeout=timeout)


def coordinator_for(strategy, **kwargs) -> ClusterCoordinator:
    kwargs.setdefault("heartbeat_interval", 0.2)
    kwargs.setdefault("heartbeat_timeout", 2.0)
    kwargs.setdefault("join_timeout", 60.0)
    return ClusterCoordinator(strategy, **kwargs)


def wait_until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class FileGate:
    """A gate that functions running on the cluster's worker processes wait at until the test
    opens it (a file on this machine: the tasks run here), instead of sleeping "long enough".

    Example:
        >>> gate = FileGate()
        >>> rv = coordinator.schedule(gate.wait_then, args=(7,))  # holds a worker
        >>> gate.open(); rv.fetch()
        7
    """

    def __init__(self, timeout: float = 60.0):
        import tempfile
        import uuid

        self.path = os.path.join(tempfile.gettempdir(), f"jaxdist-gate-{uuid.uuid4().hex}")
        self.timeout = timeout

    def wait_then(self, value=None):
        """Blocks until the gate opens (at most ``timeout`` s: a hang guard), then returns
        ``value``."""
        deadline = time.monotonic() + self.timeout
        while not os.path.exists(self.path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the test never opened the gate {self.path}")
            time.sleep(0.01)
        return value

    def open(self) -> None:
        with open(self.path, "w"):
            pass

    def close(self) -> None:
        """Removes the file (the gate is then closed again)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def by_value(module_name: str) -> None:
    """Ships the test module's functions by value (workers cannot import test modules), and
    this module's (a ``FileGate`` travels to the workers)."""
    cloudpickle.register_pickle_by_value(sys.modules[module_name])
    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def in_process_worker(tls="task", index: int = 0, token: str | None = None,
                      address: str = "127.0.0.1:0", **kwargs):
    """A ``WorkerServer`` for ``worker:<index>`` in this process on ``address`` (test PKI
    identity ``tls``, or ``"insecure"``) holding what the launcher gives that worker for
    ``token`` (default: a fresh coordinator token): ``(server, token)``, started."""
    from jaxdist._src.cluster.task_info import TaskInfo
    from jaxdist._src.coordinator.worker_runtime import WorkerRuntime
    from jaxdist._src.coordinator.worker_service import WorkerServer
    from jaxdist.coordinator import CoordinatorKeys, new_coordinator_token
    from jaxdist.testing.tls import process_pki

    token = token or new_coordinator_token()
    info = TaskInfo({"worker": [f"127.0.0.1:{i + 1}" for i in range(index + 1)]}, "worker",
                    index, "t0k")
    identity = tls if tls == "insecure" else process_pki().identities[tls]
    server = WorkerServer(WorkerRuntime(info), address,
                          CoordinatorKeys(token).worker_credential(f"worker:{index}"),
                          tls=identity, **kwargs).start()
    return server, token
