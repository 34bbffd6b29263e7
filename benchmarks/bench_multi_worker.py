"""2 processes x 1 device (MultiWorkerMirroredStrategy over jax.distributed + gloo) versus
1 process x 2 devices (MirroredStrategy): same model, same global batches, examples/s.

``python -m benchmarks.bench_multi_worker [--steps 300] [--features 1024] [--global-batch 256]``

Both runs use ``jaxdist.testing.workloads linreg`` (a linear model trained with strategy.run,
per-replica gradients all-reduced, optax SGD); the first ``--warmup`` steps are not timed.
The ratio shows what crossing a process boundary costs (a TCP all-reduce per step instead of
an in-process one) on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import print_table


def _workload(args: argparse.Namespace, out: Path, strategy: str) -> list[str]:
    return [
        sys.executable, "-m", "jaxdist.testing.workloads", "linreg", "--strategy", strategy,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--features",
        str(args.features), "--global-batch", str(args.global_batch), "--learning-rate", "0.001",
        "--log-every", "0", "--timeout", "120", "--out", str(out),
    ]


def run_single_process(args: argparse.Namespace, out: Path) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="2",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    env.pop("TF_CONFIG", None)
    r = subprocess.run(_workload(args, out, "mirrored"), env=env, capture_output=True,
                       text=True, timeout=600)
    if r.returncode:
        raise RuntimeError(f"1 process x 2 devices failed:\n{r.stdout}\n{r.stderr}")
    return json.loads(out.read_text())


def run_two_processes(args: argparse.Namespace, out: Path) -> dict:
    from jaxdist.testing import LocalCluster

    with LocalCluster(workers=2, devices_per_process=1) as c:
        c.start(_workload(args, out, "multi_worker"))
        codes = c.join(timeout=600)
        if any(codes.values()):
            raise RuntimeError(f"2 processes x 1 device failed:\n{c.describe()}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--features", type=int, default=1024)
    p.add_argument("--global-batch", type=int, default=256)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        single = run_single_process(args, Path(tmp) / "single.json")
        multi = run_two_processes(args, Path(tmp) / "multi.json")
    ratio = multi["examples_per_second"] / single["examples_per_second"]
    print_table(
        f"MultiWorkerMirroredStrategy vs MirroredStrategy (linear model, {args.features} "
        f"features, global batch {args.global_batch}, {args.steps - args.warmup} timed steps, "
        f"CPU)",
        ["setup", "replicas", "examples/s", "ratio vs 1x2"],
        [
            ["1 process x 2 devices (Mirrored)", single["num_replicas"],
             single["examples_per_second"], 1.0],
            ["2 processes x 1 device (MultiWorker, gloo)", multi["num_replicas"],
             multi["examples_per_second"], ratio],
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
