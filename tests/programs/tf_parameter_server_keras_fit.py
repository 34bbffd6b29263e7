"""TensorFlow's "Parameter server training" tutorial, its ``Model.fit`` part.

Source: github tensorflow/docs, site/en/tutorials/distribute/parameter_server_training.ipynb
("Training with Model.fit": ``ParameterServerStrategy`` with ``MinSizePartitioner(256 << 10,
max_shards=2)`` over 2 ps tasks; 10 random rows of 10 features with random targets,
``shuffle(10).repeat().batch(64)``; ``Sequential([Dense(10)])`` compiled under the scope with
SGD, ``"mse"`` and ``steps_per_execution=10``; callbacks TensorBoard, ModelCheckpoint and
BackupAndRestore; ``fit(dataset, epochs=5, steps_per_epoch=20)``). Written anew after the
tutorial: same data, model, compile, callbacks and fit.

Edits beyond API renames:
- ``jaxdist.keras.attach(model, strategy)`` after ``compile`` (Keras 3 has no parameter-server
  training of its own); the model gets ``keras.Input((10,))`` so it is built before that.
- the targets have shape ``(10, 1)`` instead of ``(10,)``: Keras 3's ``"mse"`` does not
  broadcast ``(64,)`` targets against the ``(64, 10)`` output as TF's Keras 2 did.
- data: ``np.random.default_rng(0)`` for ``tf.random.uniform``; the ``shuffle(10).repeat()
  .batch(64)`` stream is materialised (one seeded permutation of the 10 rows per pass) for the
  steps ``fit`` takes, and passed as arrays with ``batch_size=64, shuffle=False`` (arrays are
  what ``fit`` takes from a ``ClusterCoordinator``); each epoch reads the same rows.
- 2 epochs of 4 steps with ``steps_per_execution=2`` instead of 5 of 20 with 10.
- ``jaxdist.keras.TensorBoard`` (chief-only writer) for Keras's; ``ModelCheckpoint`` writes
  ``ckpt.weights.h5`` (weights only) in a temporary directory; ``BackupAndRestore`` is left
  out: under ``ParameterServerStrategy`` jaxdist refuses it (``ValueError`` naming
  ``strategy.extended.save`` / ``restore``), where TF backs up and restores the ps variables.
- 1 worker (the tutorial starts 3): with more, the order in which asynchronous steps reach
  the ps, hence the result, varies from run to run.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import jaxdist  # noqa: E402
import jaxdist.keras  # noqa: E402

NUM_PS = 2
GLOBAL_BATCH_SIZE = 64
EPOCHS, STEPS_PER_EPOCH, STEPS_PER_EXECUTION = 2, 4, 2     # 5, 20, 10 in the tutorial


def make_strategy(cluster_resolver=None, compute_devices=None):
    variable_partitioner = jaxdist.MinSizePartitioner(min_shard_bytes=(256 << 10),
                                                      max_shards=NUM_PS)
    return jaxdist.ParameterServerStrategy(cluster_resolver,
                                           variable_partitioner=variable_partitioner,
                                           compute_devices=compute_devices)


def dataset():
    """``from_tensor_slices((x, y)).shuffle(10).repeat().batch(64)``, for the steps taken."""
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(10, 10)).astype(np.float32)
    y = rng.uniform(size=(10, 1)).astype(np.float32)
    rows = STEPS_PER_EPOCH * GLOBAL_BATCH_SIZE
    order = np.concatenate([rng.permutation(10) for _ in range(-(-rows // 10))])[:rows]
    return x[order], y[order]


def main(strategy=None, coordinator=None) -> dict:
    """Fits from ``coordinator`` (default: in this process, one device, in-process ps)."""
    del coordinator  # attach() finds the ClusterCoordinator created for the strategy
    strategy = strategy or make_strategy(compute_devices=jax.local_devices()[:1])
    x, y = dataset()
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.models.Sequential([keras.Input((10,)), keras.layers.Dense(10)])
        model.compile(keras.optimizers.SGD(), loss="mse",
                      steps_per_execution=STEPS_PER_EXECUTION)
    jaxdist.keras.attach(model, strategy)
    with tempfile.TemporaryDirectory() as working_dir:
        callbacks = [
            jaxdist.keras.TensorBoard(log_dir=os.path.join(working_dir, "log")),
            keras.callbacks.ModelCheckpoint(
                filepath=os.path.join(working_dir, "ckpt.weights.h5"), save_weights_only=True),
        ]
        history = model.fit(x, y, batch_size=GLOBAL_BATCH_SIZE, shuffle=False, epochs=EPOCHS,
                            steps_per_epoch=STEPS_PER_EPOCH, callbacks=callbacks, verbose=0)
    return {"history": history.history,
            "weights": [np.asarray(w) for w in model.get_weights()]}
