"""The cost of ``steps_per_execution`` k = 1, 2, 4, ..., 64, against hand-written JAX at each k.

A small MLP (32-64-10) on synthetic data, global batch 64, Adam, on ``--devices`` replicas
(forced CPU devices without an accelerator). For each k:

* ``hand-written``: one ``jax.jit`` step per batch (k = 1), or the same step folded k at a time
  with ``lax.scan`` (k > 1), over a mesh of the same devices with ``NamedSharding`` (batch split
  on rows); the k batches ``jax.device_put`` per dispatch, waiting on dispatch i-2 before i (as
  the strategy does: unbounded dispatches of collectives abort XLA's CPU rendezvous);
* ``Trainer``: ``jaxdist.Trainer.fit`` under ``MirroredStrategy`` with
  ``steps_per_execution=k`` (its own input pipeline, logging every 10^9 steps).

For a model this small each step's compute is tiny, so the per-dispatch host cost (Python,
argument handling, input transfer, collectives set-up) dominates, and folding k steps into one
dispatch removes most of it. Timings are medians of interleaved, rotated rounds after a warm-up.

Run: ``python -m benchmarks.bench_steps_per_execution [--devices 2 --steps 512 --repeats 5]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from benchmarks.common import force_cpu_devices, print_machine, print_table, time_interleaved

GLOBAL_BATCH = 64
FEATURES, HIDDEN, CLASSES = 32, 64, 10


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2,
                   help="CPU replicas to force when there is no accelerator (default 2)")
    p.add_argument("--steps", type=int, default=512,
                   help="steps per timed run, a multiple of every k (default 512)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64],
                   help="steps_per_execution values (default 1 2 4 ... 64)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> str:
    """Runs the benchmark and returns the printed table."""
    args = _parse(argv)
    force_cpu_devices(args.devices)

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jaxdist
    from jaxdist.train import Trainer
    from jaxdist.train.data import make_synthetic
    from jaxdist.train.models import MLP

    print_machine()
    n_examples = GLOBAL_BATCH * 128  # one epoch = 128 steps, divisible by every default k
    train, _ = make_synthetic(n_examples, FEATURES, CLASSES, validation_split=0.0)
    strategy = jaxdist.MirroredStrategy()
    tx = optax.adam(1e-3)
    runners = {}

    # -- hand-written loops on the same devices --------------------------------------------
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    bad = [k for k in args.ks if args.steps % k]
    if bad:
        raise SystemExit(f"--steps {args.steps} is not a multiple of k={bad}")
    mesh = jax.make_mesh((strategy.num_replicas_in_sync,), ("data",),
                         devices=list(strategy.extended.worker_devices),
                         axis_types=(jax.sharding.AxisType.Auto,))
    rep = NamedSharding(mesh, P())
    rows, stacked = NamedSharding(mesh, P("data")), NamedSharding(mesh, P(None, "data"))
    model = MLP(FEATURES, [HIDDEN], CLASSES, rngs=nnx.Rngs(0))
    graphdef, params0 = nnx.split(model, nnx.Param)

    def loss_fn(p, x, y):
        logits = nnx.merge(graphdef, p)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(carry, batch):
        p, o = carry
        loss, g = jax.value_and_grad(loss_fn)(p, *batch)
        u, o = tx.update(g, o, p)
        return (optax.apply_updates(p, u), o), loss

    jit_step = jax.jit(step, donate_argnums=0)
    scan_steps = jax.jit(lambda carry, xs, ys: jax.lax.scan(step, carry, (xs, ys)),
                         donate_argnums=0)
    xs_host = train.x.reshape(-1, GLOBAL_BATCH, FEATURES)
    ys_host = train.y.reshape(-1, GLOBAL_BATCH)
    carry0 = jax.device_put((params0, tx.init(params0)), rep)

    def hand(k: int):
        state = {"carry": jax.tree.map(jnp.copy, carry0)}

        def run(steps: int) -> None:
            carry, pending = state["carry"], []
            for i in range(0, steps, k):
                if len(pending) >= 2:  # as the strategy: wait on dispatch k-2 before k
                    jax.block_until_ready(pending.pop(0))
                j = i % len(xs_host)
                if k == 1:
                    xb, yb = jax.device_put((xs_host[j], ys_host[j]), rows)
                    carry, loss = jit_step(carry, (xb, yb))
                else:
                    xb, yb = jax.device_put((xs_host[j:j + k], ys_host[j:j + k]), stacked)
                    carry, loss = scan_steps(carry, xb, yb)
                pending.append(loss)
            jax.block_until_ready((carry, pending))
            state["carry"] = carry

        return run

    # -- the Trainer under MirroredStrategy -----------------------------------------------
    trainers = {}
    for k in args.ks:
        with strategy.scope():
            m = MLP(FEATURES, [HIDDEN], CLASSES, rngs=nnx.Rngs(0))
            trainers[k] = Trainer(m, tx, global_batch_size=GLOBAL_BATCH, strategy=strategy,
                                  steps_per_execution=k, progress_bar="never",
                                  log_every_steps=10**9, halt_on_nan=False)

        def fit(steps: int, t=trainers[k]) -> None:
            t.fit((train.x, train.y), steps=t.step + steps)
            jax.block_until_ready(t.params)

        runners[f"hand-written k={k}"] = hand(k)
        runners[f"Trainer k={k}"] = fit

    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # the Trainer's log lines
        for run in runners.values():  # warm-up: compile every variant
            run(max(args.ks))
        per_step = time_interleaved(runners, args.steps, args.repeats)

    base = per_step.get("Trainer k=1")
    rows_out = []
    for k in args.ks:
        hw, tr = per_step[f"hand-written k={k}"], per_step[f"Trainer k={k}"]
        rows_out.append((k, 1000.0 * hw, 1000.0 * tr, GLOBAL_BATCH / tr, f"{hw / tr:.3f}",
                         f"{base / tr:.2f}x" if base else "-"))
    title = (f"steps_per_execution: MLP {FEATURES}-{HIDDEN}-{CLASSES}, global batch "
             f"{GLOBAL_BATCH}, Adam, {strategy.num_replicas_in_sync} replicas "
             f"({jax.devices()[0].platform}); median of {args.repeats} rotated rounds of "
             f"{args.steps} steps")
    return print_table(title, ["k", "hand-written ms/step", "Trainer ms/step",
                               "Trainer examples/s", "Trainer / hand-written",
                               "Trainer speed-up vs k=1"], rows_out)


if __name__ == "__main__":
    main()
