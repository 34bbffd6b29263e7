"""flax's MNIST example (NNX): a CNN with BatchNorm and Dropout, SGD with momentum.

Source: github google/flax, examples/mnist/train.py (the NNX version: ``CNN`` with
``batch_norm1/2`` and ``dropout1/2``, ``train_step(model, optimizer, metrics, batch, rngs)``
under ``nnx.jit``, ``train_and_evaluate`` switching ``model.train()`` / ``model.eval()`` each
epoch) and examples/mnist/configs/default.py (learning rate 0.1, momentum 0.9, batch 128).
Written anew after the original: same model, steps, loop and hyperparameters.

Edits beyond API renames:
- data: scikit-learn digits enlarged to 28x28 (``_data.digits_as_mnist``) instead of TFDS
  MNIST; 256 train / 128 test rows (MNIST: 60000 / 10000), batched with
  ``drop_remainder=True`` as there; ``jaxdist.Dataset.shuffle(1024, seed=0)`` instead of
  tf.data's unseeded ``shuffle(1024)``.
- 2 epochs instead of 10.
- model, optimizer, metrics and rngs are created under ``strategy.scope()``; batches come from
  ``strategy.experimental_distribute_dataset``; each ``train_step`` / ``eval_step`` call is
  ``strategy.run(step, args=...)``.
- no TensorBoard summaries and no orbax SavedModel export; the epoch metrics are returned.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import optax
from flax import nnx

import jaxdist

from ._data import digits_as_mnist

LEARNING_RATE = 0.1
MOMENTUM = 0.9
BATCH_SIZE = 128
NUM_EPOCHS = 2          # 10 in the original
TRAIN_ROWS, TEST_ROWS = 256, 128


class CNN(nnx.Module):
    """Two conv layers with BatchNorm (dropout after the first), two dense layers."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        return self.linear2(x)


def loss_fn(model: CNN, batch, rngs):
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]).mean()
    return loss, logits


@nnx.jit
def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch, rngs):
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch, rngs)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


@nnx.jit
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
    loss, logits = loss_fn(model, batch, None)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])


def get_datasets(batch_size: int):
    """Images scaled to [0, 1] with a channel axis, labels as int32; train shuffled."""

    def split(rows, offset):
        x, y = digits_as_mnist(rows, offset)
        return {"image": x[..., None].astype(np.float32) / 255, "label": y.astype(np.int32)}

    train = jaxdist.Dataset.from_tensor_slices(split(TRAIN_ROWS, 0))
    test = jaxdist.Dataset.from_tensor_slices(split(TEST_ROWS, TRAIN_ROWS))
    train = train.shuffle(1024, seed=0).batch(batch_size, drop_remainder=True)
    return train, test.batch(batch_size, drop_remainder=True)


def by_path(state) -> dict:
    """``{"conv1/kernel": array, ...}`` for an nnx state (results keyed by variable)."""
    return {"/".join(map(str, k)): v[...] for k, v in nnx.to_flat_state(state)}


def main(strategy: jaxdist.Strategy | None = None) -> dict:
    """Trains and evaluates; returns the final weights and every epoch's metrics."""
    strategy = strategy or jaxdist.get_strategy()
    train_ds, test_ds = get_datasets(BATCH_SIZE)
    with strategy.scope():
        model = CNN(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(LEARNING_RATE, MOMENTUM), wrt=nnx.Param)
        metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                                  loss=nnx.metrics.Average("loss"))
        rngs = nnx.Rngs(0)
    train_dist = strategy.experimental_distribute_dataset(train_ds)
    test_dist = strategy.experimental_distribute_dataset(test_ds)
    history = []
    for _ in range(NUM_EPOCHS):
        model.train()
        for batch in train_dist:
            strategy.run(train_step, args=(model, optimizer, metrics, batch, rngs))
        train_metrics = metrics.compute()
        metrics.reset()
        model.eval()
        for batch in test_dist:
            strategy.run(eval_step, args=(model, metrics, batch))
        eval_metrics = metrics.compute()
        metrics.reset()
        history.append({"train_loss": train_metrics["loss"],
                        "train_accuracy": train_metrics["accuracy"],
                        "test_loss": eval_metrics["loss"],
                        "test_accuracy": eval_metrics["accuracy"]})
    return {
        "weights": by_path(nnx.state(model, nnx.Param)),
        "batch_stats": by_path(nnx.state(model, nnx.BatchStat)),
        "steps": optimizer.step[...],
        "history": history,
    }
