"""TensorFlow's "Custom training loop with Keras and MultiWorkerMirroredStrategy" tutorial.

Source: github tensorflow/docs, site/en/tutorials/distribute/multi_worker_with_ctl.ipynb
(``mnist.py``: MNIST scaled to [0, 1] through ``tf.data`` with ``shuffle(60000)``,
``dataset_fn`` taking ``input_context.get_per_replica_batch_size(global_batch_size)``, then
``shard(num_input_pipelines, input_pipeline_id)`` and ``batch``; Input(28, 28) / Reshape /
Conv2D(32, 3) / Flatten / Dense(128) / Dense(10); ``main.py``: ``per_worker_batch_size = 64``
times the worker count from ``TF_CONFIG``, ``distribute_datasets_from_function``, RMSprop(0.001)
and ``SparseCategoricalAccuracy`` under the scope, a ``train_step`` running ``step_fn`` through
``strategy.run`` with ``compute_average_loss`` over the global batch and the losses summed by
``strategy.reduce``, epochs counted in ``epoch`` / ``step_in_epoch``, a checkpoint per epoch
written by every worker, the chief's kept and the others' temporary copies removed).
Written anew after the tutorial: the same input function, model, optimizer, step and loop.

Run as each worker of a cluster: ``python -m jaxdist.launch --workers 2 --devices-per-process 2
-- python -m programs.tf_multi_worker_with_ctl OUT WORKDIR`` (from ``tests/``).

Edits beyond API renames:
- data: scikit-learn digits enlarged to 28x28 (``_data.digits_as_mnist``), 384 rows (3 steps of
  128), instead of ``keras.datasets.mnist``; ``shuffle(384)`` for ``shuffle(60000)``, after
  ``keras.utils.set_random_seed(0)`` (it seeds TF too: every worker's shuffle, and the
  one-device reference run's, draws the same order before each worker takes its shard).
- 2 epochs of 3 steps instead of 3 of 70.
- the ``GradientTape`` block becomes ``jaxdist.keras.value_and_grad``; ``@tf.function``
  dropped.
- checkpoints: ``model.save_weights`` of a ``.weights.h5`` file per epoch into the tutorial's
  ``write_filepath`` directory (the chief's under ``WORKDIR/ckpt``, the others' in a
  ``workertemp_<id>`` directory removed after each save), with the epoch and step kept as
  Python integers, for ``tf.train.Checkpoint`` / ``CheckpointManager`` of the model and two
  ``tf.Variable`` counters; the latest is restored at start as there.
- results are returned (and written as JSON per worker) instead of printed.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import jaxdist  # noqa: E402
import jaxdist.keras  # noqa: E402

from ._data import digits_as_mnist  # noqa: E402

PER_WORKER_BATCH_SIZE = 64
NUM_EPOCHS = 2              # 3 in the tutorial
NUM_STEPS_PER_EPOCH = 3     # 70 in the tutorial
ROWS = 384


def mnist_dataset():
    import tensorflow as tf  # the tfdata test extra: the tutorial's pipeline is tf.data

    x_train, y_train = digits_as_mnist(ROWS)
    x_train = x_train / np.float32(255)
    y_train = y_train.astype(np.int64)
    return tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(ROWS)


def dataset_fn(global_batch_size, input_context):
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    dataset = mnist_dataset()
    dataset = dataset.shard(input_context.num_input_pipelines,
                            input_context.input_pipeline_id)
    return dataset.batch(batch_size)


def build_cnn_model():
    return keras.Sequential([
        keras.Input(shape=(28, 28)),
        keras.layers.Reshape(target_shape=(28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ])


def _is_chief(task_type, task_id, cluster_spec):
    return (task_type is None or task_type == "chief"
            or (task_type == "worker" and task_id == 0 and "chief" not in cluster_spec))


def _get_temp_dir(dirpath, task_id):
    temp_dir = os.path.join(dirpath, "workertemp_" + str(task_id))
    os.makedirs(temp_dir, exist_ok=True)
    return temp_dir


def write_filepath(filepath, task_type, task_id, cluster_spec):
    dirpath, base = os.path.dirname(filepath), os.path.basename(filepath)
    if not _is_chief(task_type, task_id, cluster_spec):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


def main(strategy: jaxdist.Strategy | None = None, num_workers: int | None = None,
         workdir: str | None = None) -> dict:
    """One worker's job; ``num_workers`` (default: ``TF_CONFIG``'s worker count) fixes the
    global batch, so the one-device reference run takes the cluster's global batches."""
    if num_workers is None:
        tf_config = json.loads(os.environ["TF_CONFIG"])
        num_workers = len(tf_config["cluster"]["worker"])
    global_batch_size = PER_WORKER_BATCH_SIZE * num_workers
    strategy = strategy or jaxdist.get_strategy()
    keras.utils.set_random_seed(0)

    with strategy.scope():
        multi_worker_model = build_cnn_model()
        multi_worker_dataset = strategy.distribute_datasets_from_function(
            lambda input_context: dataset_fn(global_batch_size, input_context))
        optimizer = keras.optimizers.RMSprop(learning_rate=0.001)
        train_accuracy = keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")

    def train_step(iterator):
        def step_fn(inputs):
            x, y = inputs

            def forward():  # was: with tf.GradientTape() as tape:
                predictions = multi_worker_model(x, training=True)
                per_batch_loss = keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True, reduction=None)(y, predictions)
                loss = jaxdist.compute_average_loss(per_batch_loss,
                                                    global_batch_size=global_batch_size)
                return loss, predictions

            (loss, predictions), grads = jaxdist.keras.value_and_grad(
                forward, multi_worker_model.trainable_variables, has_aux=True)
            optimizer.apply_gradients(zip(grads, multi_worker_model.trainable_variables))
            train_accuracy.update_state(y, predictions)
            return loss

        per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
        return strategy.reduce(jaxdist.ReduceOp.SUM, per_replica_losses, axis=None)

    resolver = getattr(strategy, "cluster_resolver", None)
    task_type, task_id = (getattr(resolver, "task_type", None),
                          getattr(resolver, "task_id", None))
    cluster_spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint_dir = os.path.join(workdir or tmp, "ckpt")
        os.makedirs(checkpoint_dir, exist_ok=True)
        write_checkpoint_dir = os.path.dirname(write_filepath(
            os.path.join(checkpoint_dir, "x"), task_type, task_id, cluster_spec))
        epoch, step_in_epoch = 0, 0
        saved = sorted(glob.glob(os.path.join(checkpoint_dir, "ckpt-*.weights.h5")))
        if saved:  # restoring the latest checkpoint
            multi_worker_model.load_weights(saved[-1])
            epoch = int(saved[-1].rsplit("-", 1)[1].split(".")[0])
        history = []
        while epoch < NUM_EPOCHS:
            iterator = iter(multi_worker_dataset)
            total_loss = 0.0
            num_batches = 0
            while step_in_epoch < NUM_STEPS_PER_EPOCH:
                total_loss += train_step(iterator)
                num_batches += 1
                step_in_epoch += 1
            history.append({"accuracy": train_accuracy.result(),
                            "loss": total_loss / num_batches})
            train_accuracy.reset_state()
            epoch += 1
            os.makedirs(write_checkpoint_dir, exist_ok=True)  # as CheckpointManager.save does
            multi_worker_model.save_weights(
                os.path.join(write_checkpoint_dir, f"ckpt-{epoch}.weights.h5"))
            if not _is_chief(task_type, task_id, cluster_spec):
                shutil.rmtree(write_checkpoint_dir)
            step_in_epoch = 0
    return {"history": history, "weights": multi_worker_model.get_weights()}


if __name__ == "__main__":
    out, workdir = sys.argv[1], sys.argv[2]
    strategy = jaxdist.MultiWorkerMirroredStrategy()
    result = {**main(strategy, workdir=workdir), "replicas": strategy.num_replicas_in_sync}
    with open(f"{out}.{jax.process_index()}.json", "w") as f:
        json.dump(jax.tree.map(lambda a: np.asarray(a).tolist(), result), f)
