"""The side-car evaluator task of a job: ``TF_CONFIG``'s ``evaluator`` evaluates the chief's
checkpoints (``jaxdist._src.train.evaluator.SidecarEvaluator``) with the job's model and data.

Example:
    >>> records = run_sidecar(  # doctest: +SKIP
    ...     load_config("configs/multi_worker.yaml"), "evaluator:0")
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


def run_sidecar(cfg: Mapping[str, Any], task: str = "evaluator:0") -> list[dict[str, Any]]:
    """Runs a job config's side-car evaluator (the ``evaluator`` task of ``python -m
    jaxdist.train``).

    The model, optimizer and batch size come from the config (so the checkpoints restore into
    them); evaluation runs on one local device, outside the training cluster. Under the
    ``parameter_server`` strategies it reads the ps tasks' checkpoints and stops after the one
    the chief marks final.

    Raises:
        ConfigError: the config has no ``checkpoint.dir`` to watch.
        EvaluatorTimeoutError: no new checkpoint within ``evaluator.idle_timeout_seconds``.
    """
    import jax

    from jaxdist._src.job import data as job_data
    from jaxdist._src.job import models
    from jaxdist._src.job.optimizers import optimizer_from_config
    from jaxdist._src.job.schema import ConfigError
    from jaxdist._src.strategies.one_device import OneDeviceStrategy
    from jaxdist._src.train import data as data_lib
    from jaxdist._src.train.evaluator import PSCheckpointState, SidecarEvaluator
    from jaxdist._src.train.options import LoggingConfig, TrainConfig
    from jaxdist._src.train.trainer import Trainer

    ccfg, lcfg, ecfg, tcfg = cfg["checkpoint"], cfg["logging"], cfg["evaluator"], cfg["train"]
    if ccfg["dir"] is None:
        raise ConfigError(f"checkpoint.dir: null, but {task} evaluates the checkpoints the "
                          f"chief writes there; set checkpoint.dir")
    train, val = job_data.from_config(cfg["data"])
    num_classes = cfg["model"]["num_classes"]
    if num_classes is None:
        num_classes = max(train.num_classes, val.num_classes if val is not None else 0, 2)
    b = tcfg["global_batch_size"]
    spe = data_lib.steps_per_epoch(len(train), b)
    final = tcfg["steps"] if tcfg["steps"] is not None else tcfg["epochs"] * spe
    strategy = OneDeviceStrategy(jax.local_devices()[0])
    with strategy.scope():
        model = models.from_config(cfg["model"], train.x.shape[1:], num_classes, cfg["seed"])
        trainer = Trainer(model, optimizer_from_config(cfg["optimizer"]), tcfg["loss"],
                          strategy=strategy,
                          config=TrainConfig(global_batch_size=b,
                                             precision=tcfg.get("precision", "float32")),
                          logging=LoggingConfig(progress_bar="never"))
    log_dir = ecfg["log_dir"]
    if log_dir is None and lcfg["dir"] is not None:
        log_dir = os.path.join(lcfg["dir"], "eval")
    data = (val.x, val.y) if val is not None else (train.x, train.y)
    reader = None
    if cfg["strategy"]["name"] in ("parameter_server", "parameter_server_coordinator"):
        # The chief's step count depends on the workers' shares: stop at its final mark.
        reader, final = PSCheckpointState(ccfg["dir"]), None
    return SidecarEvaluator(
        trainer, data, ccfg["dir"], final_step=final, log_dir=log_dir,
        poll_seconds=ecfg["poll_seconds"], idle_timeout_seconds=ecfg["idle_timeout_seconds"],
        tensorboard=lcfg["tensorboard"], task=task, reader=reader,
    ).start()


__all__ = ["run_sidecar"]
