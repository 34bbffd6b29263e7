"""One task of the 2-process ``PreemptionCheckpointHandler`` test (run by
``test_preemption_handler_processes.py``): TF's custom loop on MultiWorkerMirroredStrategy with a
flax NNX model, ``handler.run`` per step; the chief writes the final state to ``out``.

``python tests/handler_mw_worker.py CKPT_DIR OUT STEPS SLEEP [returning-exit]``
(``returning-exit``: an ``exit_fn`` that returns instead of exiting)
"""

import sys


def main(ckpt_dir: str, out: str, steps: int, sleep: float, returning_exit: bool = False
         ) -> int:
    import time

    import jax
    import numpy as np
    import optax
    from flax import nnx

    import jaxdist

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.l1 = nnx.Linear(4, 8, rngs=rngs)
            self.do = nnx.Dropout(0.5, rngs=rngs)
            self.l2 = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.do(nnx.relu(self.l1(x))))

    @nnx.jit
    def train_step(model, optimizer, batch):
        def loss_fn(model):
            logits = model(batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    strategy = jaxdist.MultiWorkerMirroredStrategy(
        communication_options=jaxdist.CommunicationOptions(timeout_seconds=30))
    with strategy.scope():
        model = Net(nnx.Rngs(0, dropout=1))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        checkpoint = jaxdist.Checkpoint(model=model, optimizer=optimizer)
        handler = jaxdist.PreemptionCheckpointHandler(
            strategy.cluster_resolver, checkpoint, ckpt_dir,
            jaxdist.TerminationConfig(
                grace_period=20,
                exit_fn=(lambda: print("exit_fn returned", flush=True)) if returning_exit
                else None))
    model.train()
    rng = np.random.RandomState(0)
    x = rng.randn(steps * 8, 4).astype(np.float32)
    data = jaxdist.Dataset.from_tensor_slices({"x": x, "y": (x[:, 0] > 0).astype(np.int32)})
    batches = list(strategy.experimental_distribute_dataset(data.batch(8)))

    def distributed_train_step(batch):
        return strategy.run(train_step, args=(model, optimizer, batch))

    print(f"start at {handler.total_run_calls}", flush=True)
    for step in range(handler.total_run_calls, steps):
        handler.run(distributed_train_step, batches[step])
        print(f"step {step}", flush=True)
        time.sleep(sleep)
    leaves = jax.tree.leaves(nnx.to_pure_dict(nnx.state((model, optimizer))))
    leaves = [np.asarray(jax.random.key_data(v) if jax.dtypes.issubdtype(
        v.dtype, jax.dtypes.prng_key) else v) for v in leaves]
    if jax.process_index() == 0:
        np.savez(out, *leaves)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]),
                  sys.argv[5:] == ["returning-exit"]))
