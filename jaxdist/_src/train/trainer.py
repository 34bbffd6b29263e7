"""``Trainer``: Keras' ``Model.fit`` / ``evaluate`` / ``predict`` for a flax nnx model under any
strategy.

Each global batch is split across the replicas (``experimental_distribute_dataset``); each
replica computes the gradient of ``compute_average_loss(per_example_loss, global_batch_size)``
on its rows, and the gradients are summed with the strategy's cross-device op
(``ReplicaContext.all_reduce``), so a step gives the same result as a single-device step on the
whole global batch. ``steps_per_execution=k`` folds ``k`` steps into one compiled dispatch (a
``lax.scan`` over ``k`` batches inside the replica function).

Example:
    >>> import jax, jaxdist, optax
    >>> from flax import nnx
    >>> import numpy as np
    >>> x, y = np.ones((128, 64), np.float32), np.zeros((128,), np.int32)
    >>> x_val, y_val = x[:64], y[:64]
    >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
    >>> with strategy.scope():
    ...     model = nnx.Linear(64, 10, rngs=nnx.Rngs(0))
    ...     trainer = jaxdist.Trainer(model, optax.adam(1e-3), global_batch_size=64)
    >>> history = trainer.fit((x, y), epochs=2, validation_data=(x_val, y_val), verbose=0)
    >>> trainer.evaluate((x_val, y_val))["accuracy"]
    1.0
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Mapping, Sequence  # noqa: F401
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax

from jaxdist._src.distributed import preemption
from jaxdist._src.input.options import InputOptions
from jaxdist._src.strategies.context import has_strategy
from jaxdist._src.strategies.cross_device_ops import varying_axes
from jaxdist._src.strategies.current import get_replica_context, get_strategy
from jaxdist._src.strategies.losses import compute_average_loss
from jaxdist._src.strategies.one_device import OneDeviceStrategy
from jaxdist._src.strategies.strategy import Strategy
from jaxdist._src.train import callbacks as callbacks_lib
from jaxdist._src.train import data as data_lib
from jaxdist._src.train import inputs as inputs_lib
from jaxdist._src.train import keras_metrics, run_record
from jaxdist._src.train import loop as loop_lib
from jaxdist._src.train import options as options_lib
from jaxdist._src.train.callbacks import History
from jaxdist._src.train.checkpoint import Checkpointer
from jaxdist._src.train.hook_registry import hook_for
from jaxdist._src.train.hooks import PACKED, PACKED_FIELDS
from jaxdist._src.train.loop import NaNLossError
from jaxdist._src.train.losses import (  # noqa: F401 - LOSSES and the losses: public here too
    LOSSES,
    LossFn,
    categorical_crossentropy,
    sparse_categorical_crossentropy,
)
from jaxdist._src.train.losses import correct_per_example as _correct_per_example
from jaxdist._src.train.metrics import MetricsLogger
from jaxdist._src.train.model_state import ModelState, check_batch_norm
from jaxdist._src.train.options import CheckpointConfig, LoggingConfig, TrainConfig
from jaxdist._src.train.precision import compute_dtype
from jaxdist._src.train.state import TrainerContext, TrainState
from jaxdist._src.train.trainer_handle import FitStatus, TrainerHandle
from jaxdist._src.values.per_replica import PerReplica

# Input blocks (``Trainer._input_block``): one host-to-device transfer feeds up to this many
# steps, of at most this many bytes (this process's rows).
_BLOCK_STEPS = 32
_BLOCK_BYTES = 16 << 20

# Keras' default batch size (``fit`` on arrays without a batch size anywhere).
_DEFAULT_BATCH_SIZE = 32


__all__ = ["History", "LOSSES", "NaNLossError", "Trainer"]  # History: jaxdist._src.train.callbacks


def _default_strategy() -> Strategy:
    if has_strategy():
        return get_strategy()
    return OneDeviceStrategy(jax.local_devices()[0])


def _state_property(name: str, doc: str) -> property:
    """A ``Trainer`` attribute that reads one field of its ``TrainState`` (read only: the one
    setter is ``train_state``)."""

    def get(self: Trainer) -> Any:
        return getattr(self._state, name)

    def set_(self: Trainer, value: Any) -> None:
        raise AttributeError(
            f"Trainer.{name} is a field of trainer.train_state and cannot be assigned alone; "
            f"expected trainer.train_state = trainer.train_state.replace({name}=...)")

    return property(get, set_, doc=doc + " (Read only: set ``train_state``.)")


def _option(group: str, field: str) -> property:
    """A ``Trainer`` attribute that reads one field of a config group (read only: the group
    is replaced as a whole, e.g. by ``replace_checkpoint_config``)."""

    def get(self: Trainer) -> Any:
        return getattr(getattr(self, group), field)

    def set_(self: Trainer, value: Any) -> None:
        raise AttributeError(
            f"Trainer.{name} is read from trainer.{group}.{field} and cannot be assigned "
            f"({value!r}); expected a new config group, e.g. trainer.replace_checkpoint_config("
            f"dataclasses.replace(trainer.checkpoint_config, dir=...))")

    name = {"config": field}.get(group, {
        "checkpoint_config": {"dir": "checkpoint_dir", "every_steps": "checkpoint_every_steps",
                              "keep": "keep_checkpoints"},
        "logging_config": {"dir": "log_dir", "every_steps": "log_every_steps"},
    }.get(group, {}).get(field, field))
    return property(get, set_, doc=f"``{group}.{field}`` (read only).")


def _call_batch_size(batch_size: Any, method: str) -> int | None:
    """``evaluate``/``predict``'s ``batch_size`` argument, checked (``None``: not given)."""
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or (
            batch_size < 1):
        raise ValueError(f"{method}(batch_size=...) must be a positive integer, got "
                         f"{batch_size!r}")
    return int(batch_size)


