"""One accelerator check: the main job, dispatch cost, a compute-bound step, Keras, the tests.

Run on a machine with an accelerator (it also runs on CPU, with small sizes):

    python -m benchmarks.accelerator_check [--budget 300] [--tests-budget 150]

Each part runs in its own process under a share of the time budget, and one summary table
names the chip and what each part measured:

1. the main job (``python -m jaxdist.train --config configs/default.yaml``): wall time and
   final validation accuracy;
2. ``benchmarks.bench_dispatch``: ``jax.jit`` / ``strategy.run`` on a dispatch-bound step;
3. a compute-bound step (an MLP of 4 layers 8192 wide, bf16, batch 8192 on an accelerator)
   through ``strategy.run`` and through ``jax.jit``: TFLOP/s and the ratio to the chip's peak;
4. Keras ``fit`` under ``MirroredStrategy`` against plain Keras: the largest weight difference;
5. the test suite on the accelerator (``-m "not slow"``, stopped at its budget), passed/failed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Dense bf16 peak TFLOP/s by ``device_kind`` (public data sheets; SXM parts).
PEAK_BF16_TFLOPS = {
    "NVIDIA H200": 989.0,
    "NVIDIA H100 80GB HBM3": 989.0,
    "NVIDIA H100": 989.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0,
    "TPU v5": 459.0,
    "TPU v6 lite": 918.0,
}

COMPUTE_SCRIPT = r"""
import json, sys, time
import jax, jax.numpy as jnp
import jaxdist
dev = jax.devices()[0]
cpu = dev.platform == "cpu"
width, batch, layers = (512, 512, 4) if cpu else (8192, 8192, 4)
dtype = jnp.float32 if cpu else jnp.bfloat16
keys = jax.random.split(jax.random.key(0), layers)
params = [jax.random.normal(k, (width, width), dtype) / width ** 0.5 for k in keys]
x = jax.random.normal(jax.random.key(1), (batch, width), dtype)

def loss(params, x):
    h = x
    for w in params:
        h = jnp.tanh(h @ w)
    return jnp.mean(h.astype(jnp.float32) ** 2)

def step(params, x):
    g = jax.grad(loss)(params, x)
    return [w - 1e-3 * gw for w, gw in zip(params, g)]

flops = 3 * 2 * batch * width * width * layers  # forward + two backward matmuls per layer
strategy = jaxdist.OneDeviceStrategy(dev)
with strategy.scope():
    p_run = [jnp.array(w) for w in params]
jitted = jax.jit(step, donate_argnums=(0,))
p_jit = [jnp.array(w) for w in params]
donate = jaxdist.RunOptions(donate_argnums=(0,))
steps = 5 if cpu else 50
def run_jit(p):
    for _ in range(steps):
        p = jitted(p, x)
    jax.block_until_ready(p); return p
def run_strategy(p):
    for _ in range(steps):
        p = strategy.run(step, args=(p, x), options=donate)
    jax.block_until_ready(p); return p
p_jit = run_jit(p_jit); p_run = run_strategy(p_run)
best = {"jit": 1e9, "run": 1e9}
for _ in range(3):
    t = time.perf_counter(); p_jit = run_jit(p_jit)
    best["jit"] = min(best["jit"], time.perf_counter() - t)
    t = time.perf_counter(); p_run = run_strategy(p_run)
    best["run"] = min(best["run"], time.perf_counter() - t)
print(json.dumps({"kind": getattr(dev, "device_kind", dev.platform), "platform": dev.platform,
                  "shape": f"{layers}x{width}, batch {batch}, {jnp.dtype(dtype).name}",
                  "jit_tflops": flops * steps / best["jit"] / 1e12,
                  "run_tflops": flops * steps / best["run"] / 1e12}))
"""

KERAS_SCRIPT = r"""
import json, os
os.environ.setdefault("KERAS_BACKEND", "jax")
import numpy as np, keras, jaxdist
rng = np.random.default_rng(0)
x = rng.normal(size=(1000, 32)).astype("float32"); y = rng.integers(0, 10, 1000)
def fit(strategy):
    keras.utils.set_random_seed(0)
    ctx = strategy.scope() if strategy else jaxdist.get_strategy().scope()
    with ctx:
        m = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
        m.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    m.fit(x, y, batch_size=100, epochs=2, verbose=0, shuffle=False)
    return [np.asarray(w) for w in m.weights]
