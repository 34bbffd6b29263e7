"""Keras 3 (JAX backend) under jaxdist strategies: ``model.fit`` inside a strategy's scope.

Keras is an optional extra (``pip install 'jaxdist[keras]'``) and is imported only when this
package's functions are called. ``scope(strategy)`` enters the strategy's scope and makes Keras
distribute variables and batches over the strategy's own mesh (one mesh, so Keras's jitted
train step and jaxdist agree on every placement).

Example:
    >>> import jax
    >>> import numpy as np
    >>> import keras, jaxdist, jaxdist.keras
    >>> x, y = np.ones((32, 4), np.float32), np.ones((32, 1), np.float32)
    >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
    >>> with jaxdist.keras.scope(strategy):
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    ...     model.compile(optimizer="sgd", loss="mse")
    ...     history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
"""
