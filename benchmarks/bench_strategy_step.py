"""Training step through ``strategy.run`` vs the same step hand-written with jit + NamedSharding.

MLP 784-1024-1024-10, global batch 256, SGD, at 1, 2 and 8 devices. Both loops keep at most two
steps in flight (the hand-written one waits on step k-2 explicitly, as the strategy does).

Run: ``python -m benchmarks.bench_strategy_step [--steps 20 --repeats 5]``.
"""

from __future__ import annotations

import argparse

from benchmarks.common import force_cpu_devices, print_table, time_interleaved

force_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxdist  # noqa: E402

SIZES = (784, 1024, 1024, 10)
GLOBAL_BATCH = 256
LR = 0.01


def init_params(seed: int = 0) -> dict:
    rng = np.random.RandomState(seed)
    params = {}
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        params[f"w{i}"] = (rng.randn(a, b) / np.sqrt(a)).astype(np.float32)
        params[f"b{i}"] = np.zeros(b, np.float32)
    return params


def forward(params, x):
    h = x
    n = len(SIZES) - 1
    for i in range(n):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < n - 1:
            h = jax.nn.relu(h)
    return h


def per_example_loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(forward(params, x), y)


def make_data():
    rng = np.random.RandomState(1)
    x = rng.randn(GLOBAL_BATCH, SIZES[0]).astype(np.float32)
    y = rng.randint(0, SIZES[-1], GLOBAL_BATCH).astype(np.int32)
    return x, y


def jaxdist_runner(devices, tf_style: bool = False):
    strategy = jaxdist.MirroredStrategy(devices)
    tx = optax.sgd(LR)
    with strategy.scope():
        params = jax.tree.map(jnp.asarray, init_params())
        opt_state = tx.init(params)
    xd, yd = next(iter(strategy.experimental_distribute_dataset([make_data()])))

    def step(params, opt_state, x, y):
        ctx = jaxdist.get_replica_context()

        def loss_fn(p):
            return jaxdist.compute_average_loss(
                per_example_loss(p, x, y), global_batch_size=GLOBAL_BATCH
            )

        if tf_style:
            loss, grads = jax.value_and_grad(loss_fn)(ctx.local(params))
            grads = ctx.all_reduce("SUM", grads)
            loss = ctx.all_reduce("SUM", loss)
        else:
            loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    state = {"p": params, "o": opt_state}

    def run(steps: int) -> None:
        p, o = state["p"], state["o"]
        out = None
        for _ in range(steps):
            p, o, out = strategy.run(step, args=(p, o, xd, yd))
        jax.block_until_ready((p, out))
        state["p"], state["o"] = p, o

    run(3)  # compile and warm up
    run.params = lambda: state["p"]
    return run


def _handwritten_setup(devices):
    """Mesh ``("data",)``, SGD, replicated params and optimizer state, batch split on rows."""
    mesh = jax.make_mesh((len(devices),), ("data",), devices=list(devices))
    rep = NamedSharding(mesh, P())
    data = NamedSharding(mesh, P("data"))
    tx = optax.sgd(LR)
    params = jax.device_put(init_params(), rep)
    opt_state = jax.device_put(tx.init(params), rep)
    x, y = make_data()
    return mesh, tx, params, opt_state, jax.device_put(x, data), jax.device_put(y, data)


def _bounded_loop(step, params, opt_state, x, y):
    """A runner calling ``step`` with at most two steps in flight (as the strategy does)."""
    state = {"p": params, "o": opt_state}

    def run(steps: int) -> None:
        p, o = state["p"], state["o"]
        pending: list = []
        for _ in range(steps):
            if len(pending) >= 2:
                jax.block_until_ready(pending.pop(0))
            p, o, loss = step(p, o, x, y)
            pending.append(loss)
        jax.block_until_ready((p, pending))
        state["p"], state["o"] = p, o

    run(3)  # compile and warm up
    run.params = lambda: state["p"]
    return run


def handwritten_runner(devices):
    mesh, tx, params, opt_state, x, y = _handwritten_setup(devices)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: per_example_loss(p, x, y).mean())(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return _bounded_loop(step, params, opt_state, x, y)


def handwritten_shard_map_runner(devices):
    """The same step written by hand with jit + shard_map + psum (the strongest baseline)."""
    mesh, tx, params, opt_state, x, y = _handwritten_setup(devices)

    def body(params, opt_state, x, y):
        def loss_fn(p):
            return jnp.sum(per_example_loss(p, x, y)) / GLOBAL_BATCH

        loss, grads = jax.value_and_grad(loss_fn)(params)  # shard_map's AD psums the grads
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.psum(loss, "data")

    step = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P(), P())
        )
    )
    return _bounded_loop(step, params, opt_state, x, y)


def max_param_difference(a, b) -> float:
    """Largest absolute difference between two runners' parameters."""
    pa, pb = jax.device_get(a.params()), jax.device_get(b.params())
    return max(float(np.max(np.abs(pa[k] - pb[k]))) for k in pa)


def main(argv: list[str] | None = None) -> list[list[object]]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--devices", type=int, nargs="*", default=[1, 2, 8])
    args = parser.parse_args(argv)
    all_devices = jax.devices()
    rows = []
    for k in args.devices:
        if k > len(all_devices):
            print(f"skipping {k} devices: only {len(all_devices)} available")
            continue
        devs = all_devices[:k]
        runners = {
            "hand-written": handwritten_runner(devs),
            "hand-written shard_map": handwritten_shard_map_runner(devs),
            "jaxdist": jaxdist_runner(devs),
            "jaxdist (tf-style all_reduce)": jaxdist_runner(devs, tf_style=True),
        }
        # Same start, same 3 warm-up steps: the implementations must agree before we time them.
        for name in ("hand-written shard_map", "jaxdist", "jaxdist (tf-style all_reduce)"):
            diff = max_param_difference(runners["hand-written"], runners[name])
            if diff > 1e-4:
                raise AssertionError(f"{name} diverges from hand-written JAX by {diff:g}")
        t = time_interleaved(runners, args.steps, args.repeats)
        base = GLOBAL_BATCH / t["hand-written"]
        best = GLOBAL_BATCH / min(t["hand-written"], t["hand-written shard_map"])
        for name in runners:
            eps = GLOBAL_BATCH / t[name]
            rows.append([k, name, t[name] * 1e3, eps, eps / base, eps / best])
    print_table(
        f"Training step, MLP {'-'.join(map(str, SIZES))}, global batch {GLOBAL_BATCH}, SGD "
        f"({all_devices[0].platform}, {jax.device_count()} devices visible)",
        [
            "devices",
            "implementation",
            "ms/step",
            "examples/s",
            "ratio vs jit+NamedSharding",
            "ratio vs best hand-written",
        ],
        rows,
    )
    return rows


if __name__ == "__main__":
    main()
