"""``jaxdist.keras``: Keras 3 (JAX backend) under jaxdist strategies; Keras is an optional extra,
imported only when these are called.

Keras is an optional extra (``pip install 'jaxdist[keras]'``) and is imported only when these
functions are called. ``scope(strategy)`` enters the strategy's scope and makes Keras distribute
variables and batches over the strategy's own mesh.

Example:
    >>> import jax
    >>> import keras, jaxdist, jaxdist.keras  # doctest: +NEEDS_KERAS
    >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
    >>> with jaxdist.keras.scope(strategy):
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    ...     model.compile(optimizer="sgd", loss="mse")
"""

from jaxdist._src.keras.api import (
    attach,
    compile_fit_step,
    distribution_for,
    distribution_scope,
    require_keras,
    scope,
    value_and_grad,
)

require_keras()  # Keras on the JAX backend (or a clear error) before the subclasses below import it

from jaxdist._src.keras.callbacks import (  # noqa: E402
    BackupAndRestore,
    ModelCheckpoint,
    TensorBoard,
)

__all__ = [
    "BackupAndRestore",
    "ModelCheckpoint",
    "TensorBoard",
    "attach",
    "compile_fit_step",
    "distribution_for",
    "distribution_scope",
    "require_keras",
    "scope",
    "value_and_grad",
]
