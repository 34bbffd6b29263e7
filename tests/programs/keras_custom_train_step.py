"""keras-io "Customizing what happens in fit() with JAX": ``train_step`` / ``test_step`` overrides.

Source: github keras-team/keras-io, guides/custom_train_step_in_jax.py (fchollet). Three models
on ``Dense(1)`` over 32 features: (1) a ``train_step`` built on ``stateless_call``,
``stateless_compute_loss`` and ``optimizer.stateless_apply`` with the compiled loss and
metrics (``adam``, ``mse``, ``mae``; ``fit`` for 3 epochs on 1000 random rows); (2) a
lower-level ``train_step`` with its own ``Mean`` loss tracker, ``MeanAbsoluteError`` and
``MeanSquaredError`` loss, ``compile(optimizer="adam")`` only, 5 epochs; (3) a ``test_step``
override scored by ``evaluate``. Written anew after the guide: the same classes, compile
arguments, data shapes and calls.

Edits beyond API renames:
- each model is built and compiled under ``strategy.scope()``.
- the random data comes from ``np.random.default_rng(seed)`` instead of unseeded
  ``np.random.random``; ``keras.utils.set_random_seed(0)`` before building each model.
- 1 epoch for (1) and 2 for (2) instead of 3 and 5; ``verbose=0``; the histories,
  evaluation and weights are returned, not printed. Every epoch ends on a partial batch of 8
  rows (1000 = 31 x 32 + 8), as in the guide.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import jaxdist  # noqa: E402

ROWS, FEATURES = 1000, 32


def _metric_updates(model, metrics_variables, loss, y, y_pred, sample_weight):
    new_metrics_vars, logs = [], {}
    for metric in model.metrics:
        these = metrics_variables[len(new_metrics_vars):
                                  len(new_metrics_vars) + len(metric.variables)]
        if metric.name == "loss":
            these = metric.stateless_update_state(these, loss, sample_weight=sample_weight)
        else:
            these = metric.stateless_update_state(these, y, y_pred,
                                                  sample_weight=sample_weight)
        logs[metric.name] = metric.stateless_result(these)
        new_metrics_vars += these
    return logs, new_metrics_vars


class CustomModel(keras.Model):
    """Example (1): the compiled loss and metrics, a hand-written train step."""

    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables,
                                 metrics_variables, x, y, sample_weight, training=False):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=training)
        loss, (trainable_variables, non_trainable_variables, metrics_variables) = (
            self.stateless_compute_loss(
                trainable_variables, non_trainable_variables, metrics_variables, x=x, y=y,
                y_pred=y_pred, sample_weight=sample_weight, training=training))
        return loss, (y_pred, non_trainable_variables, metrics_variables)

    def train_step(self, state, data):
        (trainable_variables, non_trainable_variables, optimizer_variables,
         metrics_variables) = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables, metrics_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, metrics_variables, x, y,
            sample_weight, training=True)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        logs, new_metrics_vars = _metric_updates(self, metrics_variables, loss, y, y_pred,
                                                 sample_weight)
        return logs, (trainable_variables, non_trainable_variables, optimizer_variables,
                      new_metrics_vars)


class LowLevelModel(keras.Model):
    """Example (2): its own loss and metrics; ``compile`` only sets the optimizer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y,
                                 sample_weight, training=False):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=training)
        loss = self.loss_fn(y, y_pred, sample_weight=sample_weight)
        return loss, (y_pred, non_trainable_variables)

    def train_step(self, state, data):
        (trainable_variables, non_trainable_variables, optimizer_variables,
         metrics_variables) = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
            trainable_variables, non_trainable_variables, x, y, sample_weight, training=True)
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables)
        split = len(self.loss_tracker.variables)
        loss_vars = self.loss_tracker.stateless_update_state(
            metrics_variables[:split], loss, sample_weight=sample_weight)
        mae_vars = self.mae_metric.stateless_update_state(
            metrics_variables[split:], y, y_pred, sample_weight=sample_weight)
        logs = {self.loss_tracker.name: self.loss_tracker.stateless_result(loss_vars),
                self.mae_metric.name: self.mae_metric.stateless_result(mae_vars)}
        return logs, (trainable_variables, non_trainable_variables, optimizer_variables,
                      loss_vars + mae_vars)

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


class EvalModel(keras.Model):
    """Example (3): a hand-written ``test_step``."""

    def test_step(self, state, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        trainable_variables, non_trainable_variables, metrics_variables = state
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables, non_trainable_variables, x, training=False)
        loss, (trainable_variables, non_trainable_variables, metrics_variables) = (
            self.stateless_compute_loss(
                trainable_variables, non_trainable_variables, metrics_variables, x=x, y=y,
                y_pred=y_pred, sample_weight=sample_weight, training=False))
        logs, new_metrics_vars = _metric_updates(self, metrics_variables, loss, y, y_pred,
                                                 sample_weight)
        return logs, (trainable_variables, non_trainable_variables, new_metrics_vars)


def _data(seed: int):
    rng = np.random.default_rng(seed)
    return rng.random((ROWS, FEATURES)), rng.random((ROWS, 1))


def _build(cls, strategy):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        inputs = keras.Input(shape=(FEATURES,))
        return cls(inputs, keras.layers.Dense(1)(inputs))


def main(strategy: jaxdist.Strategy | None = None) -> dict:
    strategy = strategy or jaxdist.get_strategy()
    out = {}

    model = _build(CustomModel, strategy)
    with strategy.scope():
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x, y = _data(0)
    out["custom"] = model.fit(x, y, epochs=1, verbose=0).history
    out["custom_weights"] = model.get_weights()

    model = _build(LowLevelModel, strategy)
    with strategy.scope():
        model.compile(optimizer="adam")
    x, y = _data(1)
    out["low_level"] = model.fit(x, y, epochs=2, verbose=0).history
    out["low_level_weights"] = model.get_weights()

    model = _build(EvalModel, strategy)
    with strategy.scope():
        model.compile(loss="mse", metrics=["mae"])
    x, y = _data(2)
    out["evaluate"] = model.evaluate(x, y, return_dict=True, verbose=0)
    return out
