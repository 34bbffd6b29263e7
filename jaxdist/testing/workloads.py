"""``python -m jaxdist.testing.workloads linreg ...``: a small deterministic training job run as
cluster tasks by tests and benchmarks.

``python -m jaxdist.testing.workloads linreg --steps 8 --global-batch 16 --out w.json`` trains a
linear regression with ``strategy.run`` (per-replica gradients, all-reduced) and optax SGD on
fixed global batches, and writes the final weights (chief only) as JSON. ``--strategy mirrored``
runs the same job on the local devices of one process; the default is
``MultiWorkerMirroredStrategy`` from ``TF_CONFIG``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def global_batches(steps: int, global_batch: int, features: int = 4, seed: int = 0):
    """The fixed global batches ``(x, y)`` of the linear-regression job."""
    import numpy as np

    rng = np.random.default_rng(seed)
    w_true = rng.normal(size=(features,)).astype(np.float32)
    out = []
    for _ in range(steps):
        x = rng.normal(size=(global_batch, features)).astype(np.float32)
        y = (x @ w_true + 0.5).astype(np.float32)
        out.append((x, y))
    return out


def make_train_step(global_batch: int, learning_rate: float = 0.1):
    """A replica step: per-replica gradients, ``all_reduce`` SUM, optax SGD update."""
    import jax
    import jax.numpy as jnp
    import optax

    import jaxdist

    tx = optax.sgd(learning_rate)

    def step(params, opt_state, x, y):
        ctx = jaxdist.get_replica_context()

        def loss_fn(p):
            pred = x @ p["w"] + p["b"]
            return jnp.sum((pred - y) ** 2) / global_batch

        loss, grads = jax.value_and_grad(loss_fn)(ctx.local(params))
        grads = ctx.all_reduce("SUM", grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, ctx.all_reduce("SUM", loss)

    return tx, step


def _run_linreg(args: argparse.Namespace) -> int:
    if args.strategy == "multi_worker":
        import jaxdist

        options = jaxdist.CommunicationOptions(timeout_seconds=args.timeout,
                                               bytes_per_pack=args.bytes_per_pack)
        strategy = jaxdist.MultiWorkerMirroredStrategy(communication_options=options)
    else:
        import jaxdist

        strategy = jaxdist.MirroredStrategy()
    import jax
    import jax.numpy as jnp
    import numpy as np

    tx, step = make_train_step(args.global_batch, args.learning_rate)
    with strategy.scope():
        params = {"w": jnp.zeros((args.features,), jnp.float32), "b": jnp.zeros((), jnp.float32)}
        opt_state = tx.init(params)
    batches = global_batches(args.steps, args.global_batch, args.features)
    dist = strategy.experimental_distribute_dataset(batches)
    print(f"ready {strategy!r} process {jax.process_index()}/{jax.process_count()}", flush=True)
    t0 = time.perf_counter()
    loss = None
    for i, (x, y) in enumerate(dist):
        if i == args.warmup:  # time from here: compilation is done
            jax.block_until_ready(params)
            t0 = time.perf_counter()
        params, opt_state, loss = strategy.run(step, args=(params, opt_state, x, y))
        if args.log_every and i % args.log_every == 0:
            print(f"step {i} loss {float(loss):.6f}", flush=True)
        if args.sleep:
            time.sleep(args.sleep)
    jax.block_until_ready(params)
    elapsed = time.perf_counter() - t0
    timed = args.steps - min(args.warmup, args.steps - 1) if args.warmup else args.steps
    ext = strategy.extended
    chief = getattr(ext, "should_checkpoint", True)
    result = {
        "w": np.asarray(jax.device_get(params["w"])).tolist(),
        "b": float(jax.device_get(params["b"])),
        "loss": float(loss) if loss is not None else None,
        "seconds": elapsed,
        "examples_per_second": timed * args.global_batch / max(elapsed, 1e-9),
        "num_replicas": strategy.num_replicas_in_sync,
        "process_count": jax.process_count(),
    }
    if args.out and chief:
        with open(args.out, "w") as f:
            json.dump(result, f)
    print("done " + json.dumps(result), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point of ``python -m jaxdist.testing.workloads``; returns the exit
    status."""
    p = argparse.ArgumentParser(prog="python -m jaxdist.testing.workloads")
    p.add_argument("job", choices=["linreg"])
    p.add_argument("--strategy", choices=["multi_worker", "mirrored"], default="multi_worker")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--features", type=int, default=4)
    p.add_argument("--learning-rate", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--bytes-per-pack", type=int, default=0)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after each step")
    p.add_argument("--warmup", type=int, default=0, help="untimed first steps (compilation)")
    p.add_argument("--log-every", type=int, default=1, help="print the loss every N steps")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from jaxdist import ClusterAuthenticationError

    try:
        return _run_linreg(args)
    except ClusterAuthenticationError as e:  # refused by the cluster: a message, no traceback
        print(f"jaxdist.testing.workloads: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


__all__ = ["global_batches", "main", "make_train_step"]

if __name__ == "__main__":
    sys.exit(main())
