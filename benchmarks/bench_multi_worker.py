"""2 processes x 1 device: ``MultiWorkerMirroredStrategy`` vs a hand-written ``jax.distributed``
+ gloo loop, in the same processes, in interleaved rounds.

``python -m benchmarks.bench_multi_worker [--steps 20 --repeats 7]``

A ``LocalCluster`` of 2 worker processes (1 CPU device each, TLS and a cluster token as in
production) runs both loops, alternating them round by round (rotated: A, B; B, A; ...), so a
load drift on the machine hits both. Same model and data as ``bench_strategy_step`` (MLP
784-1024-1024-10, global batch 256, SGD, 8 host batches cycled), each process reading every
global batch and keeping its half of the rows:

* ``jaxdist``: ``MultiWorkerMirroredStrategy`` (``jax.distributed.initialize`` from
  ``TF_CONFIG``), ``experimental_distribute_dataset`` over a ``jaxdist.Dataset`` (AUTO shard
  policy: DATA), ``strategy.run(..., options=RunOptions(donate_argnums=(0, 1)))``; the strategy
  keeps at most 2 steps in flight and watches its peer in the background.
* ``hand-written``: what a JAX user writes after ``jax.distributed.initialize`` (the same
  runtime): a mesh over ``jax.devices()``, ``jax.jit(step, donate_argnums=(0, 1))`` with
  ``NamedSharding``, batches built with ``jax.make_array_from_process_local_data`` two steps
  ahead, waiting on step k-2 before dispatching step k (as jax's multi-process examples do).

The gradients are all-reduced over gloo (TCP on loopback) every step. The table is the chief's
timing (the median of ``--repeats`` rounds of ``--steps`` steps per loop).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import tempfile
from pathlib import Path

from benchmarks.common import machine_line, paired_ratio, print_table, time_interleaved

GLOBAL_BATCH = 256


def worker(args: argparse.Namespace) -> int:
    """One process of the cluster: builds both loops, times them, the chief writes the result."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxdist
    from benchmarks.bench_strategy_step import (
        HOST_BATCHES,
        LR,
        init_params,
        make_data,
        per_example_loss,
    )

    options = jaxdist.CommunicationOptions(timeout_seconds=args.timeout)
    strategy = jaxdist.MultiWorkerMirroredStrategy(communication_options=options)
    nproc, me = jax.process_count(), jax.process_index()
    devices = list(strategy.extended.worker_devices)
    tx = optax.sgd(LR)
    x, y = make_data()

    # -- jaxdist --------------------------------------------------------------------------
    with strategy.scope():
        params = jax.tree.map(jnp.asarray, init_params())
        opt_state = tx.init(params)
    dataset = jaxdist.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).repeat()
    batches = iter(strategy.experimental_distribute_dataset(dataset))
    donate = jaxdist.RunOptions(donate_argnums=(0, 1))

    def step(params, opt_state, xb, yb):
        def loss_fn(p):
            return jaxdist.compute_average_loss(per_example_loss(p, xb, yb),
                                                global_batch_size=GLOBAL_BATCH)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jd = {"p": params, "o": opt_state}

    def run_jaxdist(steps: int) -> None:
        p, o, loss = jd["p"], jd["o"], None
        for _ in range(steps):
            xb, yb = next(batches)
            p, o, loss = strategy.run(step, args=(p, o, xb, yb), options=donate)
        jax.block_until_ready((p, loss))
        jd["p"], jd["o"] = p, o

    # -- hand-written jax.distributed -------------------------------------------------------
    mesh = jax.make_mesh((len(devices),), ("data",), devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,))
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    hw = {"p": jax.device_put(init_params(), rep)}
    hw["o"] = jax.device_put(tx.init(hw["p"]), rep)
    rows = GLOBAL_BATCH // nproc

    def host_batches():
        while True:
            for i in range(HOST_BATCHES):
                s = i * GLOBAL_BATCH + me * rows
                yield x[s:s + rows], y[s:s + rows]

    source, ahead = host_batches(), collections.deque()

    def next_batch():
        while len(ahead) < 2:
            xl, yl = next(source)
            ahead.append((
                jax.make_array_from_process_local_data(data, xl, (GLOBAL_BATCH, *xl.shape[1:])),
                jax.make_array_from_process_local_data(data, yl, (GLOBAL_BATCH,)),
            ))
        return ahead.popleft()

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def hw_step(params, opt_state, xb, yb):
        loss, grads = jax.value_and_grad(lambda p: per_example_loss(p, xb, yb).mean())(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def run_handwritten(steps: int) -> None:
        p, o, pending = hw["p"], hw["o"], collections.deque()
        for _ in range(steps):
            if len(pending) >= 2:
                jax.block_until_ready(pending.popleft())
            xb, yb = next_batch()
            p, o, loss = hw_step(p, o, xb, yb)
            pending.append(loss)
        jax.block_until_ready((p, list(pending)))
        hw["p"], hw["o"] = p, o

    runners = {"hand-written jax.distributed": run_handwritten, "jaxdist": run_jaxdist}
    for run in runners.values():
        run(3)  # compile and warm up
    # Same start, same batches, 3 steps each: both loops must agree before they are timed.
    a = jax.device_get(jax.tree.map(lambda v: v.addressable_data(0), hw["p"]))
    b = jax.device_get(jax.tree.map(lambda v: v.addressable_data(0), jd["p"]))
    diff = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
    if diff > 1e-4:
        raise AssertionError(f"jaxdist diverges from hand-written jax.distributed by {diff:g}")
    rounds: dict[str, list[float]] = {}
    t = time_interleaved(runners, args.steps, args.repeats, rounds)
    if strategy.extended.should_checkpoint and args.out:
        result = {"seconds_per_step": t, "rounds": rounds, "process_count": nproc,
                  "num_replicas": strategy.num_replicas_in_sync, "machine": machine_line()}
        Path(args.out).write_text(json.dumps(result))
    print("done", json.dumps(t), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="steps per round")
    p.add_argument("--repeats", type=int, default=7, help="rounds per loop")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout (s)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)

    from jaxdist.testing import LocalCluster, python_command

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        with LocalCluster(workers=2, devices_per_process=1) as c:
            c.start(python_command(
                "benchmarks.bench_multi_worker", "--worker", "--steps", str(args.steps),
                "--repeats", str(args.repeats), "--timeout", str(args.timeout),
                "--out", str(out)))
            codes = c.join(timeout=900)
            if any(codes.values()):
                raise RuntimeError(f"the benchmark cluster failed:\n{c.describe()}")
        result = json.loads(out.read_text())
    print(result["machine"] + "\n", flush=True)
    t = result["seconds_per_step"]
    hand = "hand-written jax.distributed"
    base = t[hand]
    paired = paired_ratio(result["rounds"], "jaxdist", [hand])
    print_table(
        f"2 processes x 1 device (gloo), MLP 784-1024-1024-10, global batch {GLOBAL_BATCH}, "
        f"SGD, donated state, input included (median of {args.repeats} rotated rounds of "
        f"{args.steps} steps)",
        ["implementation", "ms/step", "examples/s", "ratio vs hand-written",
         "same-round ratio (median)"],
        [[name, sec * 1e3, GLOBAL_BATCH / sec, f"{base / sec:.3f}",
          f"{paired:.3f}" if name == "jaxdist" else ""] for name, sec in t.items()],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
