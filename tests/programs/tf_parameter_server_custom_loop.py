"""TensorFlow's "Parameter server training" tutorial, its custom-training-loop part.

Source: github tensorflow/docs, site/en/tutorials/distribute/parameter_server_training.ipynb
("Training with a custom training loop" and "Inline evaluation": toy examples of 3 words
out of 7 with label "yes" when "avenger" is among them, string lookups, ``dataset_fn`` with
``shuffle(200).batch(32).repeat()`` made per worker by ``create_per_worker_dataset``; an
Embedding(8, 16384) -> mean -> Dense(1, sigmoid, L2(1e-4)) model whose variables are
partitioned over 2 ps tasks by ``MinSizePartitioner(256 << 10, max_shards=2)``; RMSprop(0.1);
``step_fn`` = ``next(iterator)`` + ``strategy.run(replica_fn)`` with per-example binary
cross-entropy through ``tf.nn.compute_average_loss`` plus ``scale_regularization_loss``, and
an Accuracy metric on ``pred > 0.5``; ``coordinator.schedule`` / ``join`` per epoch; a final
``schedule(...).fetch()``; distributed evaluation with ``eval_step`` scheduled twice). Written
anew after the tutorial: same data, model, loss, schedule/join loop and evaluation.

Edits beyond API renames:
- the Keras model and optimizer become a parameter pytree with the same layers' math and
  initialisers (Embedding ``uniform(-0.05, 0.05)``, Dense glorot-uniform kernel and zero
  bias) created by ``strategy.create_variables(..., jaxdist.ps.optimizers.rmsprop(0.1))``,
  and ``replica_fn`` returns the gradients, pushed with ``params.apply_gradients``: a Keras
  model's variables on ps tasks in a custom loop need the pending ``jaxdist.keras`` helper.
  RMSprop is optax's (epsilon inside the square root) rather than Keras's.
- the string lookups (``StringLookup`` needs TensorFlow in Keras 3) are a Python dict with
  the same indices (0 = out of vocabulary; labels yes=0, no=1); ``random.sample`` draws from a
  seeded ``random.Random``; ``jaxdist.Dataset`` for ``tf.data`` (seeded shuffles).
- the per-worker dataset is ``strategy.experimental_distribute_dataset(dataset_fn(ctx))``
  (the tutorial recommends wrapping with ``distribute_datasets_from_function``, which on a
  worker with 4 replicas would feed each replica 32 rows): the global batch stays 32.
- the accuracy metric: each step returns its correct and total counts, summed over the
  replicas with ``strategy.reduce`` and over the epoch's steps on the coordinator (TF keeps a
  Keras metric's variables on the ps).
- 1 worker (the tutorial starts 3): with more, the order in which asynchronous steps reach the
  ps, hence the result, varies from run to run; 2 epochs of 3 steps instead of 4 of 5.
- results are returned, not printed.
"""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np

import jaxdist
from jaxdist.ps import optimizers

FEATURE_VOCAB = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong",
                 "wonder_woman"]
LABEL_VOCAB = ["yes", "no"]
NUM_PS = 2
EMBEDDING_DIM = 16384
NUM_EPOCHS, STEPS_PER_EPOCH = 2, 3     # 4 and 5 in the tutorial
EVAL_STEPS_PER_EPOCH = 2


def make_strategy(cluster_resolver=None, compute_devices=None):
    variable_partitioner = jaxdist.MinSizePartitioner(min_shard_bytes=(256 << 10),
                                                      max_shards=NUM_PS)
    return jaxdist.ParameterServerStrategy(cluster_resolver,
                                           variable_partitioner=variable_partitioner,
                                           compute_devices=compute_devices)


def feature_and_label_gen(num_examples=200, rng=None):
    rng = rng or random.Random(0)
    examples = {"features": [], "label": []}
    for _ in range(num_examples):
        features = rng.sample(FEATURE_VOCAB, 3)
        label = ["yes"] if "avenger" in features else ["no"]
        examples["features"].append(features)
        examples["label"].append(label)
    return examples


def preprocess(examples):
    """The lookup stages: feature ids (0 = OOV, then the vocabulary), label ids yes=0, no=1."""
    feature_ids = {w: i + 1 for i, w in enumerate(FEATURE_VOCAB)}
    label_ids = {w: i for i, w in enumerate(LABEL_VOCAB)}
    features = np.array([[feature_ids.get(w, 0) for w in row] for row in examples["features"]],
                        np.int32)
    labels = np.array([[label_ids[w] for w in row] for row in examples["label"]], np.int32)
    return {"features": features}, labels


def init_model(seed: int = 0):
    k_emb, k_dense = jax.random.split(jax.random.key(seed))
    limit = np.sqrt(6.0 / (EMBEDDING_DIM + 1))
    return {
        "embedding": jax.random.uniform(k_emb, (len(FEATURE_VOCAB) + 1, EMBEDDING_DIM),
                                        minval=-0.05, maxval=0.05),
        "dense": {"kernel": jax.random.uniform(k_dense, (EMBEDDING_DIM, 1), minval=-limit,
                                               maxval=limit),
                  "bias": jnp.zeros((1,))},
    }


