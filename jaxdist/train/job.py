"""A training job from a validated config: strategy, data, model, optimizer, ``Trainer.fit``.

Example:
    >>> from jaxdist.train.config import load_config
    >>> history = run_job(load_config("configs/default.yaml"))
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from jaxdist.train.config import ConfigError, check_replicas
from jaxdist.train.hooks import hook_for


def learning_rate_from_config(section: Mapping[str, Any]) -> Any:
    """The learning rate of a validated ``optimizer`` section: a float, or a schedule spec.

    A spec (``jaxdist.ps.optimizers.ScheduleSpec``) can travel to a ps; ``.build()`` gives the
    optax schedule.

    Example:
        >>> lr = learning_rate_from_config({"learning_rate": 0.1, "schedule": "cosine",
        ...                                 "decay_steps": 100, "end_learning_rate": 0.0})
        >>> round(float(lr(50)), 6)
        0.05
    """
    from jaxdist.ps import optimizers as O

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


def build_strategy(cfg: Mapping[str, Any]) -> Any:
    """Builds the configured strategy and checks the batch divides across its replicas.

    Raises:
        ConfigError: an unknown device, or a batch size that does not divide.
    """
    from jaxdist.train.strategy_registry import build_strategy as _build

    try:
        strategy = _build(cfg["strategy"])
    except (ValueError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"strategy: {cfg['strategy']['name']!r} cannot be built from "
                          f"{dict(cfg['strategy'])!r}: {first}") from None
    check_replicas(cfg, strategy.num_replicas_in_sync)
    hook = hook_for(strategy)
    if hook is not None:
        hook.check_config(cfg)
    return strategy


def run_job(cfg: Mapping[str, Any], strategy: Any = None) -> Any:
    """Trains as ``cfg`` says and returns the ``History``.

    Args:
        cfg: a config from ``load_config``.
        strategy: use this strategy instead of building the configured one.
    """
    from jaxdist.train import callbacks as callbacks_lib
    from jaxdist.train import data as data_lib
    from jaxdist.train import models
    from jaxdist.train.strategy_registry import uses_tf_config
    from jaxdist.train.trainer import Trainer

    if strategy is None:
        from jaxdist.train.evaluator import evaluator_task, run_sidecar

        # Only the strategies that read TF_CONFIG look at it: a stale one in the environment
        # does not change (or break) a single-host job.
        task = evaluator_task() if uses_tf_config(cfg["strategy"]["name"]) else None
        if task is not None:  # TF_CONFIG's evaluator: evaluate the chief's checkpoints instead
            return run_sidecar(cfg, task)
        strategy = build_strategy(cfg)
    else:
        check_replicas(cfg, strategy.num_replicas_in_sync)
    train, val = data_lib.from_config(cfg["data"])
    num_classes = cfg["model"]["num_classes"]
    if num_classes is None:
        num_classes = max(train.num_classes, val.num_classes if val is not None else 0, 2)
    tcfg, ccfg, lcfg = cfg["train"], cfg["checkpoint"], cfg["logging"]
    hook = hook_for(strategy)  # e.g. parameter servers run their own optimizer spec
    optimizer = (hook.optimizer_from_config(cfg["optimizer"]) if hook is not None
                 else optimizer_from_config(cfg["optimizer"]))
    with strategy.scope():
        model = models.from_config(cfg["model"], train.x.shape[1:], num_classes, cfg["seed"])
        trainer = Trainer(
            model,
            optimizer,
            tcfg["loss"],
            global_batch_size=tcfg["global_batch_size"],
            strategy=strategy,
            steps_per_execution=tcfg["steps_per_execution"],
            seed=cfg["seed"],
            shuffle=cfg["data"]["shuffle"],
            checkpoint_dir=ccfg["dir"],
            checkpoint_every_steps=ccfg["every_steps"],
            keep_checkpoints=ccfg["keep"],
            resume=ccfg["resume"],
            log_dir=lcfg["dir"],
            run_name=lcfg["run_name"],
            metrics=tcfg["metrics"],
            log_every_steps=lcfg["every_steps"],
            tensorboard=lcfg["tensorboard"],
            progress_bar=lcfg["progress_bar"],
            halt_on_nan=tcfg["halt_on_nan"],
            precision=tcfg["precision"],
            batch_norm=tcfg["batch_norm"],
        )
    run_dir = trainer.run_dir  # this run's own directory (chief only)
    if run_dir is not None:
        from jaxdist.train.config import dump

        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            f.write(dump(cfg))
    base = run_dir or os.getcwd()
    callbacks = callbacks_lib.from_config(
        cfg["callbacks"], resolve_path=lambda p: p if os.path.isabs(p) else os.path.join(base, p))
    return trainer.fit(
        (train.x, train.y),
        epochs=tcfg["epochs"] if tcfg["steps"] is None else None,
        steps=tcfg["steps"],
        validation_data=None if val is None else (val.x, val.y),
        validation_freq=tcfg["validation_freq"],
        callbacks=callbacks,
        verbose=lcfg["verbose"],
    )
