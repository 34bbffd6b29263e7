"""A program that ends without stopping its ``LocalCluster`` (a notebook whose later cell
fails) leaves no task behind (issue 35, point 6)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

PROGRAM = """
import sys
from jaxdist.testing import LocalCluster

cluster = LocalCluster(workers=1, ps=1, devices_per_process=None, tls=False)
cluster.start([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"])
for name in cluster.task_names:
    cluster.wait_for_output(name, "up", timeout=60)
print("pids", *[cluster.tasks[n].pid for n in cluster.task_names], flush=True)
raise RuntimeError("a later cell fails")
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().split()[2] != "Z"


def test_tasks_stop_when_the_program_that_started_them_fails():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "a later cell fails" in proc.stderr, proc.stderr[-2000:]
    pids = [int(p) for p in proc.stdout.split("pids", 1)[1].split()]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "tasks outlived the program that started them"
