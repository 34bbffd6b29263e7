"""Ctrl-C ends ``python -m jaxdist.train`` with one line and exit status 130 at any moment: during
the imports, the first compile and training (real processes; CPU, one device)."""

import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
from devutil import xla_flags

ROOT = pathlib.Path(__file__).parent.parent


def _start(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1", PYTHONUNBUFFERED="1",
               XLA_FLAGS=xla_flags())
    argv = [sys.executable, "-m", "jaxdist.train", "--config",
            str(ROOT / "configs" / "default.yaml"), "--set", f"logging.dir={tmp_path}",
            "--set", "train.epochs=1000", "--set", "logging.every_steps=1",
            "--set", "logging.tensorboard=false"]
    # A shell's background job ignores SIGINT (and its children inherit that): undo it, then
    # exec the command line as typed.
    reset = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
             "os.execv(sys.executable, sys.argv[1:])")
    proc = subprocess.Popen(
        [sys.executable, "-c", reset, *argv], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout],
                     daemon=True).start()
    return proc, lines


def _importing(proc) -> bool:
    """Whether the process has begun loading jaxlib (its imports are under way)."""
    try:
        return "jaxlib" in pathlib.Path(f"/proc/{proc.pid}/maps").read_text()
    except OSError:
        return False


def _wait_for(lines, prefix: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            if lines.get(timeout=0.05).startswith(prefix):
                return
        except queue.Empty:
            pass
    raise AssertionError(f"no line starting with {prefix!r}")


@pytest.mark.slow
@pytest.mark.platform("cpu")
@pytest.mark.parametrize("moment, attempt", [
    ("import", 0), ("import", 1),
    # a Ctrl-C during the first compile used to end in a native crash about 1 time in 4
    ("first compile", 0), ("first compile", 1), ("first compile", 2), ("training", 0)])
def test_ctrl_c_exits_130_with_one_line(tmp_path, moment, attempt):
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs Linux /proc to see the imports")
    proc, lines = _start(tmp_path)
    deadline = time.monotonic() + 60
    try:
        if moment == "import":
            while not _importing(proc) and time.monotonic() < deadline:
                time.sleep(0.005)
        elif moment == "first compile":   # the banner comes right before the first step
            _wait_for(lines, "jaxdist: ", deadline)
            time.sleep(0.015 * attempt)
        else:
            _wait_for(lines, "[train] step ", deadline)
        assert proc.poll() is None, "it ended before the interrupt"
        proc.send_signal(signal.SIGINT)
        stderr = proc.stderr.read()
        status = proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert status == 130, stderr
    assert stderr.splitlines() == ["python -m jaxdist.train: interrupted"], stderr