def model(params, batch_data):
    emb_output = jnp.mean(params["embedding"][batch_data["features"]], axis=1)
    logits = emb_output @ params["dense"]["kernel"] + params["dense"]["bias"]
    return jax.nn.sigmoid(logits)


def binary_crossentropy(labels, pred, epsilon=1e-7):
    """Keras' per-example BinaryCrossentropy (reduction NONE) on probabilities."""
    p = jnp.clip(pred, epsilon, 1 - epsilon)
    y = labels.astype(p.dtype)
    return jnp.mean(-(y * jnp.log(p) + (1 - y) * jnp.log(1 - p)), axis=-1)


def main(strategy=None, coordinator=None) -> dict:
    """Trains on ``coordinator``'s workers (default: in this process, on one device)."""
    if strategy is None:
        from ._inprocess import InProcessCoordinator

        strategy = make_strategy(compute_devices=jax.local_devices()[:1])
        coordinator = InProcessCoordinator(strategy)
    examples = feature_and_label_gen()
    eval_examples = feature_and_label_gen(num_examples=16, rng=random.Random(1))

    def dataset_fn(_):
        raw_dataset = jaxdist.Dataset.from_tensor_slices(preprocess(examples))
        return raw_dataset.shuffle(200, seed=0).batch(32).repeat()

    with strategy.scope():
        params = strategy.create_variables(init_model, optimizers.rmsprop(learning_rate=0.1),
                                           name="model")

    def step_fn(iterator):
        def replica_fn(params, batch_data, labels):
            ctx = jaxdist.get_replica_context()

            def loss_fn(p):
                pred = model(p, batch_data)
                per_example_loss = binary_crossentropy(labels, pred)
                loss = jaxdist.compute_average_loss(per_example_loss)
                loss += jaxdist.scale_regularization_loss(
                    1e-4 * jnp.sum(jnp.square(p["dense"]["kernel"])))
                return loss, pred

            (loss, pred), gradients = jax.value_and_grad(loss_fn, has_aux=True)(params)
            actual_pred = (pred > 0.5).astype(jnp.int32)
            real = ctx.row_mask(labels.shape[0])[:, None]
            correct = jnp.sum((actual_pred == labels) & real)
            return loss, gradients, correct, jnp.sum(real)

        batch_data, labels = next(iterator)
        losses, gradients, correct, count = strategy.run(replica_fn,
                                                         args=(params, batch_data, labels))
        params.apply_gradients(gradients)
        return (strategy.reduce(jaxdist.ReduceOp.SUM, losses, axis=None),
                strategy.reduce(jaxdist.ReduceOp.SUM, correct, axis=None),
                strategy.reduce(jaxdist.ReduceOp.SUM, count, axis=None))

    def per_worker_dataset_fn():
        return strategy.experimental_distribute_dataset(dataset_fn(None))

    per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
    per_worker_iterator = iter(per_worker_dataset)

    accuracies, losses = [], []
    for _ in range(NUM_EPOCHS):
        results = [coordinator.schedule(step_fn, args=(per_worker_iterator,))
                   for _ in range(STEPS_PER_EPOCH)]
        coordinator.join()
        fetched = [r.fetch() for r in results]
        losses += [float(f[0]) for f in fetched]
        accuracies.append(sum(float(f[1]) for f in fetched) / sum(float(f[2]) for f in fetched))

    loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
    final_loss = float(loss.fetch()[0])

    # Distributed evaluation: eval_step scheduled on the workers.
    def eval_step(iterator):
        def replica_fn(params, batch_data, labels):
            pred = model(params, batch_data)
            actual_pred = (pred > 0.5).astype(jnp.int32)
            return jnp.sum(actual_pred == labels), jnp.asarray(labels.size)

        batch_data, labels = next(iterator)
        correct, count = strategy.run(replica_fn, args=(params, batch_data, labels))
        return (strategy.reduce(jaxdist.ReduceOp.SUM, correct, axis=None),
                strategy.reduce(jaxdist.ReduceOp.SUM, count, axis=None))

    def eval_dataset_fn():
        return jaxdist.Dataset.from_tensor_slices(preprocess(eval_examples)).shuffle(
            16, seed=0).repeat().batch(8)

    per_worker_eval_dataset = coordinator.create_per_worker_dataset(eval_dataset_fn)
    per_worker_eval_iterator = iter(per_worker_eval_dataset)
    evals = [coordinator.schedule(eval_step, args=(per_worker_eval_iterator,))
             for _ in range(EVAL_STEPS_PER_EPOCH)]
    coordinator.join()
    evals = [e.fetch() for e in evals]
    eval_accuracy = sum(float(c) for c, _ in evals) / sum(float(n) for _, n in evals)
    return {"weights": params.pull(), "losses": losses, "accuracy": accuracies,
            "final_loss": final_loss, "eval_accuracy": eval_accuracy}
