"""A training job from a validated config: strategy, data, model, optimizer, ``Trainer.fit``.

Example:
    >>> from jaxdist._src.job.config import load_config
    >>> history = run_job(load_config("configs/default.yaml"))  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from jaxdist._src.job import rerun, strategy_registry
from jaxdist._src.job.config import fit_kwargs, trainer_options
from jaxdist._src.job.optimizers import optimizer_from_config  # noqa: F401 - also public here
from jaxdist._src.job.strategy_registry import build_strategy  # noqa: F401 - also here


def compile_job(cfg: Mapping[str, Any], strategy: Any = None) -> Any:
    """Builds the job's strategy, data, model and ``Trainer`` as ``run_job`` does, then compiles
    one training dispatch without running it (nothing is written: no run directory, no
    checkpoint).

    With ``strategy.topology`` set (``TPUStrategy(topology=...)``), this compiles the step for
    that TPU on a machine without one.

    Returns:
        A ``jaxdist.tpu.CompileReport`` (per-device memory and FLOPs).

    Example:
        >>> from jaxdist._src.job.config import load_config
        >>> cfg = load_config("configs/tpu.yaml", ["strategy.topology=v5e:2x2"])  # doctest: +SKIP
        >>> print(compile_job(cfg))  # doctest: +SKIP
    """
    from jaxdist._src.job import data as data_lib
    from jaxdist._src.job import models
    from jaxdist._src.train.trainer import Trainer

    strategy, optimizer = strategy_registry.strategy_and_optimizer(cfg, strategy)
    train, val = data_lib.from_config(cfg["data"])
    num_classes = cfg["model"]["num_classes"]
    if num_classes is None:
        num_classes = max(train.num_classes, val.num_classes if val is not None else 0, 2)
    import dataclasses

    options = trainer_options(cfg)  # nothing written: no checkpoint, no run directory
    options["checkpoint"] = dataclasses.replace(options["checkpoint"], dir=None)
    options["logging"] = dataclasses.replace(options["logging"], dir=None, tensorboard=False)
    with strategy.scope():
        model = models.from_config(cfg["model"], train.x.shape[1:], num_classes, cfg["seed"])
        trainer = Trainer(model, optimizer, strategy=strategy, **options)
    return trainer.experimental_compile(train.x, train.y)


def run_job(cfg: Mapping[str, Any], strategy: Any = None) -> Any:
    """Trains as ``cfg`` says and returns the ``History``.

    Args:
        cfg: a config from ``load_config``.
        strategy: use this strategy instead of building the configured one.
    """
    from jaxdist._src.job import data as data_lib
    from jaxdist._src.job import models
    from jaxdist._src.train import callbacks as callbacks_lib
    from jaxdist._src.train.trainer import Trainer

    if strategy is None:
        from jaxdist._src.cluster.task_info import evaluator_task
        from jaxdist._src.job.sidecar import run_sidecar

        rerun.check_one_copy(cfg)  # e.g. `jaxdist.launch --workers 2` of a one-process config
        # Only the strategies that read TF_CONFIG look at it: a stale one in the environment
        # does not change (or break) a single-host job.
        task = evaluator_task() if strategy_registry.uses_tf_config(cfg["strategy"]["name"]) \
            else None
        if task is not None:  # TF_CONFIG's evaluator: evaluate the chief's checkpoints instead
            return run_sidecar(cfg, task)
    # Before the strategy starts (every process stops together); the checkpoints record the
    # settings that shape training.
    rerun.check_resume(cfg)
    settings = rerun.shaping_settings(cfg)
    strategy, optimizer = strategy_registry.strategy_and_optimizer(cfg, strategy)
    train, val = data_lib.from_config(cfg["data"])
    num_classes = cfg["model"]["num_classes"]
    if num_classes is None:
        num_classes = max(train.num_classes, val.num_classes if val is not None else 0, 2)
    import dataclasses

    # The config's options for the Trainer and fit, read in one place (job/schema.py).
    options, fit = trainer_options(cfg), fit_kwargs(cfg)
    options["checkpoint"] = dataclasses.replace(options["checkpoint"], settings=settings)
    with strategy.scope():
        model = models.from_config(cfg["model"], train.x.shape[1:], num_classes, cfg["seed"])
        trainer = Trainer(model, optimizer, strategy=strategy, **options)
    run_dir = trainer.run_dir  # this run's own directory (chief only)
    if run_dir is not None:
        from jaxdist._src.job.config import dump

        with open(os.path.join(run_dir, "config.yaml"), "w") as f:
            f.write(dump(cfg))
    base = run_dir or os.getcwd()
    callbacks = callbacks_lib.from_config(
        cfg["callbacks"], resolve_path=lambda p: p if os.path.isabs(p) else os.path.join(base, p))
    return trainer.fit(
        (train.x, train.y),
        validation_data=None if val is None else (val.x, val.y),
        callbacks=callbacks,
        **fit,
    )

