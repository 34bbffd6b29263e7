"""Loss scaling for synchronous training (``tf.nn.compute_average_loss`` and friends)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxdist.strategies import context as ctx_lib


def _num_replicas() -> int:
    rctx = ctx_lib.get_replica_context()
    if rctx is None:
        return ctx_lib.get_strategy().num_replicas_in_sync
    return rctx.num_replicas_in_sync


def _mask_padding(per_example_loss: Any) -> Any:
    """Zeroes the padding rows of TF's partial last batch (see ``ReplicaContext.valid_rows``)."""
    rctx = ctx_lib.get_replica_context()
    padded = getattr(rctx, "padded_rows", None)
    if padded is None or per_example_loss.shape[0] != padded:
        return per_example_loss
    mask = rctx.row_mask(padded).reshape((padded,) + (1,) * (per_example_loss.ndim - 1))
    return jnp.where(mask, per_example_loss, jnp.zeros_like(per_example_loss))


def compute_average_loss(
    per_example_loss: Any,
    sample_weight: Any = None,
    global_batch_size: int | None = None,
) -> Any:
    """Scales per-example losses by the global batch size (``tf.nn.compute_average_loss``).

    ``sum(per_example_loss * sample_weight) / global_batch_size``. Summing the result over the
    replicas gives the mean loss over the global batch, so gradients match a single-device run.

    Args:
        per_example_loss: losses, leading axis = this replica's examples (rank >= 1).
        sample_weight: optional weights broadcastable to ``per_example_loss``.
        global_batch_size: the global batch size; default: this replica's batch size times
            ``num_replicas_in_sync``.

    Example:
        >>> loss = jaxdist.compute_average_loss(per_example, global_batch_size=64)
    """
    per_example_loss = jnp.asarray(per_example_loss)
    if per_example_loss.ndim == 0:
        raise ValueError(
            "compute_average_loss expects per-example losses of rank >= 1, got a scalar; "
            "compute the loss without reducing over the batch"
        )
    if sample_weight is not None:
        per_example_loss = per_example_loss * jnp.asarray(sample_weight, per_example_loss.dtype)
    per_example_loss = _mask_padding(per_example_loss)
    if global_batch_size is None:
        global_batch_size = per_example_loss.shape[0] * _num_replicas()
    if isinstance(global_batch_size, int) and global_batch_size <= 0:
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
    total = jnp.sum(per_example_loss)
    return total / jnp.asarray(global_batch_size, total.dtype)


def scale_regularization_loss(regularization_loss: Any) -> Any:
    """Divides a regularisation loss by the replica count (``tf.nn.scale_regularization_loss``).

    Example:
        >>> loss = loss + jaxdist.scale_regularization_loss(1e-4 * l2)
    """
    total = jnp.sum(jnp.asarray(regularization_loss))
    return total / _num_replicas()
