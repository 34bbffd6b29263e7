"""A worker of the parameter-server training tests (run as a subprocess with TF_CONFIG).

Trains a linear model y = x @ w + b asynchronously; prints one JSON line with its results.
Args: steps max_staleness(or -1) sleep_per_step_for_worker1 partition(0/1)
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxdist
from jaxdist.ps import optimizers as O


def main():
    steps, staleness, slow, partition = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), \
        int(sys.argv[4])
    strategy = jaxdist.ParameterServerStrategy(
        variable_partitioner=jaxdist.FixedShardsPartitioner(2) if partition else None,
        max_staleness=None if staleness < 0 else staleness, timeout=60.0)
    rng = np.random.default_rng(0)
    w_true = rng.normal(size=(8,)).astype(np.float32)
    x_all = rng.normal(size=(512, 8)).astype(np.float32)
    y_all = x_all @ w_true + 0.5

    def input_fn(ctx):
        x = x_all[ctx.input_pipeline_id::ctx.num_input_pipelines]
        y = y_all[ctx.input_pipeline_id::ctx.num_input_pipelines]
        return jaxdist.Dataset.from_tensor_slices((x, y)).batch(32).repeat(1000)

    with strategy.scope():
        params = strategy.create_variables(
            lambda: {"w": jnp.zeros((8,)), "b": jnp.zeros(())},
            O.momentum(0.05, 0.5), name="linear")
    it = strategy.make_input_fn_iterator(input_fn)

    def grad_fn(p, x, y):
        def loss(p):
            return jaxdist.compute_average_loss((x @ p["w"] + p["b"] - y) ** 2,
                                                global_batch_size=32)
        return jax.value_and_grad(loss)(p)

    me = strategy.extended.worker_index
    max_gap = 0
    t0 = time.monotonic()
    for _ in range(steps):
        x, y = it.get_next()
        _, grads = strategy.run(grad_fn, args=(params, x, y))
        params.apply_gradients(grads)
        max_gap = max(max_gap, getattr(strategy.extended, "last_clock_gap", 0))
        if me == 1 and slow:
            time.sleep(slow)
    elapsed = time.monotonic() - t0
    strategy.extended.worker_done()
    final = params.pull()
    loss = float(np.mean((x_all @ final["w"] + final["b"] - y_all) ** 2))
    status = strategy.extended.ps_status() if me == 0 else []
    print(json.dumps({"worker": me, "loss": loss, "elapsed": elapsed, "max_gap": max_gap,
                      "status": status}))


if __name__ == "__main__":
    main()
