"""Small helpers for the parameter-server tests: free ports, ps/worker subprocesses on 127.0.0.1.

Every process is small: JAX on CPU with one device (JAX_NUM_CPU_DEVICES=1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from devutil import xla_flags

from jaxdist.testing import pick_free_ports
from jaxdist.testing.tls import install_process_tls, task_tls

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "ps-test-token"
CLIENT_TLS = install_process_tls()  # this process speaks mutual TLS to the tasks it starts


def free_ports(n: int) -> list[int]:
    return pick_free_ports(n)


def make_cluster(num_ps: int, num_workers: int) -> dict[str, list[str]]:
    ports = free_ports(num_ps + num_workers)
    return {
        "ps": [f"127.0.0.1:{p}" for p in ports[:num_ps]],
        "worker": [f"127.0.0.1:{p}" for p in ports[num_ps:]],
    }


def task_env(cluster: dict, task_type: str, index: int, token: str | None = TOKEN,
             devices: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    config = {"cluster": cluster, "task": {"type": task_type, "index": index}}
    if token:
        config["token"] = token
    env["TF_CONFIG"] = json.dumps(config)
    env.pop("JAXDIST_CLUSTER_TOKEN", None)
    env.update(task_tls().env())
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_NUM_CPU_DEVICES"] = str(devices)
    env["XLA_FLAGS"] = xla_flags(devices)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _spawn_ps(cluster: dict, index: int, token: str | None,
              checkpoint_dir: str | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jaxdist.server"]
    if checkpoint_dir:
        cmd += ["--checkpoint_dir", checkpoint_dir]
    return subprocess.Popen(cmd, env=task_env(cluster, "ps", index, token), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_listening(proc: subprocess.Popen, index: int, timeout: float) -> subprocess.Popen:
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        lines.append(line)
        if "listening on" in line:
            return proc
    proc.kill()
    raise RuntimeError(f"ps:{index} did not start: {''.join(lines)[-2000:]}")


def start_ps(cluster: dict, index: int, token: str | None = TOKEN,
             checkpoint_dir: str | None = None, timeout: float = 60.0) -> subprocess.Popen:
    """Starts ``python -m jaxdist.server`` for ps ``index``; returns once it listens."""
    return _wait_listening(_spawn_ps(cluster, index, token, checkpoint_dir), index, timeout)


def start_all_ps(cluster: dict, token: str | None = TOKEN, checkpoint_dir: str | None = None,
                 timeout: float = 60.0) -> list[subprocess.Popen]:
    """``start_ps`` for every ps task of ``cluster``, started together; returns once all
    listen (or kills them all and raises)."""
    procs = [_spawn_ps(cluster, i, token, checkpoint_dir) for i in range(len(cluster["ps"]))]
    try:
        for i, proc in enumerate(procs):
            _wait_listening(proc, i, timeout)
    except BaseException:
        for proc in procs:
            stop(proc)
        raise
    return procs


def run_workers(cluster: dict, script: str, args: list[str], timeout: float = 120.0,
                extra_env: dict | None = None) -> list[dict]:
    """Runs ``script`` once per worker task (in parallel); returns each one's JSON output."""
    procs = []
    for i in range(len(cluster["worker"])):
        env = task_env(cluster, "worker", i)
        env.update(extra_env or {})
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(REPO, "tests", script), *args],
            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for i, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        if p.returncode != 0:
            raise RuntimeError(f"worker:{i} failed ({p.returncode}):\n{err[-4000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """SIGTERM, then wait; returns the exit code (kills after ``timeout``)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout:
        proc.stdout.close()
    return proc.returncode
