"""JAX's coordination service in a helper process, so that it outlives a crash of process 0.

JAX terminates every process whose client loses the coordination service (``LOG(FATAL)`` in
XLA's default ``missed_heartbeat_callback``, exit status 134), and ``jax.distributed`` runs the
service inside process 0. So when the chief process dies, JAX kills the survivors before they
can raise. jaxdist's process 0 runs the service here instead: a small child process in its own
session, which keeps serving when process 0 dies (so the survivors' clients stay connected and
the service reports process 0 lost, like any other task) and then stops after ``linger``
seconds at most (it stops as soon as no client is connected any more). In an orderly exit
process 0 stops it after every client has disconnected.

Run as ``python -m jaxdist._src.distributed.service_process --bind 127.0.0.1:2222
--num-processes 2``; it prints ``ready`` once listening and stops on ``stop`` (or ``linger`` s
after EOF) on stdin. ``start_service_process`` runs this file by its path instead (``_BOOT``),
so that the service imports only jaxlib's C++ extension: not the ``jaxdist`` package, which
imports JAX (about 1 s of process 0's start-up, on every multi-process job, that every other
process waits for).
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time

READY = "ready"
# Runs this file as __main__ without importing the jaxdist package (``python -m`` would) and
# without putting its directory on sys.path (``python FILE`` would).
_BOOT = "import runpy, sys; sys.argv.pop(0); runpy.run_path(sys.argv[0], run_name='__main__')"


class ServiceProcess:
    """Handle of a running service process (what ``global_state.service`` holds in process 0).

    Attributes:
        bind_address: where the service listens.
        proc: the ``subprocess.Popen`` of the service process.
    """

    def __init__(self, bind_address: str, proc: subprocess.Popen):
        self.bind_address = bind_address
        self.proc = proc

    def shutdown(self, timeout_seconds: float = 10.0) -> None:
        """Stops the service (after the clients disconnected); kills it if it does not stop."""
        try:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            self.proc.wait(timeout_seconds)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5.0)


def start_service_process(bind_address: str, num_processes: int, heartbeat_timeout: int,
                          shutdown_timeout: int, recoverable: bool, linger_seconds: float,
                          timeout_seconds: float,
                          register_timeout: int | None = None) -> ServiceProcess:
    """Starts the coordination service in a child process and waits until it listens.

    Args:
        bind_address: ``host:port`` the service listens on.
        num_processes: processes in the group.
        heartbeat_timeout: seconds after which a silent task is declared dead.
        shutdown_timeout: seconds the service waits for tasks at shutdown.
        recoverable: JAX's recoverable mode (a dead task does not fail the others).
        linger_seconds: how long the service keeps serving after process 0 died.
        timeout_seconds: how long to wait for the service to listen.
        register_timeout: seconds the service waits for every task to register (JAX's
            default when ``None``).

    Raises:
        RuntimeError: the service did not start (the message has its output, e.g. the port is
            taken) within ``timeout_seconds``.
    """
    if not wait_until_free(bind_address, min(timeout_seconds, linger_seconds)):
        raise RuntimeError(
            f"{bind_address} is still in use (a coordination service of a previous run of this "
            f"job, or another program) after {min(timeout_seconds, linger_seconds):g} s"
        )
    cmd = [sys.executable, "-c", _BOOT, os.path.abspath(__file__), "--bind", bind_address,
           "--num-processes", str(num_processes), "--heartbeat-timeout", str(heartbeat_timeout),
           "--shutdown-timeout", str(shutdown_timeout), "--linger", str(linger_seconds)]
    if recoverable:
        cmd.append("--recoverable")
    if register_timeout is not None:
        cmd += ["--register-timeout", str(register_timeout)]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, bufsize=1, env=dict(os.environ, JAX_PLATFORMS="cpu"),
        start_new_session=True,  # not stopped with process 0's process group
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:  # drains the output for the service's lifetime (keeps the last lines)
        for line in proc.stdout:
            if line.strip() == READY:
                ready.set()
            else:
                lines.append(line.rstrip())
                del lines[:-50]
        ready.set()

    threading.Thread(target=read, name="jaxdist-service-out", daemon=True).start()
    if ready.wait(timeout_seconds) and proc.poll() is None:
        return ServiceProcess(bind_address, proc)
    proc.kill()
    proc.wait(5.0)
    tail = " | ".join(lines[-5:]) or "no output"
    raise RuntimeError(
        f"the JAX coordination service did not start on {bind_address} within "
        f"{timeout_seconds:g} s (exit status {proc.returncode}): {tail}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxdist._src.distributed.service_process")
    p.add_argument("--bind", required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--heartbeat-timeout", type=int, default=30)
    p.add_argument("--shutdown-timeout", type=int, default=60)
    p.add_argument("--linger", type=float, default=60.0)
    p.add_argument("--register-timeout", type=int, default=None)
    p.add_argument("--recoverable", action="store_true")
    args = p.parse_args(argv)
    # A preemption's SIGTERM (a pod's or a Slurm step's, sent to every process) must not end
    # the service while the job agrees where to stop and saves: it ends with process 0 (stop,
    # or ``linger`` after process 0 is gone).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _jax = _jax_extension()

    service = _jax.get_distributed_runtime_service(
        args.bind, args.num_processes, heartbeat_timeout=args.heartbeat_timeout,
        cluster_register_timeout=args.register_timeout, shutdown_timeout=args.shutdown_timeout,
        recoverable=args.recoverable,
    )
    print(READY, flush=True)
    command = sys.stdin.readline().strip()
    if command == "stop":
        service.shutdown()
        return 0
    # Process 0 is gone: keep serving the survivors until they have disconnected (at most
    # ``linger`` s), then stop without waiting for anyone.
    port = int(args.bind.rpartition(":")[2])
    deadline = time.monotonic() + args.linger
    # Stop promptly once nobody is connected: a relaunched job must not find this service.
    while time.monotonic() < deadline and open_connections(port) != 0:
        time.sleep(0.1)
    sys.stdout.flush()
    os._exit(0)


def _jax_extension():
    """jaxlib's C++ extension, from ``compat/jaxlib_extension.py`` loaded by its path: run as
    ``_BOOT`` runs it, this process imports neither ``jaxdist`` nor JAX (the service needs
    nothing else)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "compat",
                        "jaxlib_extension.py")
    return runpy.run_path(path)["jaxlib_extension"]()


def open_connections(port: int) -> int | None:
    """Established TCP connections to this process's ``port`` (``None`` without ``/proc``)."""
    try:
        inodes = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        count = 0
        for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
            try:
                with open(table) as f:
                    rows = f.read().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                cols = row.split()
                if (len(cols) > 9 and cols[3] == "01" and cols[9] in inodes
                        and int(cols[1].rpartition(":")[2], 16) == port):
                    count += 1
        return count
    except OSError:
        return None


def wait_until_free(bind_address: str, timeout_seconds: float) -> bool:
    """Waits (bounded) until nothing listens on ``bind_address`` (e.g. a previous run's service).

    Returns whether the address is free.
    """
    host, _, port = bind_address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    deadline = time.monotonic() + timeout_seconds
    while True:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, int(port)))
                return True
            except OSError:
                if time.monotonic() >= deadline:
                    return False
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
