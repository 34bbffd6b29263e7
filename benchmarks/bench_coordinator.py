"""ClusterCoordinator benchmark: scheduled training steps/s with 2 workers and 1 ps, against
the between-graph mode (every worker runs its own loop) on the same model, in the same run.

Model: MLP 784-256-10 (~200k parameters), batch 64, adam applied on the ps. Every process is
a real process on 127.0.0.1 (JAX on CPU, one device each). In coordinator mode this process
is the chief and schedules every step; in between-graph mode two worker processes loop.

Then the coordinator's own cost per closure: no-op functions per second on 2 workers, over the
workers' direct ports (the default) and over gRPC only.

Example:
    $ python -m benchmarks.bench_coordinator            # 600 steps per mode
    $ python -m benchmarks.bench_coordinator --quick    # 60 steps
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "1")

import numpy as np  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 64


def _model():
    """``(init, grad_fn)`` of the benchmark MLP (the same in both modes)."""
    import jax
    import jax.numpy as jnp

    import jaxdist

    def init():
        k1, k2 = jax.random.split(jax.random.key(0))
        return {"w1": jax.random.normal(k1, (784, 256)) * 0.05, "b1": jnp.zeros(256),
                "w2": jax.random.normal(k2, (256, 10)) * 0.05, "b2": jnp.zeros(10)}

    def grad_fn(p, xb, yb):
        def loss(p):
            h = jax.nn.relu(xb @ p["w1"] + p["b1"])
            logits = h @ p["w2"] + p["b2"]
            per = -jnp.take_along_axis(jax.nn.log_softmax(logits), yb[:, None], 1)[:, 0]
            return jaxdist.compute_average_loss(per, global_batch_size=BATCH)
        return jax.value_and_grad(loss)(p)

    return init, grad_fn


def _data(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(BATCH, 784)).astype(np.float32),
            rng.integers(0, 10, size=(BATCH,)).astype(np.int32))


def _repeat_batch(ctx):
    """The per-worker dataset: this worker's batch, forever (as in the between-graph run)."""
    import itertools

    return itertools.repeat(_data(ctx.input_pipeline_id))


# ---------------------------------------------------------------------- between-graph
def _between_graph_worker(steps: int, warmup: int) -> None:
    """Child process: one worker of the between-graph run; prints its timed steps."""
    import jaxdist
    from jaxdist.ps import optimizers as O

    strategy = jaxdist.ParameterServerStrategy(timeout=60)
    init, grad_fn = _model()
    x, y = _data(strategy.extended.worker_index)
    params = strategy.create_variables(init, O.adam(1e-3), name="mlp")

    def step():
        loss, grads = strategy.run(grad_fn, args=(params, x, y))
        params.apply_gradients(grads)

    for _ in range(warmup):
        step()
    # Barrier on ps:0 so that both workers time the same window (startup skew excluded).
    from jaxdist.ps.variables import wait_for_marker

    client = strategy.extended.ps_client
    client.call(0, "SetMarker", {"name": f"bench/ready{strategy.extended.worker_index}"})
    for i in range(2):
        wait_for_marker(client, f"bench/ready{i}", 120.0, f"worker {i}")
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    print(json.dumps({"steps": steps, "start": t0, "end": time.perf_counter()}), flush=True)


def _cluster(n_workers: int, chief: bool):
    from jaxdist.testing import LocalCluster

    return LocalCluster(workers=n_workers, ps=1, chief=chief, devices_per_process=1,
                        env={"JAX_NUM_CPU_DEVICES": "1"})


def between_graph_steps_per_s(steps_per_worker: int, warmup: int) -> float:
    """Total steps/s of 2 between-graph workers (overlapping timed windows)."""
    c = _cluster(2, chief=False)
    try:
        c.start_task("ps:0", [sys.executable, "-m", "jaxdist.server"])
        c.wait_for_output("ps:0", "listening on", 60)
        cmd = [sys.executable, "-m", "benchmarks.bench_coordinator", "--between-graph-worker",
               str(steps_per_worker), str(warmup)]
        for i in range(2):
            c.start_task(f"worker:{i}", cmd)
        c.join(600, tasks=["worker:0", "worker:1"])
        outs = [json.loads([ln for ln in c.output(f"worker:{i}").splitlines()
                            if ln.startswith("{")][-1]) for i in range(2)]
    finally:
        c.stop()
    # perf_counter is CLOCK_MONOTONIC on Linux: comparable across processes of one machine.
    wall = max(o["end"] for o in outs) - min(o["start"] for o in outs)
    return sum(o["steps"] for o in outs) / wall


# ---------------------------------------------------------------------- coordinator
class _Chief:
    def __init__(self, cluster: dict, token: str):
        self._cluster, self.cluster_token = cluster, token
        self.task_type, self.task_id = "chief", 0

    def cluster_spec(self) -> dict:
        return self._cluster


