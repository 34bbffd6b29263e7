"""Training loop through ``strategy.run`` vs the same loop hand-written in JAX, input included.

MLP 784-1024-1024-10, global batch 256, SGD, at 1, 2, 4 and 8 devices (``OneDeviceStrategy``
at 1, ``MirroredStrategy`` above; forced CPU devices without an accelerator). Each loop reads
its batches from host memory every step, from the same 8 host batches in the same order:

* ``jaxdist``: ``strategy.experimental_distribute_dataset`` over a ``jaxdist.Dataset``
  (``from_tensor_slices(...).batch(256).repeat()``), its prefetch to the devices one batch
  ahead of use (in the loop's thread, the default),
  ``strategy.run(step, ..., options=RunOptions(donate_argnums=(0, 1)))``; the loop never waits
  (the strategy bounds the steps in flight).
* ``hand-written jit``: ``jax.jit(step, donate_argnums=(0, 1))`` over a mesh with
  ``NamedSharding`` (batch split on rows), batches ``jax.device_put`` two steps ahead (flax's
  ``prefetch_to_device(..., 2)``), the loop waits on step k-2 before dispatching step k.
* ``hand-written shard_map`` (2+ devices): the same with ``jit(shard_map(...))`` and ``psum``.

The ratio is jaxdist's examples/s over the best hand-written loop's, per device count, each the
median of ``--repeats`` interleaved, rotated rounds of ``--steps`` steps; the same-round ratio is
the median over rounds of the ratio within each round (robust to load drifts between rounds).
The second table is the scaling of the jaxdist loop with the device count.

Run: ``python -m benchmarks.bench_strategy_step [--steps 60 --repeats 7 --devices 1 2 4 8]``.
"""

from __future__ import annotations

import argparse
import collections
import functools

from benchmarks.common import (  # noqa: I001
    force_cpu_devices,
    paired_ratio,
    print_machine,
    print_table,
    time_interleaved,
)

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


HOST_BATCHES = 8


def make_data():
    """``HOST_BATCHES`` global batches of host data, as one array per input."""
    rng = np.random.RandomState(1)
    n = HOST_BATCHES * GLOBAL_BATCH
    x = rng.randn(n, SIZES[0]).astype(np.float32)
    y = rng.randint(0, SIZES[-1], n).astype(np.int32)
    return x, y


def _make_strategy(devices):
    if len(devices) == 1:
        return jaxdist.OneDeviceStrategy(devices[0])
    return jaxdist.MirroredStrategy(devices)


def jaxdist_runner(devices):
    strategy = _make_strategy(devices)
    tx = optax.sgd(LR)
    with strategy.scope():
        params = jax.tree.map(jnp.asarray, init_params())
        opt_state = tx.init(params)
    x, y = make_data()
    dataset = jaxdist.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).repeat()
    batches = iter(strategy.experimental_distribute_dataset(dataset))
    donate = jaxdist.RunOptions(donate_argnums=(0, 1))

    def step(params, opt_state, x, y):
        def loss_fn(p):
            return jaxdist.compute_average_loss(
                per_example_loss(p, x, y), global_batch_size=GLOBAL_BATCH
            )

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    state = {"p": params, "o": opt_state}

    def run(steps: int) -> None:
        p, o = state["p"], state["o"]
        loss = None
        for _ in range(steps):
            xb, yb = next(batches)
            p, o, loss = strategy.run(step, args=(p, o, xb, yb), options=donate)
        jax.block_until_ready((p, loss))
        state["p"], state["o"] = p, o

    run(3)  # compile and warm up
    run.params = lambda: state["p"]
    return run


def _prefetch_to_device(sharding, size: int = 2):
    """The hand-written input: the same host batches, ``device_put`` ``size`` steps ahead."""
    x, y = make_data()
    queue: collections.deque = collections.deque()

    def host_batches():
        while True:
            for i in range(HOST_BATCHES):
                s = slice(i * GLOBAL_BATCH, (i + 1) * GLOBAL_BATCH)
                yield x[s], y[s]

    source = host_batches()

    def next_batch():
        while len(queue) < size:
            queue.append(jax.device_put(next(source), sharding))
        return queue.popleft()

    return next_batch


