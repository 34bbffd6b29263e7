"""The optimizer a job config's ``optimizer`` section names (optax, with its schedule from
``jaxdist._src.train.learning_rate``; the parameter-server job builds its ps-side spec in
``jaxdist._src.job.parameter_server``).

Example:
    >>> from jaxdist._src.job.optimizers import optimizer_from_config
    >>> from jaxdist._src.job.config import load_config
    >>> tx = optimizer_from_config(load_config(raw={})["optimizer"])    # adam(1e-3)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxdist._src.job.schema import ConfigError
from jaxdist._src.train.learning_rate import schedule_from_config


def optimizer_from_config(section: Mapping[str, Any]) -> Any:
    """The optax optimizer a validated ``optimizer`` section names.

    The optimizer is built with ``optax.inject_hyperparams``: its learning rate lives in the
    optimizer state, so it is logged, and (when constant) ``ReduceLROnPlateau`` can change it
    without recompiling.
    """
    import optax

    name = section["name"]
    try:
        lr = schedule_from_config(section)
    except ValueError as e:
        raise ConfigError(str(e)) from None
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


__all__ = ["optimizer_from_config"]
