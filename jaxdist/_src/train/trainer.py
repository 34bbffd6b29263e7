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
from collections.abc import Callable, Mapping, Sequence  # noqa: F401
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from jaxdist._src.distributed import preemption
from jaxdist._src.strategies.context import has_strategy
from jaxdist._src.strategies.current import get_strategy
from jaxdist._src.strategies.one_device import OneDeviceStrategy
from jaxdist._src.strategies.strategy import Strategy
from jaxdist._src.train import callbacks as callbacks_lib
from jaxdist._src.train import data as data_lib
from jaxdist._src.train import inputs as inputs_lib
from jaxdist._src.train import loop as loop_lib
from jaxdist._src.train import options as options_lib
from jaxdist._src.train import run_record
from jaxdist._src.train.callbacks import History
from jaxdist._src.train.checkpoint import Checkpointer
from jaxdist._src.train.checkpoint_wiring import CheckpointWiring
from jaxdist._src.train.fit_inputs import InputFeed
from jaxdist._src.train.fit_loop import FitLoop
from jaxdist._src.train.hook_registry import hook_for
from jaxdist._src.train.loop import NaNLossError
from jaxdist._src.train.losses import (  # noqa: F401 - LOSSES and the losses: public here too
    LOSSES,
    LossFn,
    categorical_crossentropy,
    sparse_categorical_crossentropy,
)
from jaxdist._src.train.metrics import MetricsLogger
from jaxdist._src.train.model_state import ModelState
from jaxdist._src.train.options import CheckpointConfig, LoggingConfig, TrainConfig
from jaxdist._src.train.replica_fns import ReplicaFunctions
from jaxdist._src.train.state import TrainerContext, TrainState
from jaxdist._src.train.trainer_handle import FitStatus, TrainerHandle
from jaxdist._src.values.per_replica import PerReplica

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


_GROUP_ATTRIBUTES = {"config": "config", "checkpoint": "checkpoint_config",
                     "logging": "logging_config"}


def _option(name: str) -> property:
    """The ``Trainer`` attribute ``name`` (a flat option name, ``options.FLAT_NAMES``): reads
    its field of a config group; read only (the group is replaced as a whole, e.g. by
    ``replace_checkpoint_config``)."""
    group, field = options_lib.FLAT_NAMES[name]
    attribute = _GROUP_ATTRIBUTES[group]

    def get(self: Trainer) -> Any:
        return getattr(getattr(self, attribute), field)

    def set_(self: Trainer, value: Any) -> None:
        raise AttributeError(
            f"Trainer.{name} is read from trainer.{attribute}.{field} and cannot be assigned "
            f"({value!r}); expected a new config group, e.g. trainer.replace_checkpoint_config("
            f"dataclasses.replace(trainer.checkpoint_config, dir=...))")

    return property(get, set_, doc=f"``{attribute}.{field}`` (read only).")


def _call_batch_size(batch_size: Any, method: str) -> int | None:
    """``evaluate``/``predict``'s ``batch_size`` argument, checked (``None``: not given)."""
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or (
            batch_size < 1):
        raise ValueError(f"{method}(batch_size=...) must be a positive integer, got "
                         f"{batch_size!r}")
    return int(batch_size)


class Trainer(TrainerHandle, CheckpointWiring, FitLoop, InputFeed, ReplicaFunctions):
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
    steps_per_execution = _option("steps_per_execution")
    seed = _option("seed")
    shuffle = _option("shuffle")
    precision = _option("precision")
    batch_norm = _option("batch_norm")
    halt_on_nan = _option("halt_on_nan")
    checkpoint_dir = _option("checkpoint_dir")
    checkpoint_every_steps = _option("checkpoint_every_steps")
    keep_checkpoints = _option("keep_checkpoints")
    resume = _option("resume")
    log_dir = _option("log_dir")
    run_name = _option("run_name")
    log_every_steps = _option("log_every_steps")
    tensorboard = _option("tensorboard")
    progress_bar = _option("progress_bar")

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
        resolved = options_lib.resolve_checked(config, checkpoint, logging, options)
        # The options, as given: read where used, never copied into loose attributes. The
        # global batch size (set by fit(batch_size=...)) and the checkpointing (replaced by
        # replace_checkpoint_config) change by replacing the whole group.
        self.config: TrainConfig = dataclasses.replace(resolved.config, global_batch_size=None)
        self.checkpoint_config: CheckpointConfig = resolved.checkpoint
        self.logging_config: LoggingConfig = resolved.logging
        self._metrics = resolved.metrics
        self._compute_dtype = resolved.compute_dtype
        self.strategy = strategy or _default_strategy()
        if isinstance(loss, str):
            if loss not in LOSSES:
                raise ValueError(f"loss={loss!r} is not known; expected one of "
                                 f"{sorted(LOSSES)} or a function (logits, labels) -> "
                                 f"per-example loss")
            loss = LOSSES[loss]
        self.loss_fn: LossFn = loss
        self.optimizer = optimizer
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
        if resolved.config.global_batch_size is not None:
            self._set_batch_size(resolved.config.global_batch_size)
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
        config, ck = self.config, self.checkpoint_config
        settings = loop_lib.FitSettings(
            steps_per_execution=config.steps_per_execution, halt_on_nan=config.halt_on_nan,
            log_every_steps=self.logging_config.every_steps, checkpoint_dir=ck.dir,
            checkpoint_every_steps=ck.every_steps)
        # With checkpoints, a preemption notice stops every process at one step, the chief
        # saves it and every process exits with the restart code (distributed.preemption).
        self._preemption = (preemption.install(ck.termination)
                            if ck.dir is not None else None)
        self._dispatch_timer = (preemption.DispatchTimer(self._preemption.config)
                                if self._preemption is not None else None)
        try:
            with (self._preemption.consume() if self._preemption is not None
                  else contextlib.nullcontext()):
                self._fit_loop(settings, train, val, total, spe, validation_freq, logger,
                               history, cbs, num_epochs)
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

    def _current_params(self) -> Any:
        self.train_state = self._hook.current_state(self.context, self._state)
        return self._state.params

    def _epoch_order(self, num_examples: int, epoch: int) -> np.ndarray:
        # e.g. this worker's share
        return self._hook.epoch_order(self.context, num_examples, epoch)












def _verbose(verbose: int | str) -> int:
    if verbose == "auto":
        return 1
    if verbose not in (0, 1, 2) or isinstance(verbose, bool):
        raise ValueError(f"verbose={verbose!r} is not valid; expected 0 (silent), 1 (progress "
                         f"bar), 2 (one line per epoch) or 'auto'")
    return int(verbose)










def _inline_on_coordinator(strategy: Any) -> contextlib.AbstractContextManager:
    """The Trainer's own evaluation and prediction on the coordinator are meant to run
    there (Keras' inline evaluation): ``ParameterServerStrategy.running_without_coordinator``
    keeps it from warning once per batch that they were not scheduled (other strategies have
    nothing to allow)."""
    allow = getattr(strategy, "running_without_coordinator", None)
    return allow() if allow is not None else contextlib.nullcontext()
