"""The ``Trainer`` under ``ParameterServerStrategy``: variables on the ps, asynchronous steps.

``ParameterServerHook`` is the ``TrainerHook`` of ``ParameterServerStrategy`` (TF1 between-graph
training). With it, every worker runs the same ``Trainer.fit``:

* the chief creates the model's parameters and the optimizer state on the ps tasks (the
  optimizer must be a ``jaxdist.ps.optimizers`` spec); other workers wait for them;
* each step pulls the parameters, computes the gradient synchronously across the worker's
  local devices (jit, the strategy's all-reduce), and pushes it; the ps applies the update.
  Workers do not wait for each other (or stay within ``max_staleness`` steps);
* every epoch, worker ``i`` of ``n`` trains on its own disjoint, deterministic share of the
  epoch's order (examples ``i, i+n, ...``; input pipeline id = worker index);
* the chief evaluates, logs, and asks the ps tasks to checkpoint (``extended.save``); after a
  restart every worker resumes from the step of the checkpoint the ps tasks restored;
  non-chief workers write nothing;
* at the end every worker marks itself done (``worker_done``); the chief waits for the others
  (while they make progress) before its final evaluation and checkpoint.

Example:
    >>> import numpy as np
    >>> import jaxdist.ps
    >>> from flax import nnx
    >>> x, y = np.ones((128, 4), np.float32), np.zeros((128,), np.int32)
    >>> x_val, y_val = x[:64], y[:64]
    >>> strategy = jaxdist.ParameterServerStrategy()          # TF_CONFIG, or local
    >>> with strategy.scope():
    ...     model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    ...     trainer = jaxdist.Trainer(model, jaxdist.ps.optimizers.adam(3e-3),
    ...                               global_batch_size=64, strategy=strategy)
    >>> history = trainer.fit((x, y), epochs=2, validation_data=(x_val, y_val), verbose=0)
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdist._src.ps import optimizers as ps_optimizers
from jaxdist._src.strategies.current import get_replica_context
from jaxdist._src.strategies.losses import compute_average_loss
from jaxdist._src.train import data as data_lib
from jaxdist._src.train.hooks import TrainerHook
from jaxdist._src.train.state import TrainerContext, TrainState

#: The ps collection the trainer's parameters live in.
COLLECTION = "model"


class PSHookMixin:
    """What the parameter-server hooks (between-graph and coordinator) share: the model check,
    the state version and the final-checkpoint mark."""

    # Set by the hooks: the strategy, the variables handle, and whether this task is the chief.
    strategy: Any
    variables: Any = None
    is_chief: bool

    def check_model(self, ctx: TrainerContext) -> None:
        """Raises ``ValueError`` for a model with state the ps tasks cannot update."""
        if ctx.model_state.has_batch_stats:
            raise ValueError(
                f"{type(self.strategy).__name__} keeps only the model's nnx.Param "
                f"variables on the parameter servers; BatchNorm's running statistics "
                f"(nnx.BatchStat) cannot be updated there, so batch_norm="
                f"{ctx.batch_norm!r} (and 'sync'/'per_replica' alike) is not supported: "
                f"use a model without BatchNorm (LayerNorm, GroupNorm), or MirroredStrategy / "
                f"MultiWorkerMirroredStrategy (Dropout is supported)")

    def state_version(self, ctx: TrainerContext, state: TrainState) -> Any:
        """The shards' versions as of the last pull (``current_state``)."""
        if self.variables is None:
            return None
        return tuple(sorted(self.variables.versions.items()))

    _noted: frozenset = frozenset()

    def _chief_only(self, what: str) -> bool:
        """Whether this task may change the state shared on the ps (the chief owns it)."""
        if self.is_chief:
            return True
        if what not in self._noted:
            self._noted = self._noted | {what}
            print(f"[ps] worker {getattr(self, 'worker_index', '?')}: {what} is done by the "
                  f"chief only (it validates and owns the shared state); ignored here",
                  flush=True)
        return False

    def get_learning_rate(self, ctx: TrainerContext, state: TrainState) -> float:
        """The rate the ps tasks' optimizers apply now (read from them)."""
        value = self.variables.learning_rate()
        if value is None:
            raise ValueError(f"the ps optimizer {ps_optimizers.as_spec(ctx.optimizer)} has "
                             f"no learning_rate to read or change")
        if isinstance(value, dict):
            raise ValueError("the learning rate follows a schedule on the ps, which sets it at "
                             "every update; use a constant learning rate to change it at run "
                             "time (e.g. with ReduceLROnPlateau)")
        return float(value)

    def set_learning_rate(self, ctx: TrainerContext, state: TrainState, value: float
                          ) -> TrainState:
        """Sets the rate on every ps task (an authenticated ``LearningRate`` call); pushes
        from then on use it. Only the chief changes it (see ``_chief_only``)."""
        if self._chief_only("changing the learning rate"):
            self.variables.set_learning_rate(value)
        return state

    def current_learning_rate(self, ctx: TrainerContext, state: TrainState) -> float | None:
        """The rate on the ps now (one small call; ``None`` for a schedule)."""
        if self.variables is None:
            return None
        value = self.variables.learning_rate()
        return float(value) if isinstance(value, (int, float)) else None

    def set_weights(self, ctx: TrainerContext, state: TrainState, params: Any) -> TrainState:
        """Assigns the ps variables (their optimizer state is kept). Chief only."""
        if not self._chief_only("set_weights"):
            return state
        self.variables.assign(params)
        return state.replace(params=params)

    def end_fit(self, ctx: TrainerContext, state: TrainState) -> None:
        """Marks the final checkpoint final (a side-car evaluator stops after evaluating it)."""
        if (ctx.checkpoint_dir is not None and self.is_chief
                and state.last_checkpoint == state.step):
            self.strategy.extended.mark_checkpoint_final(
                os.path.abspath(ctx.checkpoint_dir), state.step)


