"""Keras optimizers as ``jaxdist.ps.optimizers`` specs: the update a parameter server applies.

Under ``ParameterServerStrategy`` the optimizer runs on the ps tasks, shard by shard, so a Keras
optimizer is translated into the elementwise ps optimizer with the same update rule:

======================================  ===============================================
Keras                                   on the ps (optax)
======================================  ===============================================
``SGD(lr)``                             ``sgd(lr)``
``SGD(lr, momentum, nesterov)``         ``momentum(lr, momentum, nesterov)`` (same rule)
``Adagrad(lr, initial_acc, eps)``       ``adagrad(lr, initial_acc, eps)`` (same rule)
``RMSprop(lr, rho, momentum, eps,       ``rmsprop(lr, decay=rho, eps, momentum, centered)``
centered)``                             (same rule: epsilon inside the square root)
``Adam(lr, b1, b2, eps)``               ``adam(lr, b1, b2, eps)`` (see below)
``AdamW(lr, wd, b1, b2, eps)``          ``adamw(lr, b1, b2, eps, weight_decay=wd)``
``clipvalue=c``                         ``clip(c)`` before the update (on the ps)
``global_clipnorm=n``                   ``clip_by_global_norm(n)`` (on the worker)
``ExponentialDecay`` learning rate      ``exponential_decay`` schedule (on the ps)
======================================  ===============================================

Adam/AdamW: Keras (as TF1's ``AdamOptimizer``) adds epsilon to ``sqrt(v)`` before the bias
correction, optax to ``sqrt(v_hat)`` after it; the two updates differ by a relative
``O(epsilon / sqrt(v_hat))`` (1e-7 against gradients of order 1e-3 or more: below 1e-3).

Anything else (AMSGrad, per-variable ``clipnorm``, ``weight_decay`` outside AdamW, EMA, loss
scaling, gradient accumulation, other optimizers or schedules) raises ``ValueError`` naming the
setting: no silent approximation.

Example:
    >>> from jaxdist._src.keras.ps_optimizers import keras_optimizer_spec
    >>> import keras  # doctest: +NEEDS_KERAS
    >>> spec = keras_optimizer_spec(keras.optimizers.SGD(0.1, momentum=0.9))
    >>> spec.to_json()["name"]
    'momentum'
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxdist._src.compat import keras_internals as ki
from jaxdist._src.ps import optimizers as ps_opt

_SUPPORTED = "SGD, Adam, AdamW, Adagrad, RMSprop"


def _fail(optimizer: Any, what: str) -> ValueError:
    return ValueError(
        f"Keras optimizer {type(optimizer).__name__} with {what} has no parameter-server "
        f"equivalent (the ps applies an elementwise optax update per shard); use one of "
        f"{_SUPPORTED} without it, or pass a jaxdist.ps.optimizers spec as ps_optimizer="
    )


def _lr_spec(optimizer: Any) -> Any:
    import keras

    lr = ki.learning_rate_of(optimizer)
    if isinstance(lr, keras.optimizers.schedules.ExponentialDecay):
        return ps_opt.exponential_decay(float(lr.initial_learning_rate), int(lr.decay_steps),
                                        float(lr.decay_rate), staircase=bool(lr.staircase))
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule) or callable(lr):
        raise _fail(optimizer, f"learning-rate schedule {type(lr).__name__}")
    return float(np.asarray(optimizer.learning_rate.value))


def keras_optimizer_spec(optimizer: Any) -> ps_opt.OptimizerSpec:
    """The ``jaxdist.ps.optimizers`` spec with ``optimizer``'s update rule (table above).

    Args:
        optimizer: a compiled model's ``keras.optimizers.Optimizer``.

    Returns:
        An ``OptimizerSpec`` (a ``chain`` when clipping is set).

    Raises:
        ValueError: the optimizer or one of its settings has no ps equivalent (the message
            names it and the supported ones).

    Example:
        >>> from jaxdist._src.keras.ps_optimizers import keras_optimizer_spec
        >>> import keras  # doctest: +NEEDS_KERAS
        >>> keras_optimizer_spec(keras.optimizers.Adam(1e-3)).to_json()["name"]
        'adam'
    """
    import keras

    opts = keras.optimizers
    name = type(optimizer).__name__
    if isinstance(optimizer, opts.LossScaleOptimizer):
        raise _fail(optimizer, "loss scaling (mixed precision)")
    for attr, what in (("use_ema", "use_ema=True"),
                       ("clipnorm", "per-variable clipnorm"),
                       ("loss_scale_factor", "loss_scale_factor"),
                       ("gradient_accumulation_steps", "gradient_accumulation_steps")):
        if getattr(optimizer, attr, None):
            raise _fail(optimizer, f"{what} (={getattr(optimizer, attr)!r})")
    wd = getattr(optimizer, "weight_decay", None)
    if wd and not isinstance(optimizer, opts.AdamW):
        raise _fail(optimizer, f"weight_decay={wd!r} (only AdamW's decoupled decay maps)")
    lr = _lr_spec(optimizer)
    if type(optimizer) is opts.SGD:
        m = float(optimizer.momentum)
        spec = (ps_opt.momentum(lr, m, bool(optimizer.nesterov)) if m
                else ps_opt.sgd(lr))
    elif type(optimizer) in (opts.Adam, opts.AdamW):
        if optimizer.amsgrad:
            raise _fail(optimizer, "amsgrad=True")
        b1, b2, eps = float(optimizer.beta_1), float(optimizer.beta_2), float(optimizer.epsilon)
        if type(optimizer) is opts.AdamW:
            spec = ps_opt.adamw(lr, b1, b2, eps, weight_decay=float(wd or 0.0))
        else:
            spec = ps_opt.adam(lr, b1, b2, eps)
    elif type(optimizer) is opts.Adagrad:
        spec = ps_opt.adagrad(lr, float(optimizer.initial_accumulator_value),
                              float(optimizer.epsilon))
    elif type(optimizer) is opts.RMSprop:
        kwargs: dict[str, Any] = dict(learning_rate=lr, decay=float(optimizer.rho),
                                      eps=float(optimizer.epsilon))
        if optimizer.momentum:
            kwargs["momentum"] = float(optimizer.momentum)
        if optimizer.centered:
            kwargs["centered"] = True
        spec = ps_opt.OptimizerSpec("rmsprop", kwargs)
    else:
        raise ValueError(
            f"Keras optimizer {name} has no parameter-server equivalent; supported: "
            f"{_SUPPORTED} (or pass a jaxdist.ps.optimizers spec as ps_optimizer=)"
        )
    parts = []
    if getattr(optimizer, "global_clipnorm", None):
        parts.append(ps_opt.clip_by_global_norm(float(optimizer.global_clipnorm)))
    if getattr(optimizer, "clipvalue", None):
        parts.append(ps_opt.clip(float(optimizer.clipvalue)))
    return ps_opt.chain(*parts, spec) if parts else spec


__all__ = ["keras_optimizer_spec"]
