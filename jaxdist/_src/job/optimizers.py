"""The optimizer a job config's ``optimizer`` section names (optax, with its schedule).

Example:
    >>> from jaxdist._src.job.optimizers import optimizer_from_config
    >>> from jaxdist._src.job.config import load_config
    >>> tx = optimizer_from_config(load_config(raw={})["optimizer"])    # adam(1e-3)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxdist._src.job.schema import ConfigError


def learning_rate_from_config(section: Mapping[str, Any]) -> Any:
    """The learning rate of a validated ``optimizer`` section: a float, or a schedule spec.

    A spec (``jaxdist.ps.optimizers.ScheduleSpec``) can travel to a ps; ``.build()`` gives the
    optax schedule.

    Example:
        >>> from jaxdist._src.job.optimizers import learning_rate_from_config
        >>> lr = learning_rate_from_config({"learning_rate": 0.1, "schedule": "cosine",
        ...                                 "decay_steps": 100, "end_learning_rate": 0.0})
        >>> round(float(lr(50)), 6)
        0.05
    """
    from jaxdist._src.ps import optimizers as O

    lr, kind = section["learning_rate"], section.get("schedule", "constant")
    end, steps = section.get("end_learning_rate", 0.0), section.get("decay_steps")
    if kind == "constant":
        return lr
    if kind == "cosine":
        return O.cosine_decay_schedule(lr, steps, alpha=end / lr if lr else 0.0)
    if kind == "warmup_cosine":
        return O.warmup_cosine_decay_schedule(0.0, lr, section.get("warmup_steps", 0), steps,
                                              end_value=end)
    if kind == "exponential":
        return O.exponential_decay(lr, steps, section.get("decay_rate", 0.5))
    if kind == "linear":
        return O.linear_schedule(lr, end, steps)
    raise ConfigError(f"optimizer.schedule: {kind!r} is not valid; expected one of constant, "
                      f"cosine, warmup_cosine, exponential, linear")


def optimizer_from_config(section: Mapping[str, Any]) -> Any:
    """The optax optimizer a validated ``optimizer`` section names.

    The optimizer is built with ``optax.inject_hyperparams``: its learning rate lives in the
    optimizer state, so it is logged, and (when constant) ``ReduceLROnPlateau`` can change it
    without recompiling.
    """
    import optax

    name, lr = section["name"], learning_rate_from_config(section)
    if not isinstance(lr, float | int):
        lr = lr.build()
    inject = optax.inject_hyperparams
    if name == "sgd":
        tx = inject(optax.sgd, static_args=("momentum",))(
            learning_rate=lr, momentum=section["momentum"] or None)
    elif name == "adam":
        tx = inject(optax.adam)(learning_rate=lr)
    elif name == "adamw":
        tx = inject(optax.adamw)(learning_rate=lr, weight_decay=section["weight_decay"])
    else:
        tx = inject(optax.rmsprop)(learning_rate=lr, momentum=section["momentum"])
    if section["clipnorm"] is not None:
        tx = optax.chain(optax.clip_by_global_norm(section["clipnorm"]), tx)
    return tx


__all__ = ["learning_rate_from_config", "optimizer_from_config"]
