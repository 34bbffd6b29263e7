"""One task of the MultiWorkerMirroredStrategy Dropout/BatchNorm test (run by
``test_train_model_state.py``): trains ``Net`` a few steps and the chief saves the state."""

import os
import sys

import numpy as np


def main(out: str) -> int:
    import jax
    import optax
    from flax import nnx

    import jaxdist
    from jaxdist.train import Trainer

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here)]  # the test module, and tests/ (devutil)
    from test_train_model_state import GBS, Net, make_data

    strategy = jaxdist.MultiWorkerMirroredStrategy()
    x, y = make_data()
    with strategy.scope():
        t = Trainer(Net(dropout=0.5, bn=True, rngs=nnx.Rngs(0)), optax.sgd(0.1),
                    global_batch_size=GBS, strategy=strategy, progress_bar="never",
                    shuffle=False)
    t.fit((x, y), steps=3)
    loss = t.evaluate((x, y))["loss"]
    state = jax.tree.leaves(jax.device_get((t.params, t.rest)))
    if jax.process_index() == 0:
        np.savez(out, loss=loss, **{f"arr_{i}": np.asarray(a) for i, a in enumerate(state)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