class Trainer(TrainerHandle):
    """Trains a flax nnx model with an optax optimizer under a distribution strategy.

    Args:
        model: a flax ``nnx.Module`` mapping a batch of examples to logits. Its ``nnx.Param``
            variables are trained; its other variables are carried along unchanged.
        optimizer: an ``optax.GradientTransformation``.
        loss: a name in ``LOSSES`` or ``fn(logits, labels) -> per-example loss``.
        strategy: the strategy (default: the current ``strategy.scope()``, else one device).
        config: a ``TrainConfig``: ``global_batch_size`` (examples per step over all
            replicas; ``None``: ``fit``'s ``batch_size``, an already batched dataset's batch
            size, else 32), ``steps_per_execution``, ``seed``, ``shuffle``, ``precision``,
            ``batch_norm``, ``halt_on_nan``, ``metrics``, ``weighted_metrics``, ``accuracy``.
        checkpoint: a ``CheckpointConfig``: ``dir`` (``fit`` resumes from the latest
            checkpoint there, TF's ``BackupAndRestore``), ``every_steps``, ``keep``,
            ``resume``.
        logging: a ``LoggingConfig``: ``dir`` (the parent of this run's own new
            ``<dir>/<timestamp>`` or ``<dir>/<run_name>`` with ``metrics.jsonl`` and
            TensorBoard events; ``trainer.run_dir`` names it), ``run_name``, ``every_steps``,
            ``tensorboard``, ``progress_bar``.
        **options: the groups' fields by name instead (``global_batch_size=``,
            ``steps_per_execution=``, ``checkpoint_dir=``, ``checkpoint_every_steps=``,
            ``keep_checkpoints=``, ``resume=``, ``log_dir=``, ``log_every_steps=``, ...:
            ``jaxdist._src.train.options.FLAT_NAMES``), for a group not given.

    ``metrics`` are Keras metrics, e.g. ``["accuracy", "auc",
    SparseTopKCategoricalAccuracy(k=3)]``, summed over replicas, processes and steps before
    dividing; as in Keras they are *not* weighted by ``sample_weight``/``class_weight`` (only
    the loss is); ``weighted_metrics`` are (a name already in ``metrics`` is logged as
    ``weighted_<name>``). ``batch_norm="sync"``: ``BatchNorm`` layers normalize with the
    statistics of the whole global batch (TF's ``SyncBatchNormalization``; a step equals a
    one-device step on the global batch); ``"per_replica"``: each replica's own rows. The
    running statistics are averaged across replicas either way. Parameter-server strategies
    support neither (they keep only ``nnx.Param`` variables). ``precision="bfloat16"`` is
    Keras' ``mixed_bfloat16`` (compute in bfloat16, parameters and optimizer state in
    float32, no loss scaling).

    Dropout (and any layer with a ``deterministic`` attribute) is on in ``fit`` with keys that
    differ per replica and per step and are fixed by the model's ``nnx.Rngs`` seed; it is off
    in ``evaluate`` and ``predict``.

    The training state is one ``TrainState`` (``trainer.train_state``); the strategy's
    ``TrainerHook`` takes it and returns the new one (``jaxdist._src.train.hooks``).

    Raises:
        ValueError: ``global_batch_size`` does not divide across the replicas.
        TypeError: an unknown keyword argument (the message names the option it may mean).

    Example:
        >>> import jaxdist, optax
        >>> import numpy as np
        >>> from flax import nnx
        >>> from jaxdist.train import TrainConfig
        >>> model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
        >>> x, y = np.ones((64, 4), np.float32), np.zeros((64,), np.int32)
        >>> trainer = jaxdist.Trainer(model, optax.sgd(0.1), strategy=jaxdist.MirroredStrategy(),
        ...                           config=TrainConfig(global_batch_size=32))
        >>> history = trainer.fit((x, y), steps=4, verbose=0)
    """

    params = _state_property("params", "The model's ``nnx.Param`` variables.")
    rest = _state_property("rest", "The model's other variables (e.g. BatchNorm statistics).")
    opt_state = _state_property("opt_state", "The optimizer state (``None`` on a ps).")
    step = _state_property("step", "Steps run so far.")
    epoch = _state_property("epoch", "The current epoch.")
    step_in_epoch = _state_property("step_in_epoch", "Steps of the current epoch run so far.")
    last_checkpoint = _state_property("last_checkpoint",
                                      "The step of the last checkpoint written or restored.")
    steps_per_execution = _option("config", "steps_per_execution")
    seed = _option("config", "seed")
    shuffle = _option("config", "shuffle")
    precision = _option("config", "precision")
    batch_norm = _option("config", "batch_norm")
    halt_on_nan = _option("config", "halt_on_nan")
    checkpoint_dir = _option("checkpoint_config", "dir")
    checkpoint_every_steps = _option("checkpoint_config", "every_steps")
    keep_checkpoints = _option("checkpoint_config", "keep")
    resume = _option("checkpoint_config", "resume")
    log_dir = _option("logging_config", "dir")
    run_name = _option("logging_config", "run_name")
    log_every_steps = _option("logging_config", "every_steps")
    tensorboard = _option("logging_config", "tensorboard")
    progress_bar = _option("logging_config", "progress_bar")

    def __init__(
        self,
        model: nnx.Module,
        optimizer: optax.GradientTransformation,
        loss: str | LossFn = "sparse_categorical_crossentropy",
        *,
        strategy: Strategy | None = None,
        config: TrainConfig | None = None,
        checkpoint: CheckpointConfig | None = None,
        logging: LoggingConfig | None = None,
        **options: Any,
    ):
        config, checkpoint, logging = options_lib.resolve(config, checkpoint, logging, options)
        if config.steps_per_execution < 1:
            raise ValueError(f"steps_per_execution must be >= 1, got "
                             f"{config.steps_per_execution}")
        check_batch_norm(config.batch_norm)
        self._compute_dtype = compute_dtype(config.precision)
        # The options, as given: read where used, never copied into loose attributes. The
        # global batch size (set by fit(batch_size=...)) and the checkpointing (replaced by
        # replace_checkpoint_config) change by replacing the whole group.
        self.config: TrainConfig = dataclasses.replace(config, global_batch_size=None)
        self.checkpoint_config: CheckpointConfig = checkpoint
        self.logging_config: LoggingConfig = logging
        self.strategy = strategy or _default_strategy()
        if isinstance(loss, str):
            if loss not in LOSSES:
                raise ValueError(f"loss={loss!r} is not known; expected one of "
                                 f"{sorted(LOSSES)} or a function (logits, labels) -> "
                                 f"per-example loss")
            loss = LOSSES[loss]
        self.loss_fn: LossFn = loss
        self.optimizer = optimizer
        self._metrics = keras_metrics.MetricSetup.from_config(config)
        self._status = FitStatus()

        ext = self.strategy.extended
        self.should_checkpoint = bool(getattr(ext, "should_checkpoint", True))
        self.should_save_summary = bool(getattr(ext, "should_save_summary", True))
        devices = list(ext.worker_devices)
        me = jax.process_index()
        self._local_replicas = [i for i, d in enumerate(devices) if d.process_index == me]
        # The replicas of this process's ``strategy.run`` (its mesh, every process of a
        # multi-worker one): what the distributed dataset splits a batch over. With a
        # ClusterCoordinator ``num_replicas_in_sync`` is the workers' count, while the chief
        # evaluates and predicts on its own devices.
        self._mesh_replicas = int(getattr(ext, "num_replicas_in_mesh",
                                          self.strategy.num_replicas_in_sync))
        self._ms = ModelState.split(model)
        self._graphdef = self._ms.graphdef
        self._train_replica: Callable | None = None
        if config.global_batch_size is not None:
            self._set_batch_size(config.global_batch_size)
        with self.strategy.scope():
            self._rngs = self.strategy.place(self._ms.rngs)
        self._checkpointer: Checkpointer | None = None
        # The one hook of this strategy (chosen here, once): where the state lives, one step.
        self._hook = hook_for(self.strategy)
        self._state: TrainState = self._hook.init_state(self.context, self._ms.params,
                                                        self._ms.rest)
        self._resumed = False
        self._preemption: preemption.PreemptionWatcher | None = None
        self._dispatch_timer: preemption.DispatchTimer | None = None
        self._run_record: run_record.RunRecord | None = None   # the settings of checkpoints
        self._data_position: dict[str, Any] | None = None   # a stream's, for checkpoints
        self._restored_position: dict[str, Any] | None = None
        # One function object each, so strategy.run reuses its compiled steps.
        self._eval_replica = self._make_eval_replica()
        self._predict_replica = self._make_predict_replica()

    # ------------------------------------------------------------------ state and context
    @property
    def train_state(self) -> TrainState:
        """The training state (``TrainState``: parameters, other variables, optimizer state,
        position); settable."""
        return self._state

    @train_state.setter
    def train_state(self, state: TrainState) -> None:
        if not isinstance(state, TrainState):
            raise TypeError(f"train_state must be a TrainState, got {type(state).__name__}")
        self._state = state

    # ------------------------------------------------------------------ options
    @property
    def metrics(self) -> list[Any]:
        """The Keras metrics computed besides the loss and the accuracy."""
        return list(self._metrics.metrics)

    @property
    def weighted_metrics(self) -> list[Any]:
        """Keras' ``weighted_metrics``."""
        return list(self._metrics.weighted_metrics)

    @property
    def accuracy(self) -> bool:
        """Whether the accuracy is computed (``metrics`` names it, or ``accuracy=True``)."""
        return self._metrics.accuracy

    def replace_checkpoint_config(self, checkpoint: CheckpointConfig) -> None:
        """Makes ``checkpoint`` the trainer's checkpoint options: the one way to change them
        (``BackupAndRestore`` returns its new ``CheckpointConfig``, built with
        ``dataclasses.replace``, and ``fit`` passes it here). A new directory gets its own
        ``Checkpointer`` and settings record.

        Raises:
            TypeError: ``checkpoint`` is not a ``CheckpointConfig``.

        Example:
            >>> import dataclasses, jaxdist, optax
            >>> from flax import nnx
            >>> trainer = jaxdist.Trainer(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1))
            >>> trainer.replace_checkpoint_config(
            ...     dataclasses.replace(trainer.checkpoint_config, every_steps=50))
            >>> trainer.checkpoint_every_steps
            50
        """
        if not isinstance(checkpoint, CheckpointConfig):
            raise TypeError(f"replace_checkpoint_config takes a jaxdist.train.CheckpointConfig, "
                            f"got {type(checkpoint).__name__}: {checkpoint!r}")
        if checkpoint.dir != self.checkpoint_config.dir:
            self.close_checkpointer()
            self._run_record = None
        self.checkpoint_config = checkpoint

    @property
    def context(self) -> TrainerContext:
        """What the strategy's ``TrainerHook`` reads besides the state (``TrainerContext``)."""
        return TrainerContext(
            strategy=self.strategy, optimizer=self.optimizer, loss_fn=self.loss_fn,
            global_batch_size=self.global_batch_size, seed=self.seed, shuffle=self.shuffle,
            checkpoint_dir=self.checkpoint_dir, keep_checkpoints=self.keep_checkpoints,
            should_checkpoint=self.should_checkpoint, batch_norm=self.batch_norm,
            model_state=self._ms, compute_dtype=self._compute_dtype,
            metric_specs=tuple(self._metrics.specs), rngs=self._rngs,
            train_replica=self._train_replica, checkpointer=self._checkpointer_or_none)

    @property
    def global_batch_size(self) -> int | None:
        """Examples per step over all replicas (``config.global_batch_size``; ``None`` until a
        constructor argument or the first ``fit``/``evaluate``/``predict`` sets it)."""
        return self.config.global_batch_size

    @global_batch_size.setter
    def global_batch_size(self, value: int) -> None:
        self._set_batch_size(value)

    def _set_batch_size(self, value: Any) -> None:
        """Sets the global batch size (checked against the replicas); a new size gets its own
        compiled step."""
        n = self.strategy.num_replicas_in_sync
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1 \
                or value % n:
            raise ValueError(
                f"global_batch_size={value!r} does not divide across the {n} replicas "
                f"of {self.strategy!r}; expected a positive multiple of {n}")
        value = int(value)
        if value != self.config.global_batch_size:
            self.config = dataclasses.replace(self.config, global_batch_size=value)
            self._train_replica = self._make_train_replica()

    def _batch_size_for(self, data: Any, batch_size: int | None, what: str) -> int:
        """The global batch size for ``data``: ``batch_size`` if given (it becomes the
        trainer's), else the trainer's, else an already batched stream's batch size, else 32
        (Keras' default)."""
        if batch_size is not None:
            self._set_batch_size(batch_size)
        elif self.config.global_batch_size is None:
            rows = data.rows_per_element() if isinstance(data, inputs_lib.StreamSource) else 1
            if rows <= 1:  # arrays, or a stream of single examples: Keras' default
                self._set_batch_size(_DEFAULT_BATCH_SIZE)
                return self.config.global_batch_size
            try:
                self._set_batch_size(rows)
            except ValueError as e:
                raise ValueError(f"{what}: its batches of {rows} rows set the global batch "
                                 f"size, but {e}; pass batch_size=... (or re-batch the data)"
                                 ) from None
        return self.config.global_batch_size

    # ------------------------------------------------------------------ replica functions
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
                rest = _mean_where_varying(ctx, new_rest)
                updates, opt_state = tx.update(grads, opt_state, params)
                params = optax.apply_updates(params, updates)
                # accuracy, as Keras' `metrics`, is not weighted (every training row is real)
                stats = {"loss": loss, "correct": jnp.sum(_correct_per_example(logits, yb)),
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
                "correct": jnp.sum(_correct_per_example(logits, y) * mask),  # unweighted
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

    # ------------------------------------------------------------------ public API
    @property
    def model(self) -> nnx.Module:
        """The model with the current parameters and state (e.g. BatchNorm statistics)."""
        return self._ms.merge(self._current_params(), self.rest)

    @property
    def state(self) -> dict[str, Any]:
        """The checkpointed variables: ``{"params", "rest", "opt_state"}``."""
        return {"params": self.params, "rest": self.rest, "opt_state": self.opt_state}

    def fit(self, train_data: Any, epochs: int | None = None, steps: int | None = None,
            validation_data: Any = None, validation_freq: int = 1, *, y: Any = None,
            batch_size: int | None = None, sample_weight: Any = None,
            class_weight: Mapping[int, float] | None = None,
            validation_split: float = 0.0, steps_per_epoch: int | None = None,
            callbacks: Sequence[callbacks_lib.Callback] | None = None,
            verbose: int | str = "auto") -> History:
        """Trains for ``epochs`` passes over ``train_data`` (or exactly ``steps`` steps).

        With a ``checkpoint_dir``, training resumes from the latest checkpoint there: the
        model, optimizer state, step and data position are restored, and the counts include
        the steps already done (as with TF's ``BackupAndRestore``).

        Args:
            train_data: arrays ``(x, y)`` / ``(x, y, sample_weight)`` / ``{"x", "y"}`` (``x`` an
                array or a dict of feature arrays), or features with ``y=``; or a stream of
                batches: a ``jaxdist.Dataset``, a grain dataset, a ``tf.data.Dataset``, a
                generator or any iterable (see ``jaxdist._src.train.inputs``).
            epochs: number of epochs (default 1 when ``steps`` is not given).
            steps: total number of steps, instead of ``epochs``.
            validation_data: data (arrays or a stream) evaluated every ``validation_freq``
                epochs and at the end.
            validation_freq: validate every this many epochs (0: only at the end).
            y: labels, when ``train_data`` is only the features.
            batch_size: examples per step over all replicas (Keras' ``batch_size``); it
                becomes the trainer's ``global_batch_size``. Default: the trainer's, else an
                already batched stream's batch size, else 32.
            sample_weight: per-example weights of the loss and the metrics.
            class_weight: ``{class: weight}``; multiplies the sample weights by the weight of
                each example's label.
            validation_split: hold out this last fraction of array data (before shuffling, as
                Keras) for validation.
            steps_per_epoch: steps per epoch (needed for a stream without a length).
            callbacks: Keras callbacks (``jaxdist._src.train.callbacks``); ``BackupAndRestore``
                takes the place of ``checkpoint_dir``.
            verbose: 0 silent, 1 progress bar (log lines when not on a terminal), 2 one line
                per epoch; ``"auto"``: 1.

        Returns:
            A ``History`` (Keras' ``history.history``, ``epoch``, ``params``).

        Raises:
            DataError: the data does not fit the model or the batch size.
            NaNLossError: ``halt_on_nan`` and the loss became NaN or inf.
        """
        train = inputs_lib.source(train_data, y, sample_weight, class_weight, "train_data")
        if validation_split:
            if not isinstance(train, data_lib.ArrayData):
                raise data_lib.DataError(
                    f"validation_split works with array data only (as in Keras), not a "
                    f"{train.name}; pass validation_data instead")
            if validation_data is not None:
                raise data_lib.DataError("pass validation_split or validation_data, not both")
            train, validation_data = inputs_lib.split_last(train, validation_split)
        val = None if validation_data is None else inputs_lib.source(
            validation_data, what="validation_data")
        stream = isinstance(train, inputs_lib.StreamSource)
        b = self._batch_size_for(train, batch_size, "train_data")
        # e.g. refuses input its workers cannot read
        self._hook.begin_fit(self.context, self._state, train)
        if stream and not self._hook.accepts_streams:
            raise data_lib.DataError(
                f"{type(self.strategy).__name__} trains on in-memory arrays (each worker takes "
                f"its share of every epoch); got a {train.name}: pass (x, y) arrays")
        if stream:
            spe = self._hook.stream_steps_per_epoch(self.context, train, steps_per_epoch)
            if spe is None:
                spe = self._stream_steps_per_epoch(train, steps_per_epoch, steps)
        else:
            spe = data_lib.steps_per_epoch(len(self._epoch_order(len(train), 0)), b)
            if steps_per_epoch is not None:
                spe = min(spe, int(steps_per_epoch))
        if spe == 0:
            raise data_lib.DataError(f"train_data has {len(train)} examples, fewer than one "
                                     f"global batch of {b}")
        self._check_shapes(self._example(train), "train_data")
        if val is not None:
            self._check_shapes(self._example(val), "validation_data")
        if not self._hook.should_evaluate:
            val = None
        if steps is None:
            total = (epochs if epochs is not None else 1) * spe
        else:
            total = steps
        verbose = _verbose(verbose)
        history = History()
        num_epochs = epochs if steps is None and epochs is not None else -(-total // spe)
        cbs = self._callback_list(callbacks, history, {"epochs": num_epochs, "steps": spe,
                                                       "verbose": verbose})
        notes = self._maybe_resume(spe)
        if notes is not None:  # restored a checkpoint: count the epochs from its position
            if steps is None:
                total = self.step + max(0, (num_epochs - self.epoch) * spe - self.step_in_epoch)
            if self.step >= total and not self.checkpoint_config.allow_finished:
                raise run_record.TrainingCompleteError(run_record.finished_message(
                    self._run_record.directory, self.step, num_epochs, steps))
        logger = MetricsLogger(
            self.run_dir, total_steps=total, initial_step=self.step,
            tensorboard=self.tensorboard, progress_bar=self.progress_bar,
            enabled=self.should_save_summary, verbose=verbose, per_epoch_bar=True,
        )
        logger.message(self.describe_run())
        if self.last_checkpoint is not None and self.step > 0:
            logger.message(f"Resumed from checkpoint at step {self.step} (epoch {self.epoch}, "
                           f"step {self.step_in_epoch} of {spe}) in {self.checkpoint_dir}")
        for note in notes or ():
            logger.message(f"Note: {note}")
        self._status = FitStatus()   # stop_training is False again
        # With checkpoints, a preemption notice stops every process at one step, the chief
        # saves it and every process exits with the restart code (distributed.preemption).
        self._preemption = (preemption.install(self.checkpoint_config.termination)
                            if self.checkpoint_dir is not None else None)
        self._dispatch_timer = (preemption.DispatchTimer(self._preemption.config)
                                if self._preemption is not None else None)
        try:
            with (self._preemption.consume() if self._preemption is not None
                  else contextlib.nullcontext()):
                self._fit_loop(train, val, total, spe, validation_freq, logger, history, cbs,
                               num_epochs)
        except BaseException:
            self._status.failed = True
            raise
        finally:
            logger.close()
        return history

    def _callback_list(self, callbacks: Any, history: History,
                       params: dict[str, Any]) -> callbacks_lib.CallbackList:
        """The fit's callbacks (``BackupAndRestore`` configures checkpointing first)."""
        callbacks = list(callbacks or ())
        for cb in callbacks:
            if isinstance(cb, callbacks_lib.BackupAndRestore):
                self.replace_checkpoint_config(cb.checkpoint_config(self.checkpoint_config))
        history.params = params
        return callbacks_lib.CallbackList([*callbacks, history], model=self,
                                          is_chief=self.should_save_summary, params=params)

    @callbacks_lib.with_callbacks("test")
    def evaluate(self, data: Any, y: Any = None, sample_weight: Any = None,
                 batch_size: int | None = None,
                 callback_list: Any = None) -> dict[str, float]:
        """Mean loss and accuracy over every example of ``data`` (arrays or a stream, as in
        ``fit``). With sample weights, the loss is ``sum(w * loss) / examples`` (Keras); the
        ``metrics`` (accuracy included) are not weighted, the ``weighted_metrics`` are
        (``sum(w * hit) / sum(w)``), as in Keras.

        ``batch_size`` (Keras' argument): rows per evaluation batch for this call only
        (default: the trainer's ``global_batch_size``); the results do not depend on it.

        ``callbacks=[...]`` get ``on_test_begin``, ``on_test_batch_begin(i)`` and
        ``on_test_batch_end(i, logs)`` for every global batch ``i`` (``logs``: the results
        over the batches so far, as Keras), and ``on_test_end(results)``; ``fit`` calls the
        same hooks of its callbacks when it validates."""
        d = inputs_lib.source(data, y, sample_weight, what="evaluate data")
        batch_size = _call_batch_size(batch_size, "evaluate")
        if batch_size is None:
            self._batch_size_for(d, None, "evaluate data")
        self._check_shapes(self._example(d), "evaluate data")
        totals: list[Any] = []
        params = self._current_params()
        cbs = callback_list
        batch_logs = cbs is not None and cbs.overrides("on_test_batch_end")
        batches = self._distribute(self._eval_chunks(d, labels=True, batch_size=batch_size))
        for i, (xb, yb, wb, mb) in enumerate(batches):
            if cbs is not None:
                cbs.on_test_batch_begin(i)
            with _inline_on_coordinator(self.strategy):
                totals.append(self.strategy.run(
                    self._eval_replica, args=(params, self.rest, self._rngs, xb, yb, wb, mb)))
            if cbs is not None:
                cbs.on_test_batch_end(i, self._eval_results(jax.device_get(totals))
                                      if batch_logs else {})
        out = self._eval_results(jax.device_get(totals))
        if out is None:
            raise data_lib.DataError("evaluate data has no examples")
        return out

    def _eval_results(self, fetched: Sequence[Any]) -> dict[str, float] | None:
        """Loss, accuracy and metrics from fetched evaluation sums (``None``: no examples)."""
        count = sum(float(t["count"]) for t in fetched)
        if count == 0:
            return None
        loss = sum(float(t["loss"]) for t in fetched)
        correct = sum(float(t["correct"]) for t in fetched)
        weight = sum(float(t["weight"]) for t in fetched)
        out = {"loss": loss / count}
        if self.accuracy:
            out["accuracy"] = correct / weight if weight else 0.0
        out.update(self._metric_results([t.get("metrics") for t in fetched]))
        return out

    def _metric_results(self, sums: Sequence[Any]) -> dict[str, float]:
        """Each metric's value from the summed stats of several dispatches (host arrays)."""
        sums = [s for s in sums if s is not None]
        if not self._metrics.specs or not sums:
            return {}
        total = jax.tree.map(lambda *xs: sum(np.asarray(x, np.float64) for x in xs), *sums)
        return {name: m.result(total[name]) for name, m, _ in self._metrics.specs}

    @callbacks_lib.with_callbacks("predict")
    def predict(self, x: Any, batch_size: int | None = None,
                callback_list: Any = None) -> np.ndarray:
        """The model's outputs for every row of ``x`` (an array, a dict of feature arrays or a
        stream of batches; labels in it are ignored), batched by ``batch_size`` (Keras'
        argument, for this call only; default: the trainer's ``global_batch_size``).

        ``callbacks=[...]`` get ``on_predict_begin``, ``on_predict_batch_begin(i)`` and
        ``on_predict_batch_end(i, {"outputs": the batch's outputs})`` for every global batch
        ``i`` (padding rows dropped), and ``on_predict_end({"outputs": all outputs})``."""
        if isinstance(x, data_lib.ArrayData) or inputs_lib.is_features(x):
            feats = x.x if isinstance(x, data_lib.ArrayData) else x
            first = next(iter(feats.values())) if isinstance(feats, Mapping) else feats
            d: Any = data_lib.ArrayData(feats, np.zeros((np.shape(first)[0],), np.int32))
        else:
            d = inputs_lib.StreamSource(x, "predict data")
        batch_size = _call_batch_size(batch_size, "predict")
        if batch_size is None:
            self._batch_size_for(d, None, "predict data")
        outs, n = [], 0
        params = self._current_params()
        cbs = callback_list
        chunks = self._eval_chunks(d, labels=False, batch_size=batch_size)
        for i, (xb, mb) in enumerate(self._distribute(chunks)):
            if cbs is not None:
                cbs.on_predict_batch_begin(i)
            with _inline_on_coordinator(self.strategy):
                out = self.strategy.run(self._predict_replica,
                                        args=(params, self.rest, self._rngs, xb))
            mask = np.asarray(self.strategy.gather(mb, axis=0)) > 0
            outs.append(np.asarray(self.strategy.gather(out, axis=0))[mask])
            n += int(mask.sum())
            if cbs is not None:
                cbs.on_predict_batch_end(i, {"outputs": outs[-1]})
        if not outs:
            return np.zeros((0,), np.float32)
        return np.concatenate(outs)[:n]

    def experimental_compile(self, x: Any, y: Any) -> Any:
        """Compiles one training dispatch (``steps_per_execution`` steps of
        ``global_batch_size`` rows) for the strategy's devices, without running it.

        With a compile-only ``TPUStrategy(topology="v5e:2x2")`` this is the step ``fit`` would
        run on that TPU, compiled by the TPU compiler on this machine.

        Args:
            x: example features: an array, a dict of arrays or ``jax.ShapeDtypeStruct``s; only
                the shape of one row (``x.shape[1:]``) and the dtype are read.
            y: example labels, read the same way.

        Returns:
            A ``jaxdist.tpu.CompileReport`` (per-device memory and FLOPs).

        Raises:
            NotImplementedError: the strategy does not run the step in this process (a
                parameter-server strategy).

        Example:
            >>> import jaxdist, optax
            >>> from flax import nnx
            >>> import numpy as np
            >>> model = nnx.Linear(784, 10, rngs=nnx.Rngs(0))
            >>> x_train, y_train = np.zeros((512, 784), np.float32), np.zeros((512,), np.int32)
            >>> strategy = jaxdist.TPUStrategy(topology="v5e:2x2")  # doctest: +NEEDS_LIBTPU
            >>> with strategy.scope():
            ...     trainer = jaxdist.Trainer(model, optax.adam(1e-3), global_batch_size=128,
            ...                               strategy=strategy)
            >>> print(trainer.experimental_compile(x_train, y_train))
            Trainer step (1 step(s) of 128 rows) compiled for TPU v5 lite v5e:2x2 (4 chips, ...)
            per chip: memory ...
        """
        from jaxdist._src.strategies.compile_report import compile_run
        from jaxdist._src.train.hooks import SyncHook

        if not isinstance(self._hook, SyncHook):
            raise NotImplementedError(
                f"experimental_compile compiles the step of a synchronous strategy; "
                f"{type(self.strategy).__name__} runs its steps elsewhere")
        if self.global_batch_size is None:
            raise ValueError("experimental_compile needs the global batch size: pass "
                             "config=TrainConfig(global_batch_size=...) to the Trainer")
        n, k = self._mesh_replicas, self.steps_per_execution
        per = self.global_batch_size // n

        def block(a: Any) -> PerReplica:
            # one input block of one chunk: (replicas, 1, k x rows per replica, *row shape)
            shape = (n, 1, k * per, *tuple(np.shape(a))[1:])
            return PerReplica(jax.ShapeDtypeStruct(shape, np.dtype(a.dtype)))

        xs = jax.tree.map(block, x, is_leaf=lambda v: isinstance(v, jax.ShapeDtypeStruct))
        w = jax.ShapeDtypeStruct((self.global_batch_size,), np.float32)
        args = (self.params, self.rest, self._rngs, self.opt_state, xs, block(y), block(w),
                np.int32(0), np.int32(0))
        return compile_run(self.strategy, self._train_replica, args,
                           what=f"Trainer step ({k} step(s) of {self.global_batch_size} rows)")

    # ------------------------------------------------------------------ internals
    def _check_shapes(self, d: data_lib.ArrayData, what: str) -> None:
        b = self.global_batch_size
        example = jax.tree.map(lambda a: jax.ShapeDtypeStruct((b, *a.shape[1:]), a.dtype), d.x)
        shapes = jax.tree.map(lambda a: tuple(a.shape[1:]), d.x)
        try:
            out = jax.eval_shape(
                lambda p, r, x: self._apply(p, r, x), self.params, self.rest, example
            )
        except Exception as e:  # noqa: BLE001 - any shape error becomes one clear line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise data_lib.DataError(
                f"{what}: the model cannot take examples of shape {shapes}: {first}"
            ) from None
        _check_labels(d.y, out, self.loss_fn, what)
        if self.accuracy and d.y.ndim == 1 and getattr(out, "ndim", 0) == 2:
            bad = (d.y < 0) | (d.y >= out.shape[-1])
            if np.issubdtype(d.y.dtype, np.integer) and bad.any():
                raise data_lib.DataError(
                    f"{what}: label {d.y[bad][0]} is out of range for a model with "
                    f"{out.shape[-1]} outputs; expected labels in [0, {out.shape[-1]})"
                )

    def _example(self, d: Any) -> data_lib.ArrayData:
        """Data to check against the model: array data itself, a stream's first element."""
        if isinstance(d, data_lib.ArrayData):
            return d
        x, y, _ = d.peek()
        if y is None:
            raise data_lib.DataError(f"{d.what}: the {d.name}'s elements have no labels; "
                                     f"expected (x, y) batches or dicts with 'x' and 'y'")
        return data_lib.ArrayData(x, y)

    def _stream_steps_per_epoch(self, train: inputs_lib.StreamSource,
                                steps_per_epoch: int | None, steps: int | None) -> int:
        if steps_per_epoch is not None:
            return int(steps_per_epoch)
        n = train.num_elements()
        if n is None:
            if steps is not None:
                return int(steps)
            raise data_lib.DataError(
                f"train_data is a {train.name} with no known length; pass steps_per_epoch=N "
                f"(or steps=N), as Keras needs for such data")
        return n * train.rows_per_element() // self.global_batch_size

    def _eval_chunks(self, d: Any, labels: bool, batch_size: int | None = None):
        """Global batches of ``d`` (this process's rows), the last padded: ``(x, y, w, mask)``
        or, without ``labels``, ``(x, mask)``; ``batch_size`` rows each (default
        ``global_batch_size``)."""
        b = self.global_batch_size if batch_size is None else batch_size
        if isinstance(d, data_lib.ArrayData):
            batches = data_lib.eval_batches(d, b)
        else:
            batches = (data_lib.pad_batch(x, y if y is not None else
                                          np.zeros((inputs_lib.row_count(x),), np.int32), w, b)
                       for x, y, w in d.batches(b, epoch=0, pad_last=True))
        n = self._mesh_replicas
        eb = -(-b // n) * n  # padded (masked) to a multiple of the mesh's replicas
        for x, y, w, m in batches:
            if labels and isinstance(d, inputs_lib.StreamSource):
                _check_batch_labels(y, d.what, self.loss_fn)
            if eb != b:  # masked zero rows: weight and mask 0, so the sums do not change
                x, y, w, m = jax.tree.map(lambda a: _pad_rows(a, eb), (x, y, w, m))
            rows = functools.partial(self._local_rows, num_steps=1, batch_size=eb)
            if labels:
                yield rows(x), rows(y), rows(w), rows(m)
            else:
                yield rows(x), rows(m)

    def _local_rows(self, x: Any, num_steps: int, batch_size: int | None = None) -> Any:
        """Orders ``num_steps`` global batches so that each local replica gets its rows.

        ``x`` (an array or a dict of arrays) holds ``num_steps`` consecutive global batches of
        ``batch_size`` rows (default ``global_batch_size``). Replica ``r`` of the ``N`` of
        this process's mesh must see rows ``[r*B/N, (r+1)*B/N)`` of every one of them, in step
        order; the distributed dataset splits its input into equal consecutive parts, one per
        local replica.
        """
        if isinstance(x, Mapping):
            return {k: self._local_rows(v, num_steps, batch_size) for k, v in x.items()}
        n = self._mesh_replicas
        b = self.global_batch_size if batch_size is None else batch_size
        if b % n:
            raise ValueError(
                f"a batch of {b} rows does not split across the {n} replicas of this "
                f"process's {type(self.strategy).__name__} mesh; expected a multiple of {n}")
        per = b // n
        x = x.reshape(num_steps, n, per, *x.shape[1:])[:, self._local_replicas]
        x = np.swapaxes(x, 0, 1)
        return x.reshape(len(self._local_replicas) * num_steps * per, *x.shape[3:])

    def _distribute(self, local_batches: Any, options: Any = None) -> Any:
        """Distributes batches that already hold only this process's rows (``_local_rows``).

        The rows are chosen here, so the strategy must not shard them again across processes:
        the dataset is tagged ``AutoShardPolicy.OFF`` (with ``MultiWorkerMirroredStrategy`` the
        default ``AUTO``/``DATA`` would keep 1/P of rows that are already 1/P of a batch).
        """
        from jaxdist._src.input.autoshard import with_auto_shard_policy

        return self.strategy.experimental_distribute_dataset(
            with_auto_shard_policy(local_batches, "OFF"), options=options)

    def _checkpointer_or_none(self) -> Checkpointer | None:
        if self.checkpoint_dir is None:
            return None
        if self._checkpointer is None:
            # Only the chief writes; the other workers read it (to resume) and create nothing.
            self._checkpointer = Checkpointer(self.checkpoint_dir, keep=self.keep_checkpoints,
                                              read_only=not self.should_checkpoint)
        return self._checkpointer

    def _current_params(self) -> Any:
        self.train_state = self._hook.current_state(self.context, self._state)
        return self._state.params

    def _epoch_order(self, num_examples: int, epoch: int) -> np.ndarray:
        # e.g. this worker's share
        return self._hook.epoch_order(self.context, num_examples, epoch)

    def _record(self) -> run_record.RunRecord:
        """The record of the settings written with this trainer's checkpoints (its settings
        as they are now: a later ``fit`` may take another batch size)."""
        ck = self.checkpoint_config
        settings = {**run_record.trainer_settings(
            self.strategy, self.global_batch_size, self.seed, self.shuffle, self.precision,
            self.batch_norm), **(ck.settings or {})}
        if self._run_record is None:
            self._run_record = run_record.RunRecord(
                self.checkpoint_dir, settings, ck.allow_changes, writer=self.should_checkpoint)
        self._run_record.settings = run_record.plain(settings)
        return self._run_record

    def _maybe_resume(self, steps_per_epoch: int) -> list[str] | None:
        """Restores the latest checkpoint (the first ``fit`` only) once its recorded settings
        match (``run_record``); returns note lines, or ``None`` when nothing was restored."""
        if self.checkpoint_dir is None or not self.resume or self._resumed:
            return None
        self._resumed = True  # only the first fit resumes; later calls continue in memory
        record = self._record()
        notes = record.check()   # raises SettingsChangedError before anything is restored
        fresh = self._state.opt_state
        self._state, self._restored_position = self._hook.resume(
            self.context, self._state, steps_per_epoch)
        if self.last_checkpoint is None:
            return None
        if not self._hook.local_state:   # the ps hooks derive the position from the step
            return notes + record.notes_after_restore(self.last_checkpoint)
        self._state, more = record.converted(self._state, self.global_batch_size,
                                             steps_per_epoch, fresh)
        return notes + more + record.notes_after_restore(self.last_checkpoint)

    def save_checkpoint(self) -> None:
        """Writes a checkpoint of the current state and data position (chief only)."""
        if self.checkpoint_dir is not None:
            self.train_state = self._hook.save(self.context, self._state, self._data_position)
            if self.last_checkpoint == self.step:
                self._record().saved(self.step, self.epoch, self.step_in_epoch)

    def _host_chunks(self, train: data_lib.ArrayData, order: np.ndarray,
                     chunks: Sequence[tuple[int, int]]):
        b = self.global_batch_size
        for start, k in chunks:
            part = train.take(order[start * b:(start + k) * b])
            w = np.ones((k * b,), np.float32) if part.w is None else part.w
            yield (self._local_rows(part.x, k), self._local_rows(part.y, k),
                   self._local_rows(w, k))

    def _host_blocks(self, train: data_lib.ArrayData, order: np.ndarray,
                     groups: Sequence[Sequence[tuple[int, int]]], sizes: Mapping[int, int]):
        """Like ``_host_chunks`` for groups of consecutive chunks of ``kk`` steps each: one
        input block per group (``_input_block``), padded to ``sizes[kk]`` chunks so that
        its shape, hence the compiled step, is the same for every group."""
        b = self.global_batch_size
        for group in groups:
            start, kk = group[0]
            part = train.take(order[start * b:(start + len(group) * kk) * b])
            w = np.ones((len(part),), np.float32) if part.w is None else part.w
            yield self._input_block(part.x, part.y, w, kk, sizes[kk])

    def _input_block(self, x: Any, y: Any, w: Any, kk: int, count: int) -> tuple[Any, Any, Any]:
        """``count`` chunks of ``kk`` global batches as one input block ``(x, y, w)``.

        ``x``, ``y``, ``w`` hold the rows of up to ``count`` chunks, in step order (missing
        chunks at the end are zero rows, never run). Each array becomes ``(local replicas x
        count, kk x rows per replica, ...)``: the distributed dataset gives every replica its
        ``(count, kk x rows per replica, ...)`` share, and a dispatch of ``train_replica``
        takes one chunk of it on the device. One transfer then feeds ``count`` dispatches.
        """
        rows = count * kk * self.global_batch_size
        per = self.global_batch_size // self._mesh_replicas
        local = len(self._local_replicas)

        def block(a: Any) -> np.ndarray:
            a = np.asarray(a)
            if a.shape[0] != rows:
                a = _pad_rows(a, rows)
            a = self._local_rows(a, count * kk)
            return a.reshape(local * count, kk * per, *a.shape[1:])

        return jax.tree.map(block, x), block(y), block(w)

    def _block_sizes(self, train: Any, spe: int) -> dict[int, int]:
        """Chunks per input block for chunks of ``k`` and of 1 steps: up to ``_BLOCK_STEPS``
        steps and ``_BLOCK_BYTES`` bytes per block, a power of two no larger than needed for
        an epoch (so one fit compiles at most two programs, as without blocks)."""
        k = self.steps_per_execution
        if not isinstance(train, data_lib.ArrayData):
            return {k: 1, 1: 1}   # a stream: one chunk per block (no reading further ahead)
        row = sum(a.dtype.itemsize * int(np.prod(a.shape[1:]))
                  for a in jax.tree.leaves((train.x, train.y))) + 4  # + the weight
        chunk_bytes = max(1, row * self.global_batch_size)

        def size(kk: int, chunks_needed: int) -> int:
            cap = max(1, min(_BLOCK_STEPS // kk, _BLOCK_BYTES // (kk * chunk_bytes)))
            need = 1 << max(0, int(chunks_needed) - 1).bit_length()  # next power of two
            return max(1, min(cap, need))

        return {k: size(k, spe // k), 1: size(1, spe if k == 1 else k - 1)}

    def _stream_chunks(self, train: inputs_lib.StreamSource, chunks: Sequence[tuple[int, int]],
                       positions: list[Any], ran_out: list[bool], blocks: bool = False):
        """Like ``_host_chunks`` for a stream: ``k`` global batches per chunk; the stream's
        position after each chunk goes to ``positions`` (the distributed dataset reads ahead,
        so the loop takes a position only when it runs the chunk). With ``blocks`` each chunk
        is an input block of one chunk (``_input_block``)."""
        b = self.global_batch_size
        restored = self._restored_position
        self._restored_position = None
        state = None
        if restored and restored.get("epoch") == self.epoch:
            state = restored.get("grain_state")
        it = train.batches(b, self.epoch, skip=chunks[0][0] if chunks else 0, state=state)
        for _, k in chunks:
            got = list(itertools.islice(it, k))
            if len(got) < k:
                ran_out[0] = True
                return
            for _, yb, _ in got:
                _check_batch_labels(yb, train.what, self.loss_fn)
            x = jax.tree.map(lambda *a: np.concatenate(a), *[g[0] for g in got])
            y = np.concatenate([g[1] for g in got])
            w = np.concatenate([np.ones((b,), np.float32) if g[2] is None else g[2]
                                for g in got])
            positions.append(train.position())
            if blocks:
                yield self._input_block(x, y, w, k, 1)
            else:
                yield self._local_rows(x, k), self._local_rows(y, k), self._local_rows(w, k)

    def _epoch_inputs(self, train: Any, order: Any, chunks: Sequence[tuple[int, int]],
                      groups: Sequence[Sequence[tuple[int, int]]], block_sizes: Mapping[int, int],
                      blocks: bool, positions: list[Any], ran_out: list[bool]) -> Any:
        """An epoch's distributed inputs: one ``(x, y, w)`` per group of chunks (``None``s
        when the hook feeds its steps itself). Blocks of up to 32 steps: a thread prepares
        them (a gather of the epoch's rows) while this one dispatches and waits; its hand-off
        costs once per block, not per step."""
        opts = InputOptions(experimental_per_replica_buffer_size=2, prefetch_thread=True)
        if self._hook.owns_input:  # e.g. per-worker datasets
            return ((None, None, None) for _ in groups)
        if isinstance(train, inputs_lib.StreamSource):
            return iter(self._distribute(
                self._stream_chunks(train, chunks, positions, ran_out, blocks), options=opts))
        if blocks:
            return iter(self._distribute(
                self._host_blocks(train, order, groups, block_sizes), options=opts))
        return iter(self._distribute(self._host_chunks(train, order, chunks), options=opts))

    def _run_epoch(self, train: Any, total: int, spe: int, num_epochs: int,
                   runner: loop_lib.StepRunner, reporter: loop_lib.FitReporter, logger: Any,
                   cbs: Any, blocks: bool, block_sizes: Mapping[int, int]) -> bool:
        """Runs the steps of the current epoch up to its end, ``total`` steps or a stop;
        returns whether a stream ran out before the epoch's end."""
        order = (None if isinstance(train, inputs_lib.StreamSource)
                 else self._epoch_order(len(train), self.epoch))
        start = self.step_in_epoch
        cbs.on_epoch_begin(self.epoch)
        logger.begin_epoch(self.epoch, num_epochs, min(spe, start + total - self.step), start)
        chunks, groups = loop_lib.plan_epoch(
            start, min(spe, start + (total - self.step)), self.steps_per_execution,
            blocks=blocks, block_sizes=block_sizes)
        positions: list[Any] = []
        ran_out = [False]
        timer = self._dispatch_timer
        inputs = self._epoch_inputs(train, order, chunks, groups, block_sizes, blocks,
                                    positions, ran_out)
        try:
            for j, (s, kk), (xb, yb, wb) in loop_lib.epoch_steps(groups, inputs):
                if self._preemption is not None and self._preemption.should_stop(self.step, kk):
                    self._status.preempted = True
                    break
                if positions:
                    self._data_position = positions.pop(0)
                reporter.batch_begin(s + kk - 1)
                before = self.step
                if timer is not None:
                    timer.before()
                self.train_state, stats = runner.run(self._state, xb, yb, wb, s, kk, chunk=j)
                if timer is not None and timer.count < 2:
                    timer.after(stats, kk)
                reporter.record(stats, self._state, self.last_checkpoint)
                logger.advance(kk)
                crossed = lambda every: self.step // every > before // every  # noqa: B023
                if crossed(self.log_every_steps) or self.step >= total:
                    reporter.check_nan(self.last_checkpoint)
                    reporter.log_train(self._state)
                if self.checkpoint_dir is not None and crossed(self.checkpoint_every_steps):
                    reporter.check_nan(self.last_checkpoint)
                    self.save_checkpoint()
                reporter.batch_end(s + kk - 1)
                if self.stop_training:
                    break
        finally:
            inputs.close()
        return ran_out[0]

    def _fit_loop(self, train, val, total, spe, validation_freq, logger, history, cbs,
                  num_epochs) -> None:
        """The epochs of ``fit``: the epoch plan and inputs, the step runner, the reporter
        (``jaxdist._src.train.loop``). The state lives in ``self._state`` between steps, so
        callbacks that change it (the learning rate, ``set_weights``) take effect."""
        hook, ctx = self._hook, self.context
        reporter = loop_lib.FitReporter(
            logger, history, cbs, batch_size=ctx.global_batch_size, accuracy=self.accuracy,
            metric_results=self._metric_results, learning_rate=self.current_learning_rate,
            halt_on_nan=self.halt_on_nan, checkpoint_dir=self.checkpoint_dir,
            initial_step=self.step)
        cbs.on_train_begin()
        # With a hook that takes input blocks, consecutive chunks of the same length share
        # one block (one host-to-device transfer for several dispatches).
        blocks = hook.input_blocks and not hook.owns_input
        block_sizes = self._block_sizes(train, spe)
        runner = loop_lib.StepRunner(hook, ctx, spe, blocks)

        def validate() -> dict[str, float]:
            return reporter.validate(
                self._state, lambda callbacks: self.evaluate(val, callback_list=callbacks),
                lambda: hook.state_version(self.context, self._state))

        while self.step < total and not self.stop_training:
            epoch_start_time = time.perf_counter()
            ran_out = self._run_epoch(train, total, spe, num_epochs, runner, reporter, logger,
                                      cbs, blocks, block_sizes)
            if self._status.preempted:
                reporter.log_train(self._state)
                saved = self.checkpoint_dir is None or self.last_checkpoint == self.step
                self._preemption.finish(self.step, (lambda: None) if saved
                                        else self.save_checkpoint,
                                        is_chief=self.should_checkpoint)
                self.stop_training = True  # a custom exit_fn returned: fit stops here
                return
            if ran_out:  # a stream ended before the epoch length it announced
                if self.step_in_epoch == 0 and not reporter.epoch_stats:
                    raise data_lib.DataError(
                        f"train_data ran out of data at step {self.step} (epoch "
                        f"{self.epoch}); pass a repeating dataset or fewer steps/epochs")
                if total != self.step and self.step_in_epoch < spe:
                    total -= spe - self.step_in_epoch   # the epoch was shorter: as many epochs
                    spe = runner.steps_per_epoch = self.step_in_epoch
                self.train_state = self._state.replace(epoch=self.epoch + 1, step_in_epoch=0)
            reporter.check_nan(self.last_checkpoint)
            if self.step_in_epoch == 0 or self.stop_training:  # the epoch ended
                logs = reporter.epoch_logs()
                if logs is not None:
                    if val is not None and validation_freq and self.epoch % validation_freq == 0:
                        logs.update({f"val_{k}": v for k, v in validate().items()})
                    ended = self.epoch - 1 if self.step_in_epoch == 0 else self.epoch
                    reporter.end_epoch(ended, num_epochs, logs,
                                       time.perf_counter() - epoch_start_time)
        self.train_state = hook.end_training(self.context, self._state)
        reporter.log_train(self._state)
        if self.checkpoint_dir is not None and self.last_checkpoint != self.step:
            self.save_checkpoint()
        # With parameter servers, other workers may push after this task's last validation.
        changed = hook.state_version(self.context, self._state) != reporter.last_val_version
        if val is not None and (reporter.last_val_step != self.step or changed):
            history.add("val_", validate())
        end = reporter.end(self._state, val is not None)
        hook.end_fit(self.context, self._state)
        cbs.on_train_end(end)

def _verbose(verbose: int | str) -> int:
    if verbose == "auto":
        return 1
    if verbose not in (0, 1, 2) or isinstance(verbose, bool):
        raise ValueError(f"verbose={verbose!r} is not valid; expected 0 (silent), 1 (progress "
                         f"bar), 2 (one line per epoch) or 'auto'")
    return int(verbose)


def _mean_where_varying(ctx: Any, tree: Any) -> Any:
    """The mean over the replicas of the leaves that vary over them; the others (already reduced,
    e.g. synchronized batch statistics) are returned unchanged, never reduced twice."""
    axes = ctx.axis_name if isinstance(ctx.axis_name, tuple) else (ctx.axis_name,)

    def mean(a: Any) -> Any:
        varying = tuple(x for x in axes if x in varying_axes(a))
        return lax.pmean(a, varying) if varying else a

    return jax.tree.map(mean, tree)


def _check_labels(y: np.ndarray, out: Any, loss_fn: Any, what: str) -> None:
    """Labels of the wrong kind for the named losses: one clear error (exit status 2)."""
    out_ndim = getattr(out, "ndim", None)
    if loss_fn is sparse_categorical_crossentropy and out_ndim is not None:
        if y.ndim == out_ndim and y.ndim >= 2 and y.shape[-1] == out.shape[-1]:
            raise data_lib.DataError(
                f"{what}: labels of shape {y.shape} look one-hot; loss "
                f"'sparse_categorical_crossentropy' expects integer class ids of shape "
                f"{y.shape[:-1]}: pass y.argmax(-1), or use loss='categorical_crossentropy'",
                exit_code=2)
        _check_batch_labels(y, what, loss_fn)
    if loss_fn is categorical_crossentropy and out_ndim is not None and y.ndim == out_ndim - 1:
        raise data_lib.DataError(
            f"{what}: labels of shape {y.shape} are class ids; loss 'categorical_crossentropy' "
            f"expects one-hot labels of shape {(*y.shape, out.shape[-1])}: use loss="
            f"'sparse_categorical_crossentropy'", exit_code=2)


def _pad_rows(a: Any, rows: int) -> np.ndarray:
    """``a`` with zero rows appended up to ``rows`` rows."""
    a = np.asarray(a)
    return np.concatenate([a, np.zeros((rows - a.shape[0], *a.shape[1:]), a.dtype)])


def _check_batch_labels(y: Any, what: str, loss_fn: Any) -> None:
    """Float labels that are not whole numbers cannot be class ids (sparse cross-entropy)."""
    if y is None or loss_fn is not sparse_categorical_crossentropy:
        return
    y = np.asarray(y)
    if np.issubdtype(y.dtype, np.floating):
        frac = np.mod(y, 1) != 0
        if frac.any():
            raise data_lib.DataError(
                f"{what}: labels are floats such as {y[frac].flat[0]:g}; loss "
                f"'sparse_categorical_crossentropy' expects integer class ids: pass integer "
                f"labels (y.astype(int) if they are ids), or a loss for real-valued targets",
                exit_code=2)


def _inline_on_coordinator(strategy: Any) -> contextlib.AbstractContextManager:
    """The Trainer's own evaluation and prediction on the coordinator are meant to run
    there (Keras' inline evaluation): ``ParameterServerStrategy.running_without_coordinator``
    keeps it from warning once per batch that they were not scheduled (other strategies have
    nothing to allow)."""
    allow = getattr(strategy, "running_without_coordinator", None)
    return allow() if allow is not None else contextlib.nullcontext()
