"""``RunOptions``: per-call options of ``Strategy.run`` (``tf.distribute.RunOptions``)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Options for one ``strategy.run`` call.

    Args:
        donate_argnums: positions in ``args`` whose arrays the step may reuse for its outputs
            (``jax.jit``'s ``donate_argnums``): pass the training state (parameters, optimizer
            state) that the step replaces, and XLA writes the new state into the old buffers
            instead of allocating new ones. The donated arrays are deleted by the call: use only
            what ``run`` returns afterwards. Keyword arguments are never donated.
        experimental_enable_dynamic_batch_size: accepted for TF compatibility (JAX compiles
            one program per batch shape).
        experimental_bucketizing_dynamic_shape: accepted for TF compatibility.
        experimental_xla_options: accepted for TF compatibility.

    Example:
        >>> import jax, jaxdist
        >>> import jax.numpy as jnp
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
        >>> def train_step(params, opt_state, batch):
        ...     return params - 0.1 * batch, opt_state + 1, jnp.sum(batch)
        >>> params, opt_state, batch = jnp.ones(3), jnp.zeros(()), jnp.ones(3)
        >>> donate = jaxdist.RunOptions(donate_argnums=(0, 1))
        >>> params, opt_state, loss = strategy.run(
        ...     train_step, args=(params, opt_state, batch), options=donate)
    """

    donate_argnums: tuple[int, ...] = ()
    experimental_enable_dynamic_batch_size: bool = True
    experimental_bucketizing_dynamic_shape: bool = False
    experimental_xla_options: Any = None

    def __post_init__(self):
        nums = self.donate_argnums
        if isinstance(nums, int):
            nums = (nums,)
        try:
            nums = tuple(sorted({int(i) for i in nums}))
        except (TypeError, ValueError):
            raise TypeError(
                f"RunOptions.donate_argnums={self.donate_argnums!r}: expected an int or a "
                f"tuple of ints (positions in args)"
            ) from None
        if any(i < 0 for i in nums):
            raise ValueError(
                f"RunOptions.donate_argnums={self.donate_argnums!r}: positions must be >= 0"
            )
        object.__setattr__(self, "donate_argnums", nums)


__all__ = ["RunOptions"]
