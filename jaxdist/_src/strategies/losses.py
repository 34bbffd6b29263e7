"""Loss scaling for synchronous training (``tf.nn.compute_average_loss`` and friends).

The checks and messages are TF's current ones (``tensorflow/python/ops/nn_impl_distribute.py``;
TF 2.x's older ``nn_impl`` refused 0 as "must be positive"): both functions raise
``RuntimeError`` in the cross-replica context (inside ``strategy.scope()`` but outside
``strategy.run``), ``global_batch_size`` must be a scalar int and not negative
(``assert_non_negative``), and a zero batch size or an empty batch gives a loss of 0 (TF's
``div_no_nan``). TF checks a batch size that is a tensor when the graph runs; a traced one here
cannot raise, so a negative traced batch size gives a NaN loss instead of a wrong number.
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist._src.strategies import context as ctx_lib
from jaxdist._src.strategies import current


def _num_replicas() -> int:
    rctx = current.get_replica_context()
    if rctx is None:
        return current.get_strategy().num_replicas_in_sync
    return rctx.num_replicas_in_sync


def _check_replica_context(name: str) -> None:
    if ctx_lib.in_cross_replica_context():
        raise RuntimeError(
            f"You are calling `{name}` in cross replica context, while it was expected to be "
            f"called in replica context: call it inside the function given to strategy.run"
        )


def _mask_padding(per_example_loss: Any) -> Any:
    """Zeroes the padding rows of TF's partial last batch (see ``ReplicaContext.valid_rows``)."""
    rctx = current.get_replica_context()
    padded = getattr(rctx, "padded_rows", None)
    if padded is None or per_example_loss.shape[0] != padded:
        return per_example_loss
    mask = rctx.row_mask(padded).reshape((padded,) + (1,) * (per_example_loss.ndim - 1))
    return jnp.where(mask, per_example_loss, jnp.zeros_like(per_example_loss))


def _check_global_batch_size(global_batch_size: Any) -> Any:
    """TF's checks: a scalar, an integer, not negative (when known)."""
    if isinstance(global_batch_size, bool):
        raise TypeError(f"global_batch_size must be an int, got {global_batch_size!r}")
    shape = np.shape(global_batch_size) if not isinstance(global_batch_size, jax.Array) else (
        global_batch_size.shape
    )
    if shape != ():
        raise ValueError(f"global_batch_size must be scalar, got {global_batch_size!r}")
    dtype = getattr(global_batch_size, "dtype", None)
    if dtype is not None:
        if not jnp.issubdtype(dtype, jnp.integer):
            raise TypeError(f"global_batch_size must be an int, got {global_batch_size!r}")
    else:
        try:
            operator.index(global_batch_size)
        except TypeError:
            raise TypeError(
                f"global_batch_size must be an int, got {global_batch_size!r}"
            ) from None
    if not isinstance(global_batch_size, jax.core.Tracer) and int(global_batch_size) < 0:
        raise ValueError(f"global_batch_size must be non-negative, got {global_batch_size}")
    return global_batch_size


def _div_no_nan(total: Any, denominator: Any) -> Any:
    denominator = jnp.asarray(denominator, total.dtype)
    safe = jnp.where(denominator == 0, jnp.ones_like(denominator), denominator)
    return jnp.where(denominator == 0, jnp.zeros_like(total), total / safe)


def compute_average_loss(
    per_example_loss: Any,
    sample_weight: Any = None,
    global_batch_size: int | None = None,
) -> Any:
    """Scales per-example losses by the global batch size (``tf.nn.compute_average_loss``).

    ``sum(per_example_loss * sample_weight) / global_batch_size``. Summing the result over the
    replicas gives the mean loss over the global batch, so gradients match a single-device run.
    On TF's partial last batch the padding rows jaxdist adds are ignored.

    Args:
        per_example_loss: losses, leading axis = this replica's examples (rank >= 1).
        sample_weight: optional weights broadcastable to ``per_example_loss``.
        global_batch_size: the global batch size, a scalar int >= 0; default: this replica's
            batch size times ``num_replicas_in_sync``. 0 gives a loss of 0 (as TF). A traced
            value (an argument of ``strategy.run`` or ``jax.jit``) cannot be checked before the
            step runs: a negative one gives a NaN loss.

    Raises:
        RuntimeError: called in the cross-replica context (inside ``scope()``, outside ``run``).
        ValueError: ``per_example_loss`` is a scalar, shapes are incompatible,
            ``global_batch_size`` is not a scalar or is negative.
        TypeError: ``global_batch_size`` is not an int.

    Example:
        >>> import jax, jaxdist
        >>> import jax.numpy as jnp
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
        >>> def step(per_example):     # each replica's per-example losses
        ...     return jaxdist.compute_average_loss(per_example, global_batch_size=64)
        >>> loss = strategy.run(step, args=(jnp.ones(32),))
    """
    _check_replica_context("compute_average_loss")
    per_example_loss = jnp.asarray(per_example_loss)
    if per_example_loss.ndim == 0:
        raise ValueError(
            "Invalid value passed for `per_example_loss`. Expected a tensor with at least "
            f"rank 1, got a scalar of shape {per_example_loss.shape}"
        )
    if not jnp.issubdtype(per_example_loss.dtype, jnp.inexact):
        per_example_loss = per_example_loss.astype(jnp.float32)
    if sample_weight is not None:
        sample_weight = jnp.asarray(sample_weight, per_example_loss.dtype)
        try:
            jnp.broadcast_shapes(per_example_loss.shape, sample_weight.shape)
        except ValueError:
            raise ValueError(
                f"Incompatible shapes: {list(per_example_loss.shape)} vs. "
                f"{list(sample_weight.shape)} (per_example_loss and sample_weight)"
            ) from None
        per_example_loss = per_example_loss * sample_weight
    per_example_loss = _mask_padding(per_example_loss)
    if global_batch_size is None:
        global_batch_size = per_example_loss.shape[0] * _num_replicas()
    else:
        global_batch_size = _check_global_batch_size(global_batch_size)
    loss = _div_no_nan(jnp.sum(per_example_loss), global_batch_size)
    if isinstance(global_batch_size, jax.core.Tracer):
        # TF's assert_non_negative fails the step; a traced value cannot raise here, so a
        # negative batch size makes the loss NaN (loud) rather than a negative number.
        loss = jnp.where(global_batch_size < 0, jnp.full_like(loss, jnp.nan), loss)
    return loss


def scale_regularization_loss(regularization_loss: Any) -> Any:
    """Divides a regularisation loss by the replica count (``tf.nn.scale_regularization_loss``).

    Raises:
        RuntimeError: called in the cross-replica context (inside ``scope()``, outside ``run``).

    Example:
        >>> import jax, jaxdist
        >>> import jax.numpy as jnp
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
        >>> def step(loss, l2):
        ...     return loss + jaxdist.scale_regularization_loss(1e-4 * l2)
        >>> loss = strategy.run(step, args=(jnp.float32(0.5), jnp.float32(3.0)))
    """
    _check_replica_context("scale_regularization_loss")
    total = jnp.sum(jnp.asarray(regularization_loss))
    return total / _num_replicas()
