"""The losses a ``Trainer`` names (Keras' names) and the per-example accuracy of a step.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxdist._src.train.losses import LOSSES
    >>> logits, labels = jnp.zeros((32, 10)), jnp.zeros((32,), jnp.int32)
    >>> LOSSES["sparse_categorical_crossentropy"](logits, labels).shape   # one per example
    (32,)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

LossFn = Callable[[jax.Array, jax.Array], jax.Array]


def sparse_categorical_crossentropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example cross-entropy of integer ``labels`` under ``logits`` (Keras' name)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels.astype(jnp.int32))


def categorical_crossentropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example cross-entropy of one-hot (or probability) ``labels`` (Keras' name)."""
    return optax.softmax_cross_entropy(logits, labels.astype(logits.dtype))


LOSSES: dict[str, LossFn] = {"sparse_categorical_crossentropy": sparse_categorical_crossentropy,
                             "categorical_crossentropy": categorical_crossentropy}


def correct_per_example(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """1.0 where the argmax of ``logits`` is the integer label, else 0.0 (zeros for labels
    that are not class ids)."""
    if logits.ndim != labels.ndim + 1:
        return jnp.zeros(labels.shape[:1], jnp.float32)
    return (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)


def correct(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """The number of correct predictions in a batch."""
    return jnp.sum(correct_per_example(logits, labels))


__all__ = ["LOSSES", "LossFn", "categorical_crossentropy", "correct", "correct_per_example",
           "sparse_categorical_crossentropy"]
