"""Small flax nnx models for the job configs: an MLP and a CNN.

Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> from jaxdist.train.models import MLP
    >>> model = MLP(64, [128], 10, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 8, 8, 1))).shape
    (2, 10)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


class MLP(nnx.Module):
    """Dense layers with ReLU; inputs are flattened first.

    Args:
        in_features: the number of input features (the product of an example's shape).
        hidden_sizes: widths of the hidden layers.
        num_classes: output logits.
        rngs: ``nnx.Rngs`` for the initialisation.
    """

    def __init__(self, in_features: int, hidden_sizes: Sequence[int], num_classes: int, *,
                 rngs: nnx.Rngs):
        sizes = [in_features, *hidden_sizes, num_classes]
        self.layers = nnx.List(
            [nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])]
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


class CNN(nnx.Module):
    """3x3 convolutions (each with ReLU and 2x2 average pooling), then a dense classifier.

    Args:
        input_shape: an example's shape ``(height, width, channels)`` (or ``(height, width)``).
        features: channels of each conv layer.
        num_classes: output logits.
        rngs: ``nnx.Rngs`` for the initialisation.
    """

    def __init__(self, input_shape: Sequence[int], features: Sequence[int], num_classes: int,
                 *, rngs: nnx.Rngs):
        if len(input_shape) not in (2, 3):
            raise ValueError(f"CNN expects examples of shape (height, width[, channels]), got "
                             f"{tuple(input_shape)}")
        h, w = input_shape[0], input_shape[1]
        c = input_shape[2] if len(input_shape) == 3 else 1
        convs = []
        for f in features:
            convs.append(nnx.Conv(c, f, kernel_size=(3, 3), padding="SAME", rngs=rngs))
            c = f
            if h >= 2 and w >= 2:
                h, w = h // 2, w // 2
        self.convs = nnx.List(convs)
        self.head = nnx.Linear(h * w * c, num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.ndim == 3:
            x = x[..., None]
        for conv in self.convs:
            x = nnx.relu(conv(x))
            if x.shape[1] >= 2 and x.shape[2] >= 2:
                x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        return self.head(x.reshape(x.shape[0], -1))


def from_config(section: Mapping[str, Any], example_shape: Sequence[int], num_classes: int,
                seed: int) -> nnx.Module:
    """Builds the model a validated ``model`` config section names.

    The initialisation is one compiled program (``nnx.jit``): op by op, each operation of the
    random initialisers compiles on its own (about 30 small programs, 0.4-0.9 CPU-s of a short
    job's start on a CPU). The parameters are the same bits either way.
    """

    def build() -> nnx.Module:
        rngs = nnx.Rngs(seed)
        if section["name"] == "mlp":
            size = 1
            for d in example_shape:
                size *= int(d)
            return MLP(size, section["hidden_sizes"], num_classes, rngs=rngs)
        return CNN(example_shape, section["features"], num_classes, rngs=rngs)

    return nnx.jit(build)()


def _num_params(model: nnx.Module) -> int:
    return sum(int(jnp.size(x)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
