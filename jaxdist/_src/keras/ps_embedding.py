"""Keras ``Embedding`` layers as sparse parameter-server tables (rows pulled and pushed).

For a Keras ``Embedding`` layer named in ``attach(..., sparse_embeddings=[...])`` the table
lives on the ps tasks as a row-sharded ``jaxdist.ps.EmbeddingTable``. Each step the worker
pulls only the rows of the ids in its batch (each distinct id once), runs the model with the
ids renumbered into those rows and the layer's weight replaced by them, and pushes the
gradient of those rows only. On the worker the layer's weight shrinks to a
``(ids per batch, dim)`` buffer once the table is on the ps.

The layer must take a model input directly (the ids must be in the batch). Row-wise (lazy)
updates equal Keras's dense update for SGD without momentum and Adagrad; other optimizers
would update rows a batch does not touch in Keras, so they are refused unless an
``embedding_optimizer=`` is given explicitly (TF's lazy-Adam semantics, by choice).

Example:
    >>> import keras, jaxdist.keras  # doctest: +NEEDS_KERAS
    >>> ids = keras.Input((2,), dtype="int32")
    >>> emb = keras.layers.Embedding(1000, 8, name="items")(ids)
    >>> model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(emb)))
    >>> model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    >>> strategy = jaxdist.ParameterServerStrategy()   # no TF_CONFIG: trains locally
    >>> jaxdist.keras.attach(model, strategy, sparse_embeddings=["items"])
    KerasPSTraining(...)
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxdist._src.compat import keras_internals as ki
from jaxdist._src.ps import optimizers as ps_opt

_ROWWISE_EXACT = ("sgd", "adagrad")


def table_optimizer(spec: ps_opt.OptimizerSpec, explicit: Any, layer_names: list[str]) -> Any:
    """The row-wise optimizer of the sparse tables (see the module docstring)."""
    if explicit is not None:
        return ps_opt.as_spec(explicit)
    if spec.name in _ROWWISE_EXACT:
        return spec
    raise ValueError(
        f"sparse embeddings {layer_names}: the ps updates only the rows a batch touches, which "
        f"equals Keras's dense {spec.name!r} update only for {list(_ROWWISE_EXACT)} (no "
        f"momentum, no clipping); compile with SGD or Adagrad, or pass embedding_optimizer="
        f"jaxdist.ps.optimizers.adam(...) to accept lazy (row-wise) updates explicitly"
    )


def input_index(model: Any, layer: Any) -> int:
    """The index in ``model.inputs`` of the input ``layer`` takes (``ValueError`` if none).

    Example:
        >>> from jaxdist._src.keras.ps_embedding import input_index
        >>> import keras  # doctest: +NEEDS_KERAS
        >>> ids = keras.Input((2,), dtype="int32")
        >>> emb = keras.layers.Embedding(1000, 8, name="items")(ids)
        >>> model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(emb)))
        >>> input_index(model, model.get_layer("items"))
        0
    """
    nodes = ki.inbound_nodes(layer)
    tensors = list(nodes[0].input_tensors) if len(nodes) == 1 else []
    for i, inp in enumerate(model.inputs or []):
        if len(tensors) == 1 and tensors[0] is inp:
            return i
    raise ValueError(
        f"Embedding layer {layer.name!r} does not take a model input directly: the sparse row "
        f"pull needs its ids in the batch; feed it from a keras.Input (first layer of a "
        f"Sequential, or Input -> Embedding in a functional model), or leave it dense"
    )


class SparseTable:
    """One Keras ``Embedding`` layer whose table is a ps ``EmbeddingTable``.

    Args:
        model: the Keras model.
        layer: its ``keras.layers.Embedding``.
        table: the ``EmbeddingTable`` on the ps.
        index: the position of its ids among ``model.inputs`` (default: found from the
            layer's inbound node).
    """

    def __init__(self, model: Any, layer: Any, table: Any, index: int | None = None):
        self.layer, self.table = layer, table
        self.input_index = input_index(model, layer) if index is None else int(index)
        self.num_inputs = len(model.inputs)
        self.var_index = next(i for i, v in enumerate(model.trainable_variables)
                              if v is layer.embeddings)
        self.cap = 0
        self.rows_pulled = 0
        self.rows_pushed = 0

    def shrink(self, cap: int) -> None:
        """Makes the layer's weight a ``(cap, dim)`` buffer (the full table is on the ps)."""
        v = self.layer.embeddings
        ki.replace_variable_value(v, jnp.zeros((int(cap), self.table.dim), v.dtype))
        self.cap = int(cap)

    def restore(self, full: np.ndarray) -> None:
        """Gives the layer back its whole table (``full``: ``(vocab_size, dim)``)."""
        v = self.layer.embeddings
        ki.replace_variable_value(v, jnp.asarray(full, v.dtype))
        self.cap = 0

    def _ids(self, x: Any) -> np.ndarray:
        if self.num_inputs == 1 and not isinstance(x, (list, tuple, dict)):
            return np.asarray(x)
        if isinstance(x, (list, tuple)):
            return np.asarray(x[self.input_index])
        raise ValueError(f"sparse embedding {self.layer.name!r}: expected the batch's x as an "
                         f"array or a list of arrays (one per model input), got "
                         f"{type(x).__name__}")

    def _with_ids(self, x: Any, ids: np.ndarray) -> Any:
        if self.num_inputs == 1 and not isinstance(x, (list, tuple)):
            return ids
        x = list(x)
        x[self.input_index] = ids
        return x

    def pull(self, x: Any) -> tuple[Any, np.ndarray, Any]:
        """Pulls the rows of the batch's ids.

        Returns:
            ``(x with ids renumbered into the rows, (cap, dim) rows padded with zeros,
            the EmbeddingLookup)``.
        """
        ids = self._ids(x)
        look = self.table.lookup(ids)
        self.rows_pulled += len(look.unique_ids)
        if ids.size > self.cap:  # a bigger batch than before: a bigger buffer
            self.shrink(ids.size)
        rows = np.zeros((self.cap, self.table.dim), self.table.dtype)
        rows[:len(look.unique_ids)] = look.rows
        new_ids = look.inverse.astype(np.int32)
        return self._with_ids(x, new_ids), rows, look

    def push(self, look: Any, grad: Any) -> None:
        """Pushes the gradient of the pulled rows (the buffer's first ``len(unique ids)``)."""
        n = len(look.unique_ids)
        self.table.apply_gradients(look, np.asarray(grad)[:n])
        self.rows_pushed += n


__all__ = ["SparseTable", "input_index", "table_optimizer"]
