"""Keras 3 ``model.fit`` under ``jaxdist.MirroredStrategy`` vs Keras's own ``DataParallel``.

The same MLP (32-256-256-10, Adam, global batch 256) trained with ``model.fit`` on the same
devices, in one process: once inside ``jaxdist.keras.scope(MirroredStrategy(devices))``, once
inside ``keras.distribution.DataParallel(devices=devices).scope()``. Both jit Keras's own train
step over a mesh of those devices; the ratio shows what jaxdist's placement (explicit-axes mesh,
strategy scope) costs or saves. Timings are medians of interleaved one-epoch fits after a
warm-up fit (compilation excluded).

Both fit loops keep at most two steps dispatched and unfinished: jaxdist's Keras integration
bounds its step functions itself (``_bounded`` in ``jaxdist/_src/keras/model_strategy.py``), and
the reference's
``train_function`` gets the same wrapper here, after a two-step warm-up fit has built it and the
optimizer. Keras's own loop dispatches unbounded, which with more forced CPU devices than cores
lets XLA's CPU collective rendezvous abort the process on long runs (``--steps 200``).

Run: ``python -m benchmarks.bench_keras [--devices 4 --steps 64 --repeats 3] [--quick]``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from benchmarks.common import force_cpu_devices, print_table, time_interleaved

GLOBAL_BATCH = 256
FEATURES, HIDDEN, CLASSES = 32, 256, 10


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=4, help="CPU devices to force (default 4)")
    p.add_argument("--steps", type=int, default=64, help="steps per timed fit (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (default 3)")
    p.add_argument("--quick", action="store_true", help="a smoke run (8 steps, 1 repeat)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 8, 1
    return args


def main(argv: Sequence[str] | None = None) -> str:
    """Runs the benchmark and returns the printed table."""
    args = _parse(argv)
    force_cpu_devices(args.devices)
    os.environ.setdefault("KERAS_BACKEND", "jax")

    import jax
    import keras
    import numpy as np

    import jaxdist
    import jaxdist.keras as jk
    from jaxdist._src.keras.model_strategy import _bounded

    devices = jax.devices()[: args.devices]
    rng = np.random.default_rng(0)
    n = GLOBAL_BATCH * args.steps
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(n,)).astype("int32")

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(HIDDEN, activation="relu"),
                keras.layers.Dense(HIDDEN, activation="relu"),
                keras.layers.Dense(CLASSES),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    strategy = jaxdist.MirroredStrategy(devices)
    keras_dp = keras.distribution.DataParallel(devices=devices)
    scopes = {
        "jaxdist MirroredStrategy": lambda: jk.scope(strategy),
        "keras DataParallel": keras_dp.scope,
    }
    models = {}
    warm = 2 * GLOBAL_BATCH  # two steps: builds the train function and the optimizer variables
    for name, scope in scopes.items():
        with scope():
            model = models[name] = build()
            model.fit(x[:warm], y[:warm], batch_size=GLOBAL_BATCH, epochs=1, shuffle=False,
                      verbose=0)
            # Keras's fit reuses this train_function from now on; jaxdist's is already bounded
            # (the wrapper is idempotent), the reference's gets the same bound here.
            model.train_function = _bounded(model.train_function)
            model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)

    def runner(name):
        def run(steps):
            with scopes[name]():
                models[name].fit(
                    x[: steps * GLOBAL_BATCH],
                    y[: steps * GLOBAL_BATCH],
                    batch_size=GLOBAL_BATCH,
                    epochs=1,
                    shuffle=False,
                    verbose=0,
                )

        return run

    times = time_interleaved({k: runner(k) for k in scopes}, args.steps, args.repeats)
    base = times["keras DataParallel"]
    rows = [
        [len(devices), name, t * 1e3, GLOBAL_BATCH / t, base / t] for name, t in times.items()
    ]
    return print_table(
        f"Keras fit, MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}, global batch {GLOBAL_BATCH}, "
        f"{jax.devices()[0].platform}",
        ["devices", "placement", "ms / step", "examples / s", "ratio vs keras DataParallel"],
        rows,
    )


if __name__ == "__main__":
    main()
