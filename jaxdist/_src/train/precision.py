"""Mixed precision, as Keras' ``mixed_bfloat16`` policy: compute in bfloat16, keep the
parameters and the optimizer state in float32.

Inside each step the floating parameters and inputs are cast to the compute dtype, the model
runs in it, and its outputs are cast back to float32 before the loss; the gradient flows back
through the casts, so it is float32 and the optax update is applied to float32 parameters.
bfloat16 has float32's exponent range, so no loss scaling is needed (Keras' LossScaleOptimizer
is only for float16, which jaxdist does not offer).

Example:
    >>> import jaxdist
    >>> from jaxdist._src.train.precision import compute_dtype
    >>> compute_dtype("bfloat16")
    dtype(bfloat16)
    >>> import optax
    >>> from flax import nnx
    >>> model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    >>> trainer = jaxdist.Trainer(model, optax.adam(1e-3), global_batch_size=64,
    ...                           precision="bfloat16")
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

#: ``precision`` values: the default float32, or Keras' ``mixed_bfloat16``.
PRECISIONS = ("float32", "bfloat16", "mixed_bfloat16")


def compute_dtype(precision: str) -> Any:
    """The compute dtype of ``precision`` (``None`` for float32: nothing is cast).

    Raises:
        ValueError: an unknown precision.

    Example:
        >>> from jaxdist._src.train.precision import compute_dtype
        >>> compute_dtype("float32") is None
        True
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not valid; expected one of "
                         f"{', '.join(PRECISIONS)} (float16 needs loss scaling and is not "
                         f"offered; use bfloat16)")
    return None if precision == "float32" else jnp.dtype(jnp.bfloat16)


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Casts the floating-point leaves of ``tree`` to ``dtype`` (others unchanged).

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxdist._src.train.precision import cast_floating
        >>> cast_floating({"w": jnp.ones(2), "n": jnp.int32(3)}, jnp.bfloat16)["w"].dtype
        dtype(bfloat16)
    """
    def cast(x: Any) -> Any:
        x = jnp.asarray(x)
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, tree)


__all__ = ["PRECISIONS", "cast_floating", "compute_dtype"]