def _bounded_loop(step, devices):
    """A runner calling ``step`` on prefetched batches, waiting on step k-2 before step k."""
    mesh = jax.make_mesh((len(devices),), ("data",), devices=list(devices),
                         axis_types=(jax.sharding.AxisType.Auto,))
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = jax.device_put(init_params(), rep)
    state = {"p": params, "o": jax.device_put(optax.sgd(LR).init(params), rep)}
    next_batch = _prefetch_to_device(data)
    step = step(mesh)

    def run(steps: int) -> None:
        p, o = state["p"], state["o"]
        pending: collections.deque = collections.deque()
        for _ in range(steps):
            if len(pending) >= 2:
                jax.block_until_ready(pending.popleft())
            x, y = next_batch()
            p, o, loss = step(p, o, x, y)
            pending.append(loss)
        jax.block_until_ready((p, list(pending)))
        state["p"], state["o"] = p, o

    run(3)  # compile and warm up
    run.params = lambda: state["p"]
    return run


def handwritten_runner(devices):
    tx = optax.sgd(LR)

    def make(mesh):
        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(lambda p: per_example_loss(p, x, y).mean())(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return step

    return _bounded_loop(make, devices)


def handwritten_shard_map_runner(devices):
    """The same step written by hand with jit + shard_map + psum."""
    tx = optax.sgd(LR)

    def make(mesh):
        def body(params, opt_state, x, y):
            def loss_fn(p):
                return jnp.sum(per_example_loss(p, x, y)) / GLOBAL_BATCH

            loss, grads = jax.value_and_grad(loss_fn)(params)  # shard_map's AD psums the grads
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, jax.lax.psum(loss, "data")

        return jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                          out_specs=(P(), P(), P())),
            donate_argnums=(0, 1),
        )

    return _bounded_loop(make, devices)


def max_param_difference(a, b) -> float:
    """Largest absolute difference between two runners' parameters."""
    pa, pb = jax.device_get(a.params()), jax.device_get(b.params())
    return max(float(np.max(np.abs(pa[k] - pb[k]))) for k in pa)


def main(argv: list[str] | None = None) -> list[list[object]]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)  # 20 swung 0.76-0.99 at 4 devices
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--devices", type=int, nargs="*", default=[1, 2, 4, 8])
    args = parser.parse_args(argv)
    print_machine()
    all_devices = jax.devices()
    rows, scaling = [], []
    for k in args.devices:
        if k > len(all_devices):
            print(f"skipping {k} devices: only {len(all_devices)} available")
            continue
        devs = all_devices[:k]
        runners = {"hand-written jit": handwritten_runner(devs)}
        if k > 1:
            runners["hand-written shard_map"] = handwritten_shard_map_runner(devs)
        runners["jaxdist"] = jaxdist_runner(devs)
        # Same start, same batches, 3 warm-up steps: the loops must agree before we time them.
        for name in runners:
            diff = max_param_difference(runners["hand-written jit"], runners[name])
            if diff > 1e-4:
                raise AssertionError(f"{name} diverges from hand-written JAX by {diff:g}")
        rounds: dict[str, list[float]] = {}
        t = time_interleaved(runners, args.steps, args.repeats, rounds)
        best = min((v, n) for n, v in t.items() if n != "jaxdist")
        hand = [n for n in runners if n != "jaxdist"]
        for name in runners:
            eps = GLOBAL_BATCH / t[name]
            rows.append([k, name, t[name] * 1e3, eps,
                         "" if name != "jaxdist" else f"{best[0] / t[name]:.3f}",
                         "" if name != "jaxdist" else f"{paired_ratio(rounds, name, hand):.3f}"])
        scaling.append([k, GLOBAL_BATCH / t["jaxdist"], GLOBAL_BATCH / best[0]])
    strategy_name = "OneDevice at 1 device, Mirrored above"
    print_table(
        f"Training loop with input pipeline, MLP {'-'.join(map(str, SIZES))}, global batch "
        f"{GLOBAL_BATCH}, SGD, donated state ({all_devices[0].platform}; {strategy_name}; "
        f"median of {args.repeats} rotated rounds of {args.steps} steps)",
        ["devices", "implementation", "ms/step", "examples/s", "jaxdist / best hand-written",
         "same-round ratio (median)"],
        rows,
    )
    print()
    if scaling:
        one = scaling[0][1]
        print_table(
            f"Sync scaling: jaxdist examples/s by device count (global batch {GLOBAL_BATCH}, "
            f"{all_devices[0].platform})",
            ["devices", "jaxdist examples/s", "best hand-written examples/s",
             f"jaxdist vs {scaling[0][0]} device(s)"],
            [[k, a, b, f"{a / one:.2f}x"] for k, a, b in scaling],
        )
    return rows


if __name__ == "__main__":
    main()
