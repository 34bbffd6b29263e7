"""Every benchmark is discovered by benchmarks.run and has a quick mode it accepts."""

import os
import subprocess
import sys

import pytest

from benchmarks import run


def test_discovers_every_benchmark():
    names = run.discover()
    for expected in ("bench_strategy_step", "bench_ps", "bench_multi_worker",
                     "bench_steps_per_execution", "bench_coordinator", "bench_keras"):
        assert expected in names


def test_unknown_benchmark_is_an_error(capsys):
    with pytest.raises(SystemExit):
        run.main(["--only", "bench_nope"])
    assert "unknown benchmark" in capsys.readouterr().err


def _quick(name: str) -> subprocess.CompletedProcess:
    """``python -m benchmarks.run --quick --only name``, which must succeed: on the CPU devices
    the benchmark forces itself, whatever devices this test process was given."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--only", name],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.mark.slow
def test_quick_strategy_step_prints_ratios():
    out = _quick("bench_strategy_step")
    assert "jaxdist / best hand-written" in out.stdout
    assert "Machine: " in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 8 | jaxdist |")]
    assert rows, out.stdout
    ratio = float(rows[0].split("|")[5])
    assert ratio > 0  # a measured number, not a placeholder


@pytest.mark.slow
def test_quick_multi_worker_prints_the_ratio_to_hand_written_jax_distributed():
    out = _quick("bench_multi_worker")
    rows = [line for line in out.stdout.splitlines() if line.startswith("| jaxdist |")]
    assert rows, out.stdout
    assert float(rows[0].split("|")[4]) > 0  # examples/s over the hand-written loop's
    assert "| hand-written jax.distributed |" in out.stdout


@pytest.mark.slow
def test_quick_coordinator_prints_the_ratio_to_between_graph():
    out = _quick("bench_coordinator")
    rounds = [line for line in out.stdout.splitlines() if line.startswith("round ")]
    assert len(rounds) == 2, out.stdout  # both clusters stayed up for both rounds
    row = [line for line in out.stdout.splitlines()
           if line.startswith("| ClusterCoordinator.schedule")]
    assert row, out.stdout
    assert float(row[0].split("|")[3]) > 0  # measured, not a placeholder
    assert "no-op closures" in out.stdout


@pytest.mark.slow
def test_quick_dispatch_prints_measured_ratios():
    out = _quick("bench_dispatch")
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 1 | batches")]
    assert len(rows) == 2, out.stdout
    assert all(float(r.split("|")[5]) > 0 for r in rows)  # measured, not placeholders
