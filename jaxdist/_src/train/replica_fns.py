"""The Trainer's replica functions: what ``strategy.run`` compiles for a training dispatch
(``steps_per_execution`` steps in a ``lax.scan``), an evaluation batch and a prediction batch.

``ReplicaFunctions`` is a mixin of ``Trainer``: it reads the trainer's split model
(``_ms``), optimizer, loss, metrics, batch size and precision, and returns plain functions that
take the state as arguments (the trainer keeps one function object each, so ``strategy.run``
reuses their compiled programs).

Example:
    >>> from jaxdist._src.train.replica_fns import ReplicaFunctions
    >>> class Trainer(ReplicaFunctions): ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxdist._src.strategies.cross_device_ops import varying_axes
from jaxdist._src.strategies.current import get_replica_context
from jaxdist._src.strategies.losses import compute_average_loss
from jaxdist._src.train import keras_metrics
from jaxdist._src.train.hooks import PACKED, PACKED_FIELDS
from jaxdist._src.train.losses import correct_per_example


class ReplicaFunctions:
    """Mixin of ``Trainer``: builds its train, eval and predict replica functions.

    Example:
        >>> fn = trainer._make_eval_replica()   # doctest: +SKIP
    """

    def _apply(self, params: Any, rest: Any, x: jax.Array, rngs: Any = None) -> jax.Array:
        """The model's outputs in inference mode (Dropout off, BatchNorm's running stats)."""
        return self._ms.apply(params, rest, x, training=False,
                              compute_dtype=self._compute_dtype, rngs=rngs)[0]

    def _sync_axes(self) -> Any:
        """The mesh axes BatchNorm averages its batch statistics over (``batch_norm``)."""
        if self.batch_norm != "sync":
            return None
        return get_replica_context().axis_name

    def _make_train_replica(self) -> Callable:
        gbs, tx, loss_fn, ms = self.global_batch_size, self.optimizer, self.loss_fn, self._ms
        dtype, sync_axes = self._compute_dtype, self._sync_axes
        metric_stats = self._metric_stats

        per_replica = gbs // self.strategy.num_replicas_in_sync

        def train_replica(params, rest, rngs, opt_state, x, y, w, block_step, chunk):
            # x, y, w: a block of chunks, one per leading index (``_input_block``), whose
            # first step is ``block_step``; this dispatch runs chunk ``chunk``, its steps one
            # after the other.
            ctx = get_replica_context()
            num_steps = y.shape[1] // per_replica
            step = block_step + chunk * num_steps
            split = lambda a: lax.dynamic_index_in_dim(  # noqa: E731
                a, chunk, keepdims=False).reshape(num_steps, -1, *a.shape[2:])
            xs, ys, ws = jax.tree.map(split, x), split(y), split(w)
            replica, axes = ctx.replica_id_in_sync_group, sync_axes()

            def one_step(carry, batch):
                params, rest, opt_state, i = carry
                xb, yb, wb = batch

                def objective(p):
                    logits, new_rest = ms.apply(p, rest, xb, training=True, step=step + i,
                                                replica_id=replica, sync_axes=axes,
                                                compute_dtype=dtype, rngs=rngs)
                    per_example = loss_fn(logits, yb)
                    loss = compute_average_loss(per_example, sample_weight=wb,
                                                        global_batch_size=gbs)
                    return loss, (logits, new_rest)

                (loss, (logits, new_rest)), grads = jax.value_and_grad(
                    objective, has_aux=True)(ctx.local(params))
                grads = ctx.all_reduce("SUM", grads)
                # Running statistics: the mean over replicas (TF's ON_READ MEAN aggregation);
                # with sync batch statistics they are already equal everywhere and kept.
                rest = mean_where_varying(ctx, new_rest)
                updates, opt_state = tx.update(grads, opt_state, params)
                params = optax.apply_updates(params, updates)
                # accuracy, as Keras' `metrics`, is not weighted (every training row is real)
                stats = {"loss": loss, "correct": jnp.sum(correct_per_example(logits, yb)),
                         "weight": jnp.float32(yb.shape[0])}
                if all(v.dtype == jnp.float32 and v.ndim == 0 for v in stats.values()):
                    # one array per dispatch to fetch, not three (``hooks.PackedStepStats``)
                    stats = {PACKED: jnp.stack([stats[name] for name in PACKED_FIELDS])}
                stats.update(metric_stats(logits, yb, None, wb))
                return (params, rest, opt_state, i + 1), ctx.all_reduce("SUM", stats)

            (params, rest, opt_state, _), stats = lax.scan(
                one_step, (params, rest, opt_state, jnp.int32(0)), (xs, ys, ws))
            return params, rest, opt_state, stats

        return train_replica

    def _make_eval_replica(self) -> Callable:
        loss_fn, apply, metric_stats = self.loss_fn, self._apply, self._metric_stats

        def eval_replica(params, rest, rngs, x, y, w, mask):
            logits = apply(params, rest, x, rngs)
            per_example = loss_fn(logits, y)
            stats = {
                "loss": jnp.sum(per_example * w),
                "correct": jnp.sum(correct_per_example(logits, y) * mask),  # unweighted
                "weight": jnp.sum(mask),
                "count": jnp.sum(mask),
            }
            stats.update(metric_stats(logits, y, mask, w))
            return get_replica_context().all_reduce("SUM", stats)

        return eval_replica

    def _metric_stats(self, logits: jax.Array, y: jax.Array, mask: Any,
                      w: Any = None) -> dict[str, Any]:
        """``{"metrics": {name: sums}}`` of this replica's rows (summed by the caller): the
        ``metrics`` over the real rows (``mask``), the ``weighted_metrics`` with each row
        weighted by its sample weight ``w``."""
        return keras_metrics.metric_sums(self._metrics.specs, logits, y, mask, w)

    def _make_predict_replica(self) -> Callable:
        apply = self._apply

        def predict_replica(params, rest, rngs, x):
            return apply(params, rest, x, rngs)

        return predict_replica


def mean_where_varying(ctx: Any, tree: Any) -> Any:
    """The mean over the replicas of the leaves that vary over them; the others (already reduced,
    e.g. synchronized batch statistics) are returned unchanged, never reduced twice."""
    axes = ctx.axis_name if isinstance(ctx.axis_name, tuple) else (ctx.axis_name,)

    def mean(a: Any) -> Any:
        varying = tuple(x for x in axes if x in varying_axes(a))
        return lax.pmean(a, varying) if varying else a

    return jax.tree.map(mean, tree)


__all__ = ["ReplicaFunctions", "mean_where_varying"]
