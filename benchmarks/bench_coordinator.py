"""ClusterCoordinator benchmark: scheduled training steps/s with 2 workers and 1 ps, against
the between-graph mode (every worker runs its own loop) on the same model, in the same run.

Model: MLP 784-256-10 (~200k parameters), batch 64, adam applied on the ps. Every process is
a real process on 127.0.0.1 (JAX on CPU, one device each). In coordinator mode this process
is the chief and schedules every step; in between-graph mode two worker processes loop.

Then the coordinator's own cost per closure: no-op functions per second on 2 workers, over the
workers' direct ports (the default) and over gRPC only.

Example:
    $ python -m benchmarks.bench_coordinator            # 10 rounds of 600 steps per mode
    $ python -m benchmarks.bench_coordinator --quick    # 2 rounds of 20 steps
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
# The documented switch of the coordinator's direct transport (docs/coordinator.md).
ENV_DIRECT = "JAXDIST_COORDINATOR_DIRECT"


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
def _between_graph_worker(warmup: int) -> None:
    """Child process: one worker of the between-graph run. After ``warmup`` steps it prints
    ``ready``, then for each line ``N`` on stdin it runs N timed steps and prints their
    window (an empty line or end of input: exit)."""
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
    print(_LINE, json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        steps = int(line)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        print(_LINE, json.dumps({"steps": steps, "start": t0, "end": time.perf_counter()}),
              flush=True)


_LINE = "BENCH"


def _cluster(n_workers: int, chief: bool):
    from jaxdist.testing import LocalCluster

    return LocalCluster(workers=n_workers, ps=1, chief=chief, devices_per_process=1,
                        env={"JAX_NUM_CPU_DEVICES": "1"})


def _read_line(proc, timeout: float) -> dict:
    """The next ``BENCH`` line a between-graph worker prints (other output is skipped).

    Reads the pipe's descriptor itself: a buffered ``readline`` could take two lines at once,
    and ``select`` would then wait for the second, already read, until the timeout."""
    import select

    deadline = time.monotonic() + timeout
    fd, buf = proc.stdout.fileno(), proc.bench_buf
    while True:
        line, sep, rest = buf.partition(b"\n")
        if sep:
            buf = rest
            if line.startswith(_LINE.encode() + b" "):
                proc.bench_buf = buf
                return json.loads(line[len(_LINE) + 1:])
            continue
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError(f"between-graph worker (pid {proc.pid}) printed nothing within "
                               f"{timeout:g} s")
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            raise RuntimeError(f"between-graph worker (pid {proc.pid}) exited with "
                               f"{proc.wait()}")
        buf += chunk


class BetweenGraph:
    """ps:0 and 2 worker processes that each loop on their own (TF1 between-graph), kept
    alive and driven in timed windows (idle, blocked on a read, between them)."""

    def __init__(self, warmup: int):
        import subprocess
        import tempfile

        self.cluster = _cluster(2, chief=False)
        self.procs: list = []
        self._log = tempfile.TemporaryFile(mode="w+")
        try:
            self.cluster.start_task("ps:0", [sys.executable, "-m", "jaxdist.server"])
            self.cluster.wait_for_output("ps:0", "listening on", 60)
            cmd = [sys.executable, "-m", "benchmarks.bench_coordinator",
                   "--between-graph-worker", str(warmup)]
            for i in range(2):
                proc = subprocess.Popen(
                    cmd, env=self.cluster.env_for(f"worker:{i}"), cwd=REPO,
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log)
                proc.bench_buf = b""
                self.procs.append(proc)
            for proc in self.procs:
                _read_line(proc, 300)
        except BaseException:
            self.close()
            raise

    def steps_per_s(self, steps: int) -> float:
        """Total steps/s of both workers running ``steps // 2`` steps each, started together
        (the wall from the first start to the last end)."""
        for proc in self.procs:
            proc.stdin.write(f"{steps // 2}\n".encode())
            proc.stdin.flush()
        outs = [_read_line(proc, 600) for proc in self.procs]
        # perf_counter is CLOCK_MONOTONIC on Linux: comparable across processes of one machine.
        wall = max(o["end"] for o in outs) - min(o["start"] for o in outs)
        return sum(o["steps"] for o in outs) / wall

    def close(self) -> None:
        for proc in self.procs:
            try:
                proc.stdin.close()
                proc.wait(30)
            except Exception:  # noqa: BLE001 - a stuck worker is killed below
                proc.kill()
                proc.wait()
        self.cluster.stop()
        self._log.close()


# ---------------------------------------------------------------------- coordinator
class _Chief:
    def __init__(self, cluster: dict, token: str):
        self._cluster, self.cluster_token = cluster, token
        self.task_type, self.task_id = "chief", 0

    def cluster_spec(self) -> dict:
        return self._cluster


class Coordinator:
    """ps:0 and 2 worker tasks, with this process as the chief that schedules every step
    (kept alive, driven in timed windows)."""

    def __init__(self, warmup: int):
        import jaxdist
        from jaxdist.coordinator import ClusterCoordinator
        from jaxdist.ps import optimizers as O

        self.cluster = c = _cluster(2, chief=True)
        self.coordinator = None
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
            self.coordinator = ClusterCoordinator(strategy)
            self._it = iter(self.coordinator.create_per_worker_dataset(_repeat_batch))

            def step(it):
                x, y = next(it)
                loss, grads = strategy.run(grad_fn, args=(params, x, y))
                params.apply_gradients(grads)
                return loss

            self._step = step
            for _ in range(2 * warmup):
                self.coordinator.schedule(step, args=(self._it,))
            self.coordinator.join()
        except BaseException:
            self.close()
            raise

    def steps_per_s(self, steps: int) -> float:
        """Steps/s of ``steps`` functions scheduled onto the 2 worker tasks."""
        t0 = time.perf_counter()
        for _ in range(steps):
            self.coordinator.schedule(self._step, args=(self._it,))
        self.coordinator.join()
        return steps / (time.perf_counter() - t0)

    def close(self) -> None:
        if self.coordinator is not None:
            self.coordinator.shutdown()
        self.cluster.stop()


def noop_closures_per_s(n: int, direct: bool) -> float:
    """Closures/s of ``n`` functions that do nothing, on 2 workers: the coordinator's own cost
    per closure, over the workers' direct ports or over gRPC only."""
    import jaxdist
    from jaxdist.coordinator import ClusterCoordinator

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
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument("--rounds", type=int, help="rounds (default 10, quick 2)")
    parser.add_argument("--steps", type=int,
                        help="steps per mode and round (default 600: ~1.5 s timed per mode)")
    parser.add_argument("--between-graph-worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.between_graph_worker is not None:
        return _between_graph_worker(args.between_graph_worker)
    import statistics

    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    steps = args.steps or (20 if args.quick else 600)
    rounds = args.rounds or (2 if args.quick else 10)
    warmup = 5
    from benchmarks.common import print_machine

    print_machine()
    print(f"jaxdist ClusterCoordinator benchmark ({os.cpu_count()} CPUs, loopback, mutual TLS): "
          f"2 workers, 1 ps, MLP 784-256-10, batch {BATCH}, adam on the ps, {steps} steps per "
          f"mode and round, {rounds} rounds. Both clusters stay up; each round times one "
          f"window of each mode back to back (between-graph first in odd rounds, the "
          f"coordinator first in even ones), so that a change in machine speed between rounds "
          f"cancels in the round's ratio.")
    bgs, cos = [], []
    between = BetweenGraph(warmup)  # before the chief's credentials enter os.environ
    try:
        coordinator = Coordinator(warmup)
        try:
            for r in range(rounds):
                if r % 2 == 0:
                    bgs.append(between.steps_per_s(steps))
                    cos.append(coordinator.steps_per_s(steps))
                else:
                    cos.append(coordinator.steps_per_s(steps))
                    bgs.append(between.steps_per_s(steps))
                print(f"round {r + 1}: between-graph {bgs[-1]:.1f} steps/s, coordinator "
                      f"{cos[-1]:.1f} steps/s, ratio {cos[-1] / bgs[-1]:.3f}", flush=True)
        finally:
            coordinator.close()
    finally:
        between.close()
    bg, co = statistics.median(bgs), statistics.median(cos)
    ratio = statistics.median([c / b for c, b in zip(cos, bgs)])
    rows = [("between-graph (2 worker loops)", bg, 1.0),
            ("ClusterCoordinator.schedule", co, ratio)]
    print(f"\n| {'mode (median of rounds)':<32} | {'steps/s':>8} | {'ratio':>6} |")
    print(f"|{'-' * 34}|{'-' * 10}|{'-' * 8}|")
    for name, sps, ratio in rows:
        print(f"| {name:<32} | {sps:>8.1f} | {ratio:>6.3f} |")
    print(f"(ratio: the median of the per-round ratios; target >= 0.95; per-round ratios "
          f"{min(c / b for c, b in zip(cos, bgs)):.3f}-{max(c / b for c, b in zip(cos, bgs)):.3f})")
    n = 200 if args.quick else 3000
    direct, grpc_only = noop_closures_per_s(n, True), noop_closures_per_s(n, False)
    print(f"\nno-op closures, 2 workers, {n} scheduled: {direct:.0f}/s over the workers' direct "
          f"ports, {grpc_only:.0f}/s over gRPC only (JAXDIST_COORDINATOR_DIRECT=0): "
          f"{direct / grpc_only:.2f}x")


if __name__ == "__main__":
    main()