class ParameterServerHook(PSHookMixin, TrainerHook):
    """``TrainerHook`` for ``ParameterServerStrategy`` (see the module docstring).

    Args:
        strategy: the ``ParameterServerStrategy``.
    """

    #: Each worker reads the stream it is given (the user shards it per worker).
    accepts_streams = True

    def __init__(self, strategy: Any):
        self.strategy = strategy
        ext = strategy.extended
        info = ext.task_info
        self.num_workers = max(1, info.num_workers)
        self.worker_index = ext.worker_index if info.num_workers else 0
        self.is_chief = bool(ext.should_checkpoint)
        self.should_evaluate = self.is_chief
        self.local = not info.ps_addresses
        self.variables: Any = None
        # The per-replica step of one batch size (built on the first step of that size).
        self._grad_replica: tuple[int, Any] | None = None

    # ------------------------------------------------------------------ state
    def init_state(self, ctx: TrainerContext, params: Any, rest: Any) -> TrainState:
        self.check_model(ctx)
        spec = ps_optimizers.as_spec(ctx.optimizer)
        host = jax.device_get(params)
        with self.strategy.scope():
            self.variables = self.strategy.create_variables(host, spec, name=COLLECTION)
            rest = self.strategy.place(rest)
        return TrainState(host, rest, None)

    def current_state(self, ctx: TrainerContext, state: TrainState) -> TrainState:
        return state.replace(params=self.variables.pull())

    # ------------------------------------------------------------------ data and steps
    def epoch_order(self, ctx: TrainerContext, num_examples: int, epoch: int) -> np.ndarray:
        order = data_lib.epoch_order(num_examples, epoch, ctx.seed, ctx.shuffle)
        share = num_examples // self.num_workers
        return order[self.worker_index::self.num_workers][:share]

    def train_step(self, ctx: TrainerContext, state: TrainState, x: Any, y: Any,
                   num_steps: int, w: Any = None, chunk: int = 0
                   ) -> tuple[TrainState, dict[str, Any]]:
        if self._grad_replica is None or self._grad_replica[0] != ctx.global_batch_size:
            self._grad_replica = (ctx.global_batch_size, _make_grad_replica(ctx))
        grad_replica = self._grad_replica[1]
        out = []
        for i in range(num_steps):
            # run() pulls the variables (after the SSP wait), computes on the local devices.
            # Dropout keys: the global step, this worker and the replica (per-step, distinct).
            stats, grads = self.strategy.run(
                grad_replica,
                args=(self.variables, state.rest, ctx.rngs, x, y, w, np.int32(i),
                      np.int32(state.step + i), np.int32(self.worker_index)))
            self.variables.apply_gradients(grads)   # push; each ps applies its optimizer
            out.append(stats)
        fetched = jax.device_get(out)
        return state, jax.tree.map(lambda *a: np.stack([np.asarray(v) for v in a]), *fetched)

    # ------------------------------------------------------------------ checkpoints
    def resume(self, ctx: TrainerContext, state: TrainState, steps_per_epoch: int
               ) -> tuple[TrainState, Any]:
        directory = os.path.abspath(ctx.checkpoint_dir)
        ext = self.strategy.extended
        restored = [s.get("restored_step") for s in ext.ps_status()]
        if all(r is not None for r in restored):
            step = min(int(r) for r in restored)        # the ps tasks restored at start
        elif self.local and ext.latest_checkpoint_step(directory) is not None:
            step = min(ext.restore(directory))           # in-process ps: restore it now
        else:
            return state, None
        epoch, in_epoch = divmod(step, steps_per_epoch)
        return state.replace(step=step, epoch=epoch, step_in_epoch=in_epoch,
                             last_checkpoint=step), None

    def save(self, ctx: TrainerContext, state: TrainState, data_position: Any = None
             ) -> TrainState:
        if not self.is_chief:
            return state
        self.strategy.extended.save(os.path.abspath(ctx.checkpoint_dir), state.step,
                                    keep=ctx.keep_checkpoints)
        return state.replace(last_checkpoint=state.step)

    def end_training(self, ctx: TrainerContext, state: TrainState) -> TrainState:
        ext = self.strategy.extended
        ext.worker_done()
        if not self.local:
            self._wait_for_workers(ext)
        return self.current_state(ctx, state)

    def _wait_for_workers(self, ext: Any) -> None:
        """Marks this worker done; the chief waits for the others while they make progress."""
        ext.mark_done(self.worker_index)
        if not self.is_chief:
            return
        missing = ext.wait_for_workers(self.num_workers)
        if missing:
            print(f"[ps] chief: worker(s) {', '.join(map(str, missing))} made no progress for "
                  f"{ext.timeout:.0f} s and did not finish; evaluating without them",
                  flush=True)


