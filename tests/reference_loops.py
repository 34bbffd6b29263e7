"""Hand-written JAX training steps the tests compare jaxdist against."""

import jax
import optax
from flax import nnx


def optax_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation):
    """A jitted ``step(params, opt_state, x, y) -> (params, opt_state, loss)``: mean softmax
    cross-entropy of the nnx model ``graphdef`` over one batch, then one ``tx`` update.

    Example:
        >>> step = optax_step(graphdef, optax.sgd(0.1))
        >>> params, opt_state, loss = step(params, opt_state, x, y)
    """

    @jax.jit
    def step(params, opt_state, x, y):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step
