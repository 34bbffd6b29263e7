"""One task of the MultiWorkerMirroredStrategy flax NNX test (run by ``test_nnx_run.py``):
flax's nnx.jit train step through ``strategy.run`` over 2 processes; the chief saves the state."""

import os
import sys

import numpy as np


def main(out: str) -> int:
    import jax
    import optax
    from flax import nnx

    import jaxdist

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_nnx_run import _dataset, _objects, _snapshot, flax_train_step

    strategy = jaxdist.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model, optimizer, metrics = _objects(optax.adamw(1e-2, 0.9))
    model.train()
    for batch in strategy.experimental_distribute_dataset(_dataset(72)):
        strategy.run(flax_train_step, args=(model, optimizer, metrics, batch))
    snap = _snapshot(model, optimizer, metrics)
    if jax.process_index() == 0:
        flat = jax.tree.leaves(snap["state"])
        np.savez(out, step=snap["step"], accuracy=snap["metrics"]["accuracy"],
                 loss=snap["metrics"]["loss"], **{f"arr_{i}": a for i, a in enumerate(flat)})
    del nnx
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