def replica_gradients(ms: Any, params: Any, rest: Any, rngs: Any, x: Any, y: Any, w: Any, *,
                      loss_fn: Any, global_batch_size: int, step: Any, replica: Any,
                      compute_dtype: Any, metric_sums: Any) -> tuple[Any, Any]:
    """One replica's share of a parameter-server step (between-graph and coordinator alike).

    Differentiates the loss w.r.t. this replica's view of ``params`` (``ctx.local``), sums the
    gradients over the local replicas, and returns ``(stats, grads)`` with the step statistics
    summed over the replicas: ``loss``, ``correct`` and ``weight`` (the accuracy is unweighted,
    as Keras) plus ``metric_sums(logits, y, w)`` (the synchronous trainer's metric sums).

    Example:
        >>> stats, grads = replica_gradients(  # doctest: +SKIP
        ...     ms, params, rest, rngs, x, y, w, loss_fn=loss_fn,
        ...     global_batch_size=64, step=step, replica=0, compute_dtype=None,
        ...     metric_sums=lambda logits, y, w: {})
    """
    from jaxdist._src.train.losses import correct_per_example

    ctx = get_replica_context()

    def objective(p):
        logits, _ = ms.apply(p, rest, x, training=True, step=step, replica_id=replica,
                             compute_dtype=compute_dtype, rngs=rngs)
        loss = compute_average_loss(loss_fn(logits, y), sample_weight=w,
                                               global_batch_size=global_batch_size)
        return loss, logits

    (loss, logits), grads = jax.value_and_grad(objective, has_aux=True)(ctx.local(params))
    grads = ctx.all_reduce("SUM", grads)
    stats = {"loss": loss, "correct": jnp.sum(correct_per_example(logits, y)),
             "weight": jnp.float32(y.shape[0])}
    stats.update(metric_sums(logits, y, w))
    return ctx.all_reduce("SUM", stats), grads


def _make_grad_replica(ctx: TrainerContext):
    """The per-replica step: loss, gradient (all-reduced over local replicas), stats."""
    gbs, loss_fn, ms = ctx.global_batch_size, ctx.loss_fn, ctx.model_state
    dtype, num_replicas = ctx.compute_dtype, ctx.strategy.num_replicas_in_sync
    per = gbs // num_replicas

    def grad_replica(params, rest, rngs, x, y, w, i, step, worker):
        rctx = get_replica_context()
        part = lambda a: lax.dynamic_slice_in_dim(a, i * per, per)  # noqa: E731
        xb, yb, wb = jax.tree.map(part, x), part(y), part(w)
        replica = worker * num_replicas + rctx.replica_id_in_sync_group

        return replica_gradients(
            ms, params, rest, rngs, xb, yb, wb, loss_fn=loss_fn, global_batch_size=gbs,
            step=step, replica=replica, compute_dtype=dtype,
            metric_sums=lambda logits, y_, w_: ctx.metric_stats(logits, y_, None, w_))

    return grad_replica


__all__ = ["COLLECTION", "ParameterServerHook"]