a, b = fit(jaxdist.MirroredStrategy()), fit(None)
print(json.dumps({"max_weight_diff": max(float(np.abs(u - v).max()) for u, v in zip(a, b))}))
"""


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str, float]:
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
        return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out, time.monotonic() - start


def _last_json(text: str) -> dict:
    import json

    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"no result line in the output:\n{text[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budget", type=float, default=300.0, help="seconds for everything")
    parser.add_argument("--tests-budget", type=float, default=None,
                        help="seconds for the test suite (default: what the budget leaves)")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.budget
    py = sys.executable
    rows: list[tuple[str, str, str]] = []

    def left(share: float) -> float:
        return max(10.0, (deadline - time.monotonic()) * share)

    import jax

    dev = jax.devices()[0]
    chip = f"{getattr(dev, 'device_kind', dev.platform)} x{jax.device_count()} ({dev.platform})"

    rc, out, secs = _run([py, "-m", "jaxdist.train", "--config", "configs/default.yaml"],
                         left(0.2))
    acc = re.findall(r"val_accuracy=([0-9.]+)", out)
    rows.append(("main job (configs/default.yaml)",
                 f"val acc {acc[-1]} in {secs:.1f} s" if rc == 0 and acc else f"FAILED ({rc})",
                 "exit 0, val acc >= 0.95"))

    rc, out, _ = _run([py, "-m", "benchmarks.bench_dispatch", "--steps", "200", "--repeats", "5",
                       "--devices", "1"], left(0.2))
    ratios = [line.split("|")[5].strip() for line in out.splitlines()
              if line.startswith("| 1 | batches")]
    rows.append(("dispatch-bound step, jax.jit / strategy.run",
                 f"on device {ratios[0]}, from host {ratios[1]}" if rc == 0 and len(ratios) == 2
                 else f"FAILED ({rc})", ">= 0.95"))

    rc, out, _ = _run([py, "-c", COMPUTE_SCRIPT], left(0.25))
    if rc == 0:
        r = _last_json(out)
        peak = PEAK_BF16_TFLOPS.get(r["kind"])
        of_peak = f", {r['run_tflops'] / peak:.0%} of {peak:.0f} peak" if peak else ""
        rows.append((f"compute-bound step ({r['shape']})",
                     f"run {r['run_tflops']:.1f} TFLOP/s, jit {r['jit_tflops']:.1f} "
                     f"(ratio {r['run_tflops'] / r['jit_tflops']:.3f}){of_peak}", ">= 0.95 of jit"))
    else:
        rows.append(("compute-bound step", f"FAILED ({rc}): {out[-300:]}", ""))

    rc, out, _ = _run([py, "-c", KERAS_SCRIPT], left(0.3))
    rows.append(("Keras fit, Mirrored vs plain",
                 f"max weight diff {_last_json(out)['max_weight_diff']:.2e}" if rc == 0
                 else f"FAILED ({rc})", "<= 1e-5"))

    budget = args.tests_budget or max(10.0, deadline - time.monotonic() - 5)
    platforms = os.environ.get("JAX_PLATFORMS") or (
        f"{dev.platform},cpu" if dev.platform != "cpu" else "cpu")
    rc, out, secs = _run([py, "-m", "pytest", "-q", "-m", "not slow", "-x", "-p",
                          "no:cacheprovider"], budget, env={"JAX_PLATFORMS": platforms})
    summary = [line for line in out.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    rows.append((f"tests (-m 'not slow', JAX_PLATFORMS={platforms})",
                 (summary[-1].strip("= ") if summary else "no summary")
                 + (" (stopped at the budget)" if rc == 124 else ""), "0 failed"))

    width = max(len(r[0]) for r in rows)
    print(f"\nAccelerator check on {chip}\n")
    print(f"| {'check'.ljust(width)} | measured | target |")
    print(f"|{'-' * (width + 2)}|---|---|")
    for name, value, target in rows:
        print(f"| {name.ljust(width)} | {value} | {target} |")
    return 0 if all("FAILED" not in r[1] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
