"""Per-step cost of ``strategy.run`` against ``jax.jit`` on a dispatch-bound step.

A tiny MLP (32-32-4 with batch 32 on CPU, 784-1024-1024-10 with batch 256 on an accelerator),
donated state,
at most 2 steps in flight: the step's compute is small, so the time per step is what the
framework costs around the compiled call. Three ways, interleaved in rounds:

* ``jax.jit``: the hand-written step, ``jax.jit(step, donate_argnums=(0, 1))`` on one device,
  ``jax.jit(jax.shard_map(step))`` over the replica mesh, batches already on the devices;
* ``strategy.run``: the same step through ``MirroredStrategy.run`` with ``RunOptions(donate)``,
  batches already on the devices (``experimental_distribute_values_from_function``);
* ``run + dataset``: batches from the host through ``experimental_distribute_dataset``,
  against a hand-written loop that ``device_put``s each host batch before its step.

Prints seconds per step and the ratios (hand-written / jaxdist: 1.0 means jaxdist costs what
``jax.jit`` costs; higher is faster). ``python -m benchmarks.bench_dispatch [--devices 1 2]``.
"""

from __future__ import annotations

import argparse

from benchmarks.common import force_cpu_devices, paired_ratio, print_machine, print_table

force_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxdist  # noqa: E402
from benchmarks.common import time_interleaved  # noqa: E402

ON_CPU = jax.devices()[0].platform == "cpu"
BATCH = 32 if ON_CPU else 256


def _sizes() -> list[int]:
    return [32, 32, 4] if ON_CPU else [784, 1024, 1024, 10]


def _init(sizes):
    keys = jax.random.split(jax.random.key(0), len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b), jnp.float32) * (1.0 / np.sqrt(a)),
         "b": jnp.zeros((b,), jnp.float32)}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:])
    ]


TX = optax.sgd(0.01, momentum=0.9)


def _loss(params, x, y):
    h = x
    for i, layer in enumerate(params):
        h = h @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    return optax.softmax_cross_entropy_with_integer_labels(h, y).sum() / BATCH


def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(_loss)(params, x, y)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _host_batches(n: int, sizes):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n * BATCH, sizes[0])).astype(np.float32)
    y = rng.integers(0, sizes[-1], n * BATCH).astype(np.int32)
    return x, y


def _bounded(call, steps: int):
    """Runs ``call`` ``steps`` times, waiting on step k-2 before dispatching step k (as
    jaxdist does): at most 2 steps in flight."""
    pending = []
    out = None
    for _ in range(steps):
        if len(pending) >= 2:
            jax.block_until_ready(pending.pop(0))
        out = call()
        pending.append(out)
    jax.block_until_ready(out)


def measure(n_devices: int, steps: int, repeats: int) -> list[list[object]]:
    sizes = _sizes()
    devices = jax.devices()[:n_devices]
    strategy = jaxdist.MirroredStrategy(devices)
    mesh = strategy.extended.mesh
    axes = strategy.extended.replica_axis_names
    replicated = NamedSharding(mesh, P())
    split = NamedSharding(mesh, P(axes))
    donate = jaxdist.RunOptions(donate_argnums=(0, 1))
    xs, ys = _host_batches(steps, sizes)
    per = BATCH // n_devices

    if n_devices == 1:
        hand = jax.jit(step, donate_argnums=(0, 1))
    else:
        def body(params, opt_state, x, y):
            params, opt_state, loss = step(params, opt_state, x[0], y[0])
            return params, opt_state, loss[None]  # the loss differs per replica

        hand = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(axes), P(axes)),
                          out_specs=(P(), P(), P(axes))),
            donate_argnums=(0, 1),
        )

    def stacked(a):
        return a.reshape((n_devices, per, *a.shape[1:]))

    state = {}

    def fresh():
        params = jax.device_put(_init(sizes), replicated)
        return params, jax.device_put(TX.init(params), replicated)

    # Batches already on the devices.
    dev_x = jax.device_put(stacked(xs[:BATCH]) if n_devices > 1 else xs[:BATCH],
                           split if n_devices > 1 else replicated)
    dev_y = jax.device_put(stacked(ys[:BATCH]) if n_devices > 1 else ys[:BATCH],
                           split if n_devices > 1 else replicated)
    pr_x = strategy.experimental_distribute_values_from_function(
        lambda ctx: xs[ctx.replica_id_in_sync_group * per:(ctx.replica_id_in_sync_group + 1) * per])
    pr_y = strategy.experimental_distribute_values_from_function(
        lambda ctx: ys[ctx.replica_id_in_sync_group * per:(ctx.replica_id_in_sync_group + 1) * per])

    def run_hand(n):
        p, s = state.setdefault("hand", fresh())

        def call():
            nonlocal p, s
            p, s, loss = hand(p, s, dev_x, dev_y)
            return loss

        _bounded(call, n)
        state["hand"] = (p, s)

    def run_strategy(n):
        p, s = state.setdefault("run", fresh())
        for _ in range(n):
            p, s, loss = strategy.run(step, args=(p, s, pr_x, pr_y), options=donate)
        jax.block_until_ready(loss)
        state["run"] = (p, s)

    # Batches from the host.
    def run_hand_host(n):
        p, s = state.setdefault("hand_host", fresh())
        it = iter(range(n))

        def call():
            nonlocal p, s
            i = next(it) % steps
            x = xs[i * BATCH:(i + 1) * BATCH]
            y = ys[i * BATCH:(i + 1) * BATCH]
            if n_devices > 1:
                x, y = jax.device_put((stacked(x), stacked(y)), split)
            else:
                x, y = jax.device_put((x, y), replicated)
            p, s, loss = hand(p, s, x, y)
            return loss

        _bounded(call, n)
        state["hand_host"] = (p, s)

    dataset = jaxdist.Dataset.from_tensor_slices((xs, ys)).batch(BATCH).repeat()
    dist_iter = iter(strategy.experimental_distribute_dataset(dataset))

    def run_dataset(n):
        p, s = state.setdefault("dataset", fresh())
        for _ in range(n):
            x, y = next(dist_iter)
            p, s, loss = strategy.run(step, args=(p, s, x, y), options=donate)
        jax.block_until_ready(loss)
        state["dataset"] = (p, s)

    runners = {"jit": run_hand, "run": run_strategy, "jit_host": run_hand_host,
               "run_dataset": run_dataset}
    for r in runners.values():  # compile and warm up
        r(3)
    rounds: dict[str, list[float]] = {}
    med = time_interleaved(runners, steps, repeats, rounds)
    return [
        [n_devices, "batches on device", med["jit"] * 1e6, med["run"] * 1e6,
         paired_ratio(rounds, "run", ["jit"])],
        [n_devices, "batches from host", med["jit_host"] * 1e6, med["run_dataset"] * 1e6,
         paired_ratio(rounds, "run_dataset", ["jit_host"])],
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a smoke run (few steps)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 10, 2
    print_machine()
    rows = []
    for n in args.devices:
        if n > jax.device_count():
            print(f"(skipping {n} devices: {jax.device_count()} available)")
            continue
        rows.extend(measure(n, args.steps, args.repeats))
    print_table(
        f"strategy.run vs jax.jit, dispatch-bound step (MLP {'-'.join(map(str, _sizes()))}, "
        f"batch {BATCH}, {args.steps} steps x {args.repeats} rounds)",
        ["devices", "input", "jax.jit us/step", "jaxdist us/step",
         "jax.jit / jaxdist (same round)"],
        rows,
    )


if __name__ == "__main__":
    main()
