"""A flax nnx model as the ``Trainer`` carries it: parameters, mutable state, random streams.

``ModelState.split(model)`` separates the model into its graph definition and three pytrees:

* ``params``: the ``nnx.Param`` variables (trained, checkpointed);
* ``rest``: every other variable that is not random-stream state, e.g. ``BatchNorm``'s running
  statistics (``nnx.BatchStat``): updated by training steps, checkpointed, used in evaluation;
* ``rngs``: the base keys of the model's random streams (``nnx.Rngs``), stored as raw
  ``uint32`` key data so they place, pickle and checkpoint as plain arrays.

``ModelState.apply`` rebuilds the model inside a replica function and calls it in Keras'
training or inference mode:

* training: ``Dropout`` (anything with a ``deterministic`` attribute) is on and every random
  stream is reseeded with ``fold_in(fold_in(base_key, step), replica_id)``: per-replica,
  per-step keys, the same for the same seed (and after a resume); ``BatchNorm`` (anything with
  ``use_running_average``) normalizes with batch statistics, computed over every replica's rows
  (``batch_norm="sync"``, TF's ``SyncBatchNormalization``) or over the replica's own rows
  (``"per_replica"``, TF's default ``BatchNormalization`` under a strategy);
* inference (``evaluate``, ``predict``): ``Dropout`` off, ``BatchNorm`` uses its running
  statistics.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxdist._src.train.model_state import ModelState
    >>> from flax import nnx
    >>> model, x = nnx.Linear(4, 2, rngs=nnx.Rngs(0)), jnp.ones((5, 4))
    >>> ms = ModelState.split(model)
    >>> logits, new_rest = ms.apply(ms.params, ms.rest, x, training=True, step=0,
    ...                             replica_id=0)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

#: ``batch_norm`` values: batch statistics across replicas, or per replica.
BATCH_NORM_MODES = ("sync", "per_replica")


def check_batch_norm(mode: str) -> str:
    """Returns ``mode`` if it is a valid ``batch_norm`` option, else raises ``ValueError``.

    Example:
        >>> from jaxdist._src.train.model_state import check_batch_norm
        >>> check_batch_norm("sync")
        'sync'
    """
    if mode not in BATCH_NORM_MODES:
        raise ValueError(f"batch_norm={mode!r} is not valid; expected 'sync' (statistics over "
                         f"the global batch, TF's SyncBatchNormalization) or 'per_replica' "
                         f"(each replica's own rows, TF's default)")
    return mode


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


@dataclasses.dataclass
class ModelState:
    """A split nnx model (see the module docstring).

    Attributes:
        graphdef: the model's ``nnx.GraphDef``.
        params: the ``nnx.Param`` state.
        rest: the other non-random state (``BatchStat`` ...).
        rngs: random-stream state with keys as raw key data.
        key_impls: the PRNG implementation of each key leaf of ``rngs`` (``None`` elsewhere).
    """

    graphdef: Any
    params: Any
    rest: Any
    rngs: Any
    key_impls: Any

    @classmethod
    def split(cls, model: nnx.Module) -> ModelState:
        """Splits ``model`` (see the module docstring).

        Example:
            >>> from flax import nnx
            >>> from jaxdist._src.train.model_state import ModelState
            >>> ms = ModelState.split(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
        """
        graphdef, params, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
        impls = jax.tree.map(lambda x: str(jax.random.key_impl(x)) if _is_key(x) else None,
                             rngs)
        raw = jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, rngs)
        return cls(graphdef, params, rest, raw, impls)

    @property
    def has_random_streams(self) -> bool:
        """Whether the model draws random numbers (``Dropout`` ...)."""
        return bool(jax.tree.leaves(self.rngs))

    @property
    def has_batch_stats(self) -> bool:
        """Whether the model has ``nnx.BatchStat`` variables (``BatchNorm``)."""
        model = nnx.merge(self.graphdef, self.params, self._keys(self.rngs), self.rest)
        return bool(jax.tree.leaves(nnx.state(model, nnx.BatchStat)))

    def _keys(self, rngs: Any) -> Any:
        return jax.tree.map(
            lambda x, impl: x if impl is None else jax.random.wrap_key_data(x, impl=impl),
            rngs, self.key_impls, is_leaf=lambda v: v is None)

    def merge(self, params: Any, rest: Any, rngs: Any = None) -> nnx.Module:
        """The model with ``params`` and ``rest`` (and the random streams)."""
        # Fresh variables, created at the current trace level: nnx refuses to mutate a
        # variable (BatchNorm's statistics) made at an outer level (scan, grad).
        params, rest, rngs = jax.tree.map(
            lambda a: a, (params, rest, self._keys(self.rngs if rngs is None else rngs)))
        return nnx.merge(self.graphdef, params, rngs, rest)

    def apply(self, params: Any, rest: Any, x: Any, *, training: bool, step: Any = 0,
              replica_id: Any = 0, sync_axes: Any = None, compute_dtype: Any = None,
              rngs: Any = None) -> tuple[jax.Array, Any]:
        """Calls the model on ``x``; returns ``(outputs, new_rest)``.

        Args:
            params, rest: the state to use.
            x: a batch (an array or a pytree of arrays).
            training: training mode (dropout on, batch statistics) or inference mode.
            step: the global step (training: part of the random keys).
            replica_id: this replica's id (training: part of the random keys).
            sync_axes: mesh axes ``BatchNorm`` averages its batch statistics over (training
                with ``batch_norm="sync"``); ``None``: each replica's own rows.
            compute_dtype: compute in this dtype (mixed precision): floating parameters and
                inputs are cast to it, outputs back to float32.
            rngs: random-stream state to use instead of the split model's.

        Returns:
            The model's outputs and the state of ``rest`` after the call (running statistics
            updated in training mode).
        """
        if compute_dtype is not None:
            from jaxdist._src.train.precision import cast_floating

            params, x = cast_floating(params, compute_dtype), cast_floating(x, compute_dtype)
        model = self.merge(params, rest, rngs)
        _set_mode(model, training, sync_axes)
        if training:
            _reseed(model, step, replica_id)
        out = model(x)
        if compute_dtype is not None:
            out = jax.tree.map(
                lambda o: o.astype(jnp.float32) if jnp.issubdtype(o.dtype, jnp.floating) else o,
                out)
        _, _, _, new_rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
        return out, new_rest


def _set_mode(model: nnx.Module, training: bool, sync_axes: Any) -> None:
    for _, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module):
            continue
        if hasattr(node, "deterministic") and isinstance(node.deterministic, bool | None):
            node.deterministic = not training
        if hasattr(node, "use_running_average"):
            node.use_running_average = not training
            if isinstance(node, nnx.BatchNorm):
                node.axis_name = sync_axes if training else None


def _reseed(model: nnx.Module, step: Any, replica_id: Any) -> None:
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.RngStream):
            key = jax.random.fold_in(jax.random.fold_in(node.key[...], step), replica_id)
            node.key[...] = key
            node.count[...] = jnp.zeros_like(node.count[...])


__all__ = ["BATCH_NORM_MODES", "ModelState", "check_batch_norm"]
