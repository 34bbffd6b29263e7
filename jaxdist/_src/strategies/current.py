"""The current strategy and replica context, with the default strategy outside every scope.

Example:
    >>> from jaxdist import get_replica_context, get_strategy
    >>> get_strategy()
    DefaultStrategy()
    >>> get_replica_context().num_replicas_in_sync
    1
"""

from __future__ import annotations

from jaxdist._src.strategies.context import top
from jaxdist._src.strategies.default import get_default_strategy
from jaxdist._src.strategies.replica_context import ReplicaContext
from jaxdist._src.strategies.strategy import Strategy


def get_strategy() -> Strategy:
    """Returns the current strategy: the innermost ``scope()``, else the default strategy.

    Example:
        >>> import jax, jaxdist
        >>> with jaxdist.MirroredStrategy(jax.devices()[:2]).scope():  # doctest: +NEEDS_2_DEVICES
        ...     jaxdist.get_strategy().num_replicas_in_sync
        2
    """
    frame = top()
    if frame is None:
        return get_default_strategy()
    return frame.strategy


def get_replica_context() -> ReplicaContext | None:
    """The current ``ReplicaContext``; ``None`` in a cross-replica context.

    Outside every scope this is the default strategy's replica context (one replica), as in TF.

    Example:
        >>> import jax, jaxdist
        >>> import jax.numpy as jnp
        >>> def step(x):
        ...     ctx = jaxdist.get_replica_context()
        ...     return ctx.all_reduce("SUM", x) / ctx.num_replicas_in_sync
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
        >>> per_replica_x = strategy.experimental_distribute_values_from_function(
        ...     lambda ctx: jnp.float32(ctx.replica_id_in_sync_group))
        >>> mean = strategy.run(step, args=(per_replica_x,))
    """
    frame = top()
    if frame is None:
        return get_default_strategy().default_replica_context
    return frame.replica_context


__all__ = ["get_replica_context", "get_strategy"]
