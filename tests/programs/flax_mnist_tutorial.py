"""flax's "MNIST tutorial" (NNX docs): CNN with BatchNorm and Dropout, AdamW, ``nnx.view``.

Source: github google/flax, docs_nnx/mnist_tutorial.md (the version that loads MNIST with
Hugging Face ``datasets`` and ``make_batches``, builds ``train_model`` / ``eval_model`` with
``nnx.view(model, deterministic=..., use_running_average=...)``, trains for ``train_steps``
steps of batch 32 with ``optax.adamw(0.005, 0.9)``, evaluates every ``eval_every`` steps and
predicts labels of a test batch with ``pred_step``). Written anew after the tutorial: same
model, steps, loop and hyperparameters.

Edits beyond API renames:
- data: scikit-learn digits enlarged to 28x28 (``_data.digits_as_mnist``) instead of
  ``load_dataset('mnist')``; 320 train / 96 test rows (MNIST: 60000 / 10000), shuffled once
  with a fixed numpy seed as ``dataset['train'].shuffle(seed=0)`` does, and batched by the
  tutorial's ``make_batches`` logic (incomplete last batch dropped).
- ``train_steps`` 6 and ``eval_every`` 3 instead of 1200 and 200.
- model, optimizer, metrics and rngs are created under ``strategy.scope()``; each batch list
  goes through ``strategy.experimental_distribute_dataset``; each ``train_step`` /
  ``eval_step`` / ``pred_step`` call is ``strategy.run(step, args=...)``.
- no TensorBoard writer, matplotlib figures or orbax export; metrics and the last
  predictions are returned.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import optax
from flax import nnx

import jaxdist

from ._data import digits_as_mnist

TRAIN_STEPS = 6         # 1200 in the tutorial
EVAL_EVERY = 3          # 200 in the tutorial
BATCH_SIZE = 32
LEARNING_RATE = 0.005
MOMENTUM = 0.9
TRAIN_ROWS, TEST_ROWS = 320, 96


class CNN(nnx.Module):
    """A simple CNN: conv-BN (dropout) -pool twice, then two dense layers."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        return self.linear2(x)


def loss_fn(model: CNN, batch, rngs: nnx.Rngs | None = None):
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]).mean()
    return loss, logits


@nnx.jit
def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric,
               rngs: nnx.Rngs, batch):
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch, rngs)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


@nnx.jit
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
    loss, logits = loss_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])


@nnx.jit
def pred_step(model: CNN, batch):
    logits = model(batch["image"], None)
    return logits.argmax(axis=1)


def make_batches(images, labels, batch_size):
    """The tutorial's generator: normalised batches with a channel axis, last partial one
    dropped."""
    for i in range(0, len(labels), batch_size):
        if len(labels[i:i + batch_size]) < batch_size:
            break
        yield {"image": images[i:i + batch_size, ..., None].astype(np.float32) / 255.0,
               "label": labels[i:i + batch_size]}


def by_path(state) -> dict:
    """``{"conv1/kernel": array, ...}`` for an nnx state (results keyed by variable)."""
    return {"/".join(map(str, k)): v[...] for k, v in nnx.to_flat_state(state)}


def main(strategy: jaxdist.Strategy | None = None) -> dict:
    strategy = strategy or jaxdist.get_strategy()
    train_x, train_y = digits_as_mnist(TRAIN_ROWS)
    perm = np.random.default_rng(0).permutation(TRAIN_ROWS)   # dataset['train'].shuffle(seed=0)
    train_x, train_y = train_x[perm], train_y[perm]
    test_x, test_y = digits_as_mnist(TEST_ROWS, offset=TRAIN_ROWS)

    with strategy.scope():
        model = CNN(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(LEARNING_RATE, MOMENTUM), wrt=nnx.Param)
        metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                                  loss=nnx.metrics.Average("loss"))
        rngs = nnx.Rngs(0)
    train_model = nnx.view(model, deterministic=False, use_running_average=False)
    eval_model = nnx.view(model, deterministic=True, use_running_average=True)

    history = {"train_loss": [], "train_accuracy": [], "test_loss": [], "test_accuracy": []}
    pred = None
    train_batches = strategy.experimental_distribute_dataset(
        make_batches(train_x, train_y, BATCH_SIZE))
    for step, batch in enumerate(train_batches):
        if step >= TRAIN_STEPS:
            break
        strategy.run(train_step, args=(train_model, optimizer, metrics, rngs, batch))
        if step > 0 and (step % EVAL_EVERY == 0 or step == TRAIN_STEPS - 1):
            for metric, value in metrics.compute().items():
                history[f"train_{metric}"].append(value)
            metrics.reset()
            test_batches = strategy.experimental_distribute_dataset(
                make_batches(test_x, test_y, BATCH_SIZE))
            for test_batch in test_batches:
                strategy.run(eval_step, args=(eval_model, metrics, test_batch))
            pred = strategy.run(pred_step, args=(eval_model, test_batch))
            for metric, value in metrics.compute().items():
                history[f"test_{metric}"].append(value)
            metrics.reset()
    return {
        "weights": by_path(nnx.state(model, nnx.Param)),
        "batch_stats": by_path(nnx.state(model, nnx.BatchStat)),
        "steps": optimizer.step[...],
        "history": history,
        "last_predictions": pred,
    }
