"""Speed-up of ``steps_per_execution`` for a small model, with hand-written loops for comparison.

A small MLP (32-64-10) on synthetic data, global batch 64, Adam. Rows:

* ``hand-written jit loop``: one ``jax.jit`` step per batch on one device (no strategy), the
  loop a JAX user writes first;
* ``hand-written lax.scan (k)``: the same step folded k at a time with ``lax.scan``;
* ``Trainer k=...``: ``jaxdist.Trainer.fit`` under ``MirroredStrategy`` over ``--devices``
  replicas with ``steps_per_execution=k``.

For a model this small each step's compute is tiny, so the per-dispatch host cost (Python,
argument handling, input transfer, collectives set-up) dominates, and folding k steps into one
dispatch removes most of it. Timings are medians of interleaved repeats after a warm-up.

Run: ``python -m benchmarks.bench_steps_per_execution [--devices 2 --steps 256 --repeats 3]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from benchmarks.common import force_cpu_devices, print_table, time_interleaved

GLOBAL_BATCH = 64
FEATURES, HIDDEN, CLASSES = 32, 64, 10


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2,
                   help="CPU replicas to force when there is no accelerator (default 2)")
    p.add_argument("--steps", type=int, default=256, help="steps per timed run (default 256)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (default 3)")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 4, 16, 64],
                   help="steps_per_execution values (default 1 4 16 64)")
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
    from jaxdist.train.data import make_synthetic
    from jaxdist.train.models import MLP
    from jaxdist.train.trainer import Trainer

    n_examples = GLOBAL_BATCH * 128  # one epoch = 128 steps, divisible by every default k
    train, _ = make_synthetic(n_examples, FEATURES, CLASSES, validation_split=0.0)
    strategy = jaxdist.MirroredStrategy()
    tx = optax.adam(1e-3)
    runners = {}

    # -- hand-written loops, one device -------------------------------------------------
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

    jit_step = jax.jit(step)
    scan_steps = jax.jit(lambda carry, xs, ys: jax.lax.scan(step, carry, (xs, ys)))
    xs_host = train.x.reshape(-1, GLOBAL_BATCH, FEATURES)
    ys_host = train.y.reshape(-1, GLOBAL_BATCH)
    hand = {"carry": (params0, tx.init(params0))}

    def hand_loop(steps: int) -> None:
        carry = hand["carry"]
        for i in range(steps):
            j = i % len(xs_host)
            carry, loss = jit_step(carry, (jnp.asarray(xs_host[j]), jnp.asarray(ys_host[j])))
        jax.block_until_ready(carry)
        hand["carry"] = carry

    def hand_scan(k: int):
        def run(steps: int) -> None:
            carry = hand["carry"]
            for i in range(0, steps, k):
                j = i % len(xs_host)
                carry, _ = scan_steps(carry, jnp.asarray(xs_host[j:j + k]),
                                      jnp.asarray(ys_host[j:j + k]))
            jax.block_until_ready(carry)
            hand["carry"] = carry

        return run

    runners["hand-written jit loop"] = hand_loop
    kmax = max(args.ks)
    runners[f"hand-written lax.scan ({kmax})"] = hand_scan(kmax)

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

        runners[f"Trainer k={k}"] = fit

    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # the Trainer's log lines
        for run in runners.values():  # warm-up: compile every variant
            run(kmax)
        per_step = time_interleaved(runners, args.steps, args.repeats)

    base = per_step["Trainer k=1"] if "Trainer k=1" in per_step else None
    rows = []
    for name, sec in per_step.items():
        k = name.split("k=")[-1] if "k=" in name else ("1" if "jit loop" in name else str(kmax))
        speed = f"{base / sec:.2f}x" if base else "-"
        rows.append((name, k, 1000.0 * sec, GLOBAL_BATCH / sec, speed))
    title = (f"steps_per_execution: MLP {FEATURES}-{HIDDEN}-{CLASSES}, global batch "
             f"{GLOBAL_BATCH}, {strategy.num_replicas_in_sync} replicas "
             f"({jax.devices()[0].platform}), {args.steps} steps x {args.repeats}")
    return print_table(title, ["runner", "steps/dispatch", "ms/step", "examples/s",
                               "speed-up vs Trainer k=1"], rows)


if __name__ == "__main__":
    main()