def coordinator_steps_per_s(steps: int, warmup: int) -> float:
    """Steps/s of ``steps`` functions scheduled onto 2 worker tasks by this process."""
    import jaxdist
    from jaxdist.coordinator import ClusterCoordinator
    from jaxdist.ps import optimizers as O

    c = _cluster(2, chief=True)
    try:
        for name in ("ps:0", "worker:0", "worker:1"):
            c.start_task(name, [sys.executable, "-m", "jaxdist.server"])
        for name in ("ps:0", "worker:0", "worker:1"):
            c.wait_for_output(name, "listening on", 60)
        os.environ.update(c.security_env("chief:0"))  # this process is the chief
        strategy = jaxdist.ParameterServerStrategy(_Chief(c.cluster, c.token), timeout=60)
        init, grad_fn = _model()
        with strategy.scope():
            params = strategy.create_variables(init, O.adam(1e-3), name="mlp")
        coordinator = ClusterCoordinator(strategy)
        it = iter(coordinator.create_per_worker_dataset(_repeat_batch))

        def step(it):
            x, y = next(it)
            loss, grads = strategy.run(grad_fn, args=(params, x, y))
            params.apply_gradients(grads)
            return loss

        for _ in range(2 * warmup):
            coordinator.schedule(step, args=(it,))
        coordinator.join()
        t0 = time.perf_counter()
        for _ in range(steps):
            coordinator.schedule(step, args=(it,))
        coordinator.join()
        elapsed = time.perf_counter() - t0
        coordinator.shutdown()
        return steps / elapsed
    finally:
        c.stop()


def noop_closures_per_s(n: int, direct: bool) -> float:
    """Closures/s of ``n`` functions that do nothing, on 2 workers: the coordinator's own cost
    per closure, over the workers' direct ports or over gRPC only."""
    import jaxdist
    from jaxdist.coordinator import ClusterCoordinator
    from jaxdist.coordinator.worker_service import ENV_DIRECT

    c = _cluster(2, chief=True)
    saved = os.environ.get(ENV_DIRECT)
    try:
        for name in ("ps:0", "worker:0", "worker:1"):
            c.start_task(name, [sys.executable, "-m", "jaxdist.server"])
        for name in ("ps:0", "worker:0", "worker:1"):
            c.wait_for_output(name, "listening on", 60)
        os.environ.update(c.security_env("chief:0"))
        os.environ[ENV_DIRECT] = "1" if direct else "0"  # read by the coordinator's client
        strategy = jaxdist.ParameterServerStrategy(_Chief(c.cluster, c.token), timeout=60)
        coordinator = ClusterCoordinator(strategy)

        def noop():
            return 1

        for _ in range(50):
            coordinator.schedule(noop)
        coordinator.join()
        t0 = time.perf_counter()
        for _ in range(n):
            coordinator.schedule(noop)
        coordinator.join()
        elapsed = time.perf_counter() - t0
        coordinator.shutdown()
        return n / elapsed
    finally:
        if saved is None:
            os.environ.pop(ENV_DIRECT, None)
        else:
            os.environ[ENV_DIRECT] = saved
        c.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_coordinator")
    parser.add_argument("--quick", action="store_true", help="fewer steps, one round")
    parser.add_argument("--rounds", type=int, help="rotated rounds (default 5, quick 1)")
    parser.add_argument("--steps", type=int,
                        help="steps per mode and round (default 600: ~2 s timed per mode)")
    parser.add_argument("--between-graph-worker", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.between_graph_worker:
        return _between_graph_worker(*args.between_graph_worker)
    import statistics

    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    steps = args.steps or (60 if args.quick else 600)
    rounds = args.rounds or (1 if args.quick else 5)
    warmup = 5
    from benchmarks.common import print_machine

    print_machine()
    print(f"jaxdist ClusterCoordinator benchmark ({os.cpu_count()} CPUs, loopback, mutual TLS): "
          f"2 workers, 1 ps, MLP 784-256-10, batch {BATCH}, adam on the ps, {steps} steps, "
          f"{rounds} rotated rounds (between-graph, coordinator, between-graph, ...)")
    bgs, cos = [], []
    for r in range(rounds):
        bgs.append(between_graph_steps_per_s(steps // 2, warmup))
        cos.append(coordinator_steps_per_s(steps, warmup))
        print(f"round {r + 1}: between-graph {bgs[-1]:.1f} steps/s, coordinator "
              f"{cos[-1]:.1f} steps/s, ratio {cos[-1] / bgs[-1]:.2f}", flush=True)
    bg, co = statistics.median(bgs), statistics.median(cos)
    ratio = statistics.median([c / b for c, b in zip(cos, bgs)])
    rows = [("between-graph (2 worker loops)", bg, 1.0),
            ("ClusterCoordinator.schedule", co, ratio)]
    print(f"\n| {'mode (median of rounds)':<32} | {'steps/s':>8} | {'ratio':>6} |")
    print(f"|{'-' * 34}|{'-' * 10}|{'-' * 8}|")
    for name, sps, ratio in rows:
        print(f"| {name:<32} | {sps:>8.1f} | {ratio:>6.2f} |")
    print("(ratio: the median of the per-round ratios; target >= 0.95)")
    n = 600 if args.quick else 3000
    direct, grpc_only = noop_closures_per_s(n, True), noop_closures_per_s(n, False)
    print(f"\nno-op closures, 2 workers, {n} scheduled: {direct:.0f}/s over the workers' direct "
          f"ports, {grpc_only:.0f}/s over gRPC only (JAXDIST_COORDINATOR_DIRECT=0): "
          f"{direct / grpc_only:.2f}x")


if __name__ == "__main__":
    main()
