"""Keras ``fit`` / ``evaluate`` / ``predict`` on any dataset size under a jaxdist strategy.

A global batch is split over the replicas along its rows, so its size must divide by the
replica count. The last batch of a dataset often does not (70 rows in batches of 32 end with 6;
``predict`` of one sample on 4 replicas). As TF does for partial batches, such a batch is padded
and the padding masked, so that every number equals the same model on one device over the same
global batches:

- **Input.** ``fit`` / ``evaluate`` / ``predict`` of a model under a jaxdist distribution read
  their data through ``PaddedAdapter`` (a Keras ``DataAdapter`` around Keras's own adapter for
  the data given, or around ``DatasetAdapter`` for a ``jaxdist.Dataset``). A batch whose rows
  divide over this process's replicas passes through unchanged; another one gets copies of its
  last row appended up to the next multiple of the replica count (copies of a real row keep
  every value finite), and a row mask (``True`` for the real rows) is published beside it.
- **Steps.** The loop that Keras builds around the jitted step is replaced for such models
  (``wrap_make_function``, one of jaxdist's trainer hooks, active inside jaxdist scopes): it
  runs Keras's own step on every unpadded batch, and on a padded one a masked step
  (``masked_train_step`` / ``masked_test_step``) that gives the loss the sample weights
  ``w * mask`` (times ``rows / real rows`` for losses that divide by the number of
  elements, ``"sum_over_batch_size"`` and ``"mean"``, so the divisor counts only real rows),
  gives ``weighted_metrics`` ``w * mask`` and ``metrics`` (unweighted in Keras) the mask,
  weighs the loss trackers by the real row count, and hands ``BatchNormalization`` layers the
  row mask in training (their batch moments use real rows only). ``predict`` runs Keras's
  step and keeps the real rows of each batch.
- **Several processes** (``MultiWorkerMirroredStrategy``): each process reads its share of every
  global batch (``jaxdist._src.keras.input_adapters``), pads its own rows to the batch size,
  and every train / test step runs masked, so all processes run the same program whatever
  their own row counts are. ``predict``'s outputs are gathered and its padding dropped, so
  every process gets the predictions of every global batch in row order, as in TF.

The mask reaches the step through ``_CHANNEL``: the padding adapter's generator publishes it
just before yielding its batch, and the step loop reads it right after pulling that batch
(Keras's distributed iterator pulls one batch per ``next``; the loop checks exactly one batch
was published per pull and refuses otherwise, so a mask can never meet the wrong batch).

What cannot be masked raises instead of counting padded rows: a model that overrides
``train_step`` / ``test_step`` / ``compute_loss`` / ``compute_metrics``, layers that add losses
while called (``activity_regularizer``, ``add_loss``), and compiled losses that mix reductions
that need different weights. Random layers (``Dropout``) draw for the padded shape: the same
distribution, not the same random bits as one device. A custom metric that ignores
``sample_weight`` counts the padded rows.

The Keras internals this needs (the step loop, ``compute_loss_and_updates``'s body, the loss
tracker, the compiled loss and metrics, ``DataAdapter`` and Keras's own adapters) are reached
through ``jaxdist._src.compat.keras_internals``.

Example:
    >>> import jax, jaxdist
    >>> import numpy as np
    >>> import keras  # doctest: +NEEDS_KERAS
    >>> x, y = np.ones((70, 5), np.float32), np.ones((70, 1), np.float32)
    >>> with jaxdist.MirroredStrategy(jax.devices()[:4]).scope():  # doctest: +NEEDS_4_DEVICES
    ...     model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    ...     model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    >>> history = model.fit(x, y, batch_size=32, verbose=0)  # batches of 32, 32 and 6 rows
    >>> model.predict(x[:1], verbose=0).shape                # one row on 4 replicas
    (1, 1)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np

from jaxdist._src.compat import keras_internals as ki
from jaxdist._src.keras.input_adapters import DatasetAdapter, WrappingAdapter, inner_adapter

tree = keras.tree
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")
_SUM_REDUCTIONS = ("sum", "none", None)


# ----------------------------------------------------------------------------------------------
# The side channel: the mask of the batch a padding adapter yielded last.


@dataclass(frozen=True)
class Rows:
    """What the step needs to know about one batch of a ``PaddedAdapter``.

    Attributes:
        mask: ``(rows,)`` bool array, placed as the batch (``True`` for real rows), or ``None``
            when every row is real and the step need not be masked.
        real: real rows of this process's part of the batch.
        rows: rows of this process's part after padding.
    """

    mask: Any
    real: int
    rows: int


class _Channel(threading.local):
    seq = 0
    rows: Rows | None = None


_CHANNEL = _Channel()


def _publish(rows: Rows | None) -> None:
    _CHANNEL.seq += 1
    _CHANNEL.rows = rows


def _pull(iterator: Any) -> tuple[Any, Rows | None]:
    """``next(iterator)`` and the ``Rows`` its padding adapter published for that batch."""
    seq = _CHANNEL.seq
    data = next(iterator)
    moved = _CHANNEL.seq - seq
    if moved == 0:  # not from a padding adapter (train_on_batch, a Keras-made iterator)
        return data, None
    if moved != 1:
        raise RuntimeError(
            f"Keras read {moved} batches ahead of the step (expected 1): jaxdist.keras cannot "
            f"tell which batch is padded with this Keras version "
            f"({getattr(__import__('keras'), '__version__', '?')}); use a dataset size "
            f"divisible by the global batch size and a batch size divisible by the replicas")
    return data, _CHANNEL.rows


# ----------------------------------------------------------------------------------------------
# Input: adapters.


def _leading_rows(batch: Any) -> int:
    leaves = [x for x in jax.tree.leaves(batch) if np.ndim(x) > 0]
    if not leaves:
        raise ValueError(f"a Keras batch without arrays of rank >= 1: {batch!r}")
    sizes = {int(np.shape(x)[0]) for x in leaves}
    if len(sizes) != 1:
        raise ValueError(f"a Keras batch whose arrays have different row counts {sorted(sizes)}")
    return sizes.pop()


def _pad_rows(x: Any, rows: int) -> Any:
    """``x`` with copies of its last row appended up to ``rows`` rows."""
    a = np.asarray(x)
    if a.ndim == 0 or a.shape[0] == rows:
        return x
    extra = np.repeat(a[-1:], rows - a.shape[0], axis=0)
    return np.concatenate([a, extra], axis=0)


class PaddedAdapter(WrappingAdapter):
    """Keras input whose batches always divide over the replicas (see the module docstring).

    Args:
        inner: the Keras ``DataAdapter`` that reads the data.
        distribution: the ``StrategyDistribution`` the batches are placed by.
        kind: ``"train"``, ``"test"`` or ``"predict"``: the step that reads the batches.
        blocker: why the step cannot mask padded rows (a batch that does not divide then
            raises), or ``None``.

    Example:
        >>> PaddedAdapter(inner, keras.distribution.distribution(), "test", None)  # doctest: +SKIP
    """

    def __init__(self, inner: Any, distribution: Any, kind: str, blocker: str | None):
        self._inner = inner
        self._distribution = distribution
        self._kind = kind
        self._blocker = blocker
        strategy = distribution.strategy
        me = jax.process_index()
        self._local = sum(d.process_index == me for d in strategy.extended.worker_devices)
        # Across processes every batch is padded to one size and masked, so all processes run
        # the same step whatever their own row counts (predict keeps the real rows after it).
        self._uniform = jax.process_count() > 1 and blocker is None
        self._target: int | None = None
        if self._uniform and inner.batch_size:
            self._target = self._round_up(int(inner.batch_size))
        if blocker is not None:  # sizes known now (arrays): refuse before any step runs
            for size in (inner.batch_size, inner.partial_batch_size):
                if size and size % self._local:
                    raise self._unmaskable(size)

    def _unmaskable(self, real: int) -> ValueError:
        return ValueError(
            f"a batch of {real} rows does not divide over the {self._local} replicas of "
            f"{self._distribution.strategy!r}, and its padding cannot be masked: "
            f"{self._blocker}. Use a batch size and a dataset size divisible by {self._local} "
            f"(or drop the remainder)")

    @property
    def kind(self) -> str:
        """The step that reads the batches: ``"train"``, ``"test"`` or ``"predict"``."""
        return self._kind

    def _round_up(self, rows: int) -> int:
        return math.ceil(rows / self._local) * self._local

    def _rows_for(self, real: int) -> int:
        if not self._uniform:
            return self._round_up(real)
        if self._target is None:
            self._target = self._round_up(real)
        if real > self._target:
            raise ValueError(
                f"a batch of {real} rows on process {jax.process_index()} after batches of "
                f"{self._target}: in a job of several processes every batch of a dataset must "
                f"have at most as many rows as its first")
        return self._target

    def _prepare(self, batch: Any) -> Any:
        real = _leading_rows(batch)
        rows = self._rows_for(real)
        if rows == real and not self._uniform:
            _publish(None)
            return batch
        if rows != real and self._blocker is not None:
            raise self._unmaskable(real)
        padded = jax.tree.map(lambda x: _pad_rows(x, rows), batch) if rows != real else batch
        mask = None
        if self._kind != "predict" or self._uniform:
            sharding = self._distribution.batch_sharding
            mask = jax.make_array_from_process_local_data(sharding, np.arange(rows) < real)
        _publish(Rows(mask, real, rows))
        return padded

    def get_jax_iterator(self) -> Iterator[Any]:
        for batch in self._inner.get_jax_iterator():
            yield self._prepare(batch)

    def get_numpy_iterator(self) -> Iterator[Any]:
        for batch in self._inner.get_numpy_iterator():
            yield self._prepare(batch)

    @property
    def batch_size(self) -> int | None:
        return self._inner.batch_size

    @property
    def partial_batch_size(self) -> int | None:
        return self._inner.partial_batch_size



# ----------------------------------------------------------------------------------------------
# What a model's steps can mask.


def _loss_reductions(model: Any) -> list[Any]:
    return ki.loss_reductions(model)


def _loss_scaling(model: Any) -> bool:
    """Whether the loss weights of padded batches are scaled by rows / real rows.

    Raises:
        ValueError: the compiled losses mix reductions that need different weights.
    """
    reductions = {r for r in _loss_reductions(model) if r != "mean_with_sample_weight"}
    mean = {r for r in reductions if r in _MEAN_REDUCTIONS}
    if mean and reductions - mean:
        raise ValueError(
            f"the compiled losses mix reductions {sorted(map(str, reductions))}: a padded "
            f"batch needs scaled weights for the first kind and plain ones for the second")
    return bool(mean)


def blocker(model: Any, kind: str) -> str | None:
    """Why ``kind`` steps of ``model`` cannot mask padded rows, or ``None`` when they can.

    Example:
        >>> from jaxdist._src.keras.partial_batches import blocker
        >>> import keras  # doctest: +NEEDS_KERAS
        >>> model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        >>> blocker(model, "train") is None
        True
    """
    if kind == "predict":
        return None
    step = "train_step" if kind == "train" else "test_step"
    for name in (step, "compute_loss", "compute_metrics"):
        if ki.overrides_trainer_method(model, name):
            return f"{type(model).__name__} overrides {name}"
    for layer in ki.flatten_layers(model):
        if getattr(layer, "activity_regularizer", None) is not None:
            return (f"layer {layer.name!r} has an activity_regularizer (a loss over every row "
                    f"of the batch, padding included)")
    try:
        _loss_scaling(model)
    except ValueError as e:
        return str(e)
    return None


# ----------------------------------------------------------------------------------------------
# Masked steps.


def _row_mask_like(mask: Any, w: Any) -> Any:
    m = mask.astype(w.dtype if jnp.issubdtype(w.dtype, jnp.floating) else jnp.float32)
    return m.reshape(m.shape + (1,) * (w.ndim - 1))


def _weights(model: Any, sample_weight: Any, mask: Any) -> tuple[Any, Any, Any]:
    """(metric weights, loss weights, real row count) of a padded batch."""
    m = mask.astype(jnp.float32)
    n = jnp.sum(m)
    if sample_weight is None:
        metric = m
    else:
        metric = tree.map_structure(lambda w: w * _row_mask_like(mask, w), sample_weight)
    if _loss_scaling(model):
        scale = mask.shape[0] / n
        loss = tree.map_structure(lambda w: w * scale.astype(w.dtype), metric)
    else:
        loss = metric
    return metric, loss, n


@contextlib.contextmanager
def _masked_batch_norm(model: Any, mask: Any, training: bool) -> Iterator[None]:
    """``BatchNormalization`` layers of ``model`` compute batch moments over real rows only."""
    layers = [layer for layer in ki.flatten_layers(model)
              if isinstance(layer, keras.layers.BatchNormalization)] if training else []
    rows = mask.shape[0]

    def masked_call(layer: Any) -> Any:
        call = type(layer).call

        @functools.wraps(call)
        def masked(inputs: Any, training: Any = None, mask: Any = None) -> Any:
            if training and inputs.ndim >= 2 and inputs.shape[0] == rows:
                row = jnp.reshape(row_mask, (rows,) + (1,) * (inputs.ndim - 2))
                row = jnp.broadcast_to(row, inputs.shape[:-1])
                mask = row if mask is None else jnp.logical_and(mask, row)
            return call(layer, inputs, training=training, mask=mask)

        return masked

    row_mask = mask
    try:
        for layer in layers:
            layer.__dict__["call"] = masked_call(layer)
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("call", None)


def _loss_and_updates(model: Any, trainable: Any, non_trainable: Any, metrics: Any, x: Any,
                      y: Any, loss_weight: Any, mask: Any, training: bool,
                      optimizer_variables: Any = None) -> tuple[Any, Any]:
    """Keras's ``compute_loss_and_updates`` with masked BatchNormalization; refuses losses
    added while calling the model (they would count padded rows)."""
    kwargs = {"training": training} if ki.call_has_training_arg(model) else {}
    with _masked_batch_norm(model, mask, training):
        y_pred, non_trainable, losses = model.stateless_call(
            trainable, non_trainable, x, return_losses=True, **kwargs)
    weight_losses = sum(getattr(v, "regularizer", None) is not None
                        for v in model.trainable_weights)
    if len(losses) > weight_losses:
        raise ValueError(
            f"{model.name!r} adds {len(losses) - weight_losses} loss(es) while it is called "
            f"(add_loss / activity_regularizer): they count every row of a batch, so a padded "
            f"batch cannot be masked; use a dataset size divisible by the global batch size")
    with ki.losses_override(model, losses):
        loss, variables = model.stateless_compute_loss(
            trainable, non_trainable, metrics, x=x, y=y, y_pred=y_pred,
            sample_weight=loss_weight, training=training)
    trainable, non_trainable, metrics = variables
    unscaled = loss
    if training and model.optimizer is not None:
        mapping = list(zip(model.optimizer.variables, optimizer_variables))
        with keras.StatelessScope(state_mapping=mapping):
            loss = model.optimizer.scale_loss(loss)
    return loss, (unscaled, y_pred, non_trainable, metrics)


def _rescale_loss_trackers(model: Any, before: list, after: list, fraction: Any) -> list:
    """The per-output loss trackers (weighted by the padded row count) weighted by real rows."""
    ids = ki.loss_tracker_variable_ids(model)
    if not ids:
        return after
    out = list(after)
    for i, v in enumerate(model.metrics_variables):
        if id(v) in ids:
            out[i] = before[i] + (after[i] - before[i]) * fraction.astype(after[i].dtype)
    return out


def _update_metrics(model: Any, metrics: list, unscaled_loss: Any, x: Any, y: Any,
                    y_pred: Any, metric_weight: Any, mask: Any, n: Any) -> tuple[Any, list]:
    """Keras's ``_update_metrics_variables`` and ``compute_metrics`` counting real rows only:
    the loss is weighted by the real row count, every compiled metric by the row mask."""
    mapping = list(zip(model.metrics_variables, metrics))
    with keras.StatelessScope(state_mapping=mapping) as scope:
        ki.loss_tracker(model).update_state(unscaled_loss, sample_weight=n)
        ki.update_compile_metrics(model, y, y_pred, mask.astype(jnp.float32), metric_weight)
        logs = model.get_metrics_result()
    new = []
    for ref in model.metrics_variables:
        value = scope.get_current_value(ref)
        new.append(ref.value if value is None else value)
    return logs, new


def masked_train_step(model: Any, state: tuple, data: Any, mask: Any) -> tuple[Any, tuple]:
    """Keras's ``train_step`` on a padded batch: only the rows where ``mask`` is set count.

    Example:
        >>> logs, state = masked_train_step(model, state, (x, y), mask)  # doctest: +SKIP
    """
    trainable, non_trainable, optimizer_variables, metrics = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    metric_weight, loss_weight, n = _weights(model, sample_weight, mask)
    grad_fn = jax.value_and_grad(
        lambda t, nt, mv: _loss_and_updates(model, t, nt, mv, x, y, loss_weight, mask, True,
                                            optimizer_variables), has_aux=True)
    (_, aux), grads = grad_fn(trainable, non_trainable, metrics)
    unscaled, y_pred, non_trainable, new_metrics = aux
    new_metrics = _rescale_loss_trackers(model, metrics, new_metrics, n / mask.shape[0])
    trainable, optimizer_variables = model.optimizer.stateless_apply(
        optimizer_variables, grads, trainable)
    logs, new_metrics = _update_metrics(model, new_metrics, unscaled, x, y, y_pred,
                                        metric_weight, mask, n)
    return logs, (trainable, non_trainable, optimizer_variables, new_metrics)


def masked_test_step(model: Any, state: tuple, data: Any, mask: Any) -> tuple[Any, tuple]:
    """Keras's ``test_step`` on a padded batch: only the rows where ``mask`` is set count.

    Example:
        >>> logs, state = masked_test_step(model, state, (x, y), mask)  # doctest: +SKIP
    """
    trainable, non_trainable, metrics = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    metric_weight, loss_weight, n = _weights(model, sample_weight, mask)
    _, aux = _loss_and_updates(model, trainable, non_trainable, metrics, x, y, loss_weight,
                               mask, False)
    unscaled, y_pred, non_trainable, new_metrics = aux
    new_metrics = _rescale_loss_trackers(model, metrics, new_metrics, n / mask.shape[0])
    logs, new_metrics = _update_metrics(model, new_metrics, unscaled, x, y, y_pred,
                                        metric_weight, mask, n)
    return logs, (trainable, non_trainable, new_metrics)


# ----------------------------------------------------------------------------------------------
# The step loop.


def _under_strategy(model: Any) -> bool:
    from jaxdist._src.keras.central_storage import central_strategy_of

    dist = keras.distribution.distribution()
    if getattr(dist, "masks_partial_batches", False):
        return True
    return central_strategy_of(model) is not None


def wrap_make_function(original: Any) -> Any:
    """Keras's step-loop maker (``original``), making the row-aware loop (masked steps on
    padded batches) for models under a jaxdist distribution; Keras's own for any other.

    Example:
        >>> make_function = wrap_make_function(keras_make_function)  # doctest: +SKIP
    """

    @functools.wraps(original)
    def make_function(self: Any, step_function: Any, concatenate_outputs: bool = False) -> Any:
        if not ki.hooks_active_here() or not _under_strategy(self):
            return original(self, step_function, concatenate_outputs)
        return _rows_loop(self, step_function, concatenate_outputs)

    return make_function


def _every_process_rows(outputs: Any, rows: Rows | None) -> Any:
    """``predict``'s outputs of one global batch on every process, its real rows in the global
    batch's row order (as TF's Keras gathers them across workers): each process holds only its
    own (padded) rows of the global arrays the step returns."""
    from jax.experimental import multihost_utils

    outputs = multihost_utils.process_allgather(outputs, tiled=True)
    if rows is None or rows.mask is None:
        return outputs
    real = np.asarray(multihost_utils.process_allgather(rows.mask, tiled=True))
    return tree.map_structure(lambda o: np.asarray(o)[real], outputs)


#: The step loops made here (row-aware: masked steps on padded batches).
_ROW_AWARE_STEPS: weakref.WeakSet = weakref.WeakSet()


def _is_row_aware(fn: Any) -> bool:
    try:
        return fn in _ROW_AWARE_STEPS
    except TypeError:  # unhashable, or no weak reference to it
        return False


def _rows_loop(self: Any, step_function: Any, concatenate_outputs: bool) -> Any:
    model = self
    jit_steps = not model.run_eagerly and model.jit_compile
    masked: dict[int, Any] = {}

    def masked_step(state: tuple) -> Any:
        size = len(state)  # train: 4 parts of state, test: 3
        if size not in masked:
            fn = {4: masked_train_step, 3: masked_test_step}[size]
            step = functools.partial(fn, model)
            if jit_steps:
                shardings = jax.tree.map(lambda a: a.sharding, state)
                step = ki.step_jit()(step, donate_argnums=0,
                                     out_shardings=(None, shardings))
            masked[size] = step
        return masked[size]

    def one(state: tuple, iterator: Any) -> tuple[Any, tuple]:
        data, rows = _pull(iterator)
        if concatenate_outputs:  # predict: Keras's step, then the real rows
            outputs, state = step_function(state, data)
            if jax.process_count() > 1:
                return _every_process_rows(outputs, rows), state
            if rows is not None and rows.real != rows.rows:
                outputs = tree.map_structure(lambda o: o[:rows.real], outputs)
            return outputs, state
        if rows is None:
            return step_function(state, data)
        return masked_step(state)(state, data, rows.mask)

    def iterator_step(state: tuple, iterator: Any) -> tuple[Any, tuple]:
        outputs, state = one(state, iterator)
        collected = [outputs]
        try:
            for _ in range(model.steps_per_execution - 1):
                outputs, state = one(state, iterator)
                collected.append(outputs)
        except StopIteration:
            pass
        if concatenate_outputs and len(collected) > 1:
            outputs = tree.map_structure(lambda *o: jnp.concatenate(o), *collected)
        return outputs, state

    _ROW_AWARE_STEPS.add(iterator_step)
    return iterator_step


# ----------------------------------------------------------------------------------------------
# Entry points: fit / evaluate / predict read their data through a PaddedAdapter.


def _adapter(model: Any, kind: str, x: Any, y: Any = None, sample_weight: Any = None,
             batch_size: int | None = None, steps: int | None = None, shuffle: bool = False,
             class_weight: dict | None = None) -> PaddedAdapter:
    if isinstance(x, PaddedAdapter):
        return x
    inner = inner_adapter(kind, x, y, sample_weight, batch_size, steps, shuffle, class_weight)
    return PaddedAdapter(inner, keras.distribution.distribution(), kind, blocker(model, kind))


def _ensure_rows_aware(model: Any, attrs: tuple[str, ...]) -> None:
    """Step functions made before (outside any strategy) are made again with the row loop."""
    for attr in attrs:
        fn = getattr(model, attr, None)
        if fn is not None and not _is_row_aware(fn):
            setattr(model, attr, None)


def adapt_call(name: str, original: Any, model: Any, args: tuple, kwargs: dict
               ) -> tuple[tuple, dict]:
    """``fit`` / ``evaluate`` / ``predict`` arguments with the data read by ``PaddedAdapter``.

    Called by ``jaxdist._src.keras.model_strategy`` inside a jaxdist distribution's scope; other
    entry points and calls outside such a scope are returned unchanged.

    Example:
        >>> args, kwargs = adapt_call(  # doctest: +SKIP
        ...     "predict", type(model).predict, model, (x,), {})
    """
    dist = keras.distribution.distribution()
    if name not in ("fit", "evaluate", "predict"):
        return args, kwargs
    if not getattr(dist, "masks_partial_batches", False):
        return _plain_dataset_call(name, original, model, args, kwargs)
    bound = inspect.signature(original).bind(model, *args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if name == "fit":
        x, y, sw = a["x"], a["y"], a["sample_weight"]
        if a["validation_split"] and a["validation_data"] is None:
            (x, y, sw), a["validation_data"] = ki.train_validation_split(
                (x, y, sw), a["validation_split"])
            a["validation_split"] = 0.0
        a["x"] = _adapter(model, "train", x, y, sw, a["batch_size"], a["steps_per_epoch"],
                          a["shuffle"], a["class_weight"])
        a["y"] = a["sample_weight"] = a["class_weight"] = None
        if a["validation_data"] is not None:
            vx, vy, vsw = keras.utils.unpack_x_y_sample_weight(a["validation_data"])
            a["validation_data"] = _adapter(
                model, "test", vx, vy, vsw, a["validation_batch_size"] or a["batch_size"],
                a["validation_steps"])
        _ensure_rows_aware(model, ("train_function", "test_function"))
    elif name == "evaluate":
        if not a["kwargs"].get("_use_cached_eval_dataset", False):
            a["x"] = _adapter(model, "test", a["x"], a["y"], a["sample_weight"],
                              a["batch_size"], a["steps"])
            a["y"] = a["sample_weight"] = None
        _ensure_rows_aware(model, ("test_function",))
    else:
        a["x"] = _adapter(model, "predict", a["x"], None, None, a["batch_size"], a["steps"])
        _ensure_rows_aware(model, ("predict_function",))
    return bound.args[1:], bound.kwargs


def _plain_dataset_call(name: str, original: Any, model: Any, args: tuple, kwargs: dict
                        ) -> tuple[tuple, dict]:
    """Outside a jaxdist strategy (TF's default strategy): a ``jaxdist.Dataset`` given to
    ``fit`` / ``evaluate`` / ``predict`` (or as ``validation_data``) is read as Keras reads a
    ``tf.data.Dataset``; every other argument is left to Keras."""
    from jaxdist._src.input.dataset import Dataset

    bound = inspect.signature(original).bind(model, *args, **kwargs)
    a = bound.arguments
    changed = False
    if isinstance(a.get("x"), Dataset):
        for key in ("y", "sample_weight"):
            if a.get(key) is not None:
                raise ValueError(
                    f"When providing `x` as a jaxdist.Dataset, `{key}` should not be passed: "
                    f"its elements are (x, y) or (x, y, sample_weight) batches")
        a["x"] = DatasetAdapter(a["x"], a.get("class_weight"))
        a.pop("class_weight", None)
        changed = True
    if name == "fit" and isinstance(a.get("validation_data"), Dataset):
        a["validation_data"] = DatasetAdapter(a["validation_data"])
        changed = True
    if not changed:
        return args, kwargs
    return bound.args[1:], bound.kwargs

