"""What ``python -m jaxdist.train`` checks before it builds anything, so that a rerun never
silently does the wrong thing.

* ``check_one_copy``: a single-process strategy started as several tasks of a cluster (by
  ``jaxdist.launch``, Kubeflow or ``srun``) would train that many unrelated copies: refused;
  so would a multi-process strategy started by a bare ``srun`` (Slurm's variables but no
  ``TF_CONFIG``: ``python -m jaxdist.slurm`` gives each task its own).
* ``check_resume``: the checkpoint directory can be written, the settings recorded
  with its checkpoint (``run_settings.json``, ``jaxdist._src.train.run_record``) are the
  config's or allowed to change (``checkpoint.allow_changes``), and the checkpoint does not
  already complete the configured training (unless ``checkpoint.allow_finished``).
* ``shaping_settings``: the config keys recorded with every checkpoint: the data, the model,
  the optimizer (learning rate and schedule included), the global batch size, the loss, the
  precision, the BatchNorm mode, the seed and the strategy. Epochs, steps, logging and
  checkpointing are not among them: a rerun may raise ``train.epochs`` to train further.

Example:
    >>> from jaxdist._src.job.rerun import shaping_settings
    >>> from jaxdist._src.job.config import load_config
    >>> settings = shaping_settings(load_config(raw={"optimizer": {"learning_rate": 0.1}}))
    >>> settings["optimizer.learning_rate"], settings["strategy.name"]
    (0.1, 'mirrored')
    >>> "train.epochs" in settings
    False
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxdist._src.job import strategy_registry
from jaxdist._src.job.config import ConfigError

#: Whole sections whose every key shapes training.
SHAPING_SECTIONS = ("data", "model", "optimizer")
#: Single keys that shape training.
SHAPING_KEYS = ("seed", "strategy.name", "train.global_batch_size", "train.loss",
                "train.precision", "train.batch_norm")

#: The config of each multi-process strategy, for the message of ``check_one_copy``.
_MULTI_PROCESS_CONFIGS = {"multi_worker": "configs/multi_worker.yaml",
                          "parameter_server": "configs/parameter_server.yaml"}


def _get(cfg: Mapping[str, Any], key: str) -> Any:
    section, _, name = key.rpartition(".")
    return cfg[section][name] if section else cfg[name]


def shaping_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``{key: value}`` of the settings that shape training (see the module docstring).

    Example:
        >>> from jaxdist._src.job.rerun import shaping_settings
        >>> from jaxdist._src.job.config import load_config
        >>> shaping_settings(load_config(raw={}))["train.global_batch_size"]
        64
    """
    out = {key: _get(cfg, key) for key in SHAPING_KEYS}
    for section in SHAPING_SECTIONS:
        out.update({f"{section}.{k}": v for k, v in cfg[section].items()})
    return dict(sorted(out.items()))


def check_one_copy(cfg: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> None:
    """Refuses a single-process strategy in a process the environment starts as one of
    several tasks (``TF_CONFIG``, ``srun``), and a multi-process strategy started by ``srun``
    without ``TF_CONFIG``: each task would train its own copy.

    Raises:
        ConfigError: naming the strategy, the cluster and the configs to use instead.

    Example:
        >>> from jaxdist._src.job.rerun import check_one_copy
        >>> from jaxdist._src.job.config import load_config
        >>> env = {"TF_CONFIG": '{"cluster": {"worker": ["a:1", "b:1"]}, '
        ...        '"task": {"type": "worker", "index": 0}}'}
        >>> check_one_copy(load_config(raw={"strategy": {"name": "mirrored"}}), env)
        Traceback (most recent call last):
            ...
        jaxdist._src.job.schema.ConfigError: strategy.name: 'mirrored' trains in one process,
        but TF_CONFIG ...
    """
    from jaxdist._src.cluster.task_info import launched_tasks

    name = cfg["strategy"]["name"]
    launched = launched_tasks(environ)
    if strategy_registry.uses_tf_config(name):
        if launched is not None and launched[0] > 1 and launched[1].startswith("srun"):
            # Slurm started several tasks, but nobody gave them TF_CONFIG (nor TLS, tokens).
            raise ConfigError(
                f"strategy.name: {name!r} reads its cluster from TF_CONFIG, but this process "
                f"is one of the tasks of a Slurm step ({launched[1]}) without TF_CONFIG: each "
                f"would train its own unrelated copy; expected the batch script to run "
                f"`python -m jaxdist.slurm -- python -m jaxdist.train --config ...` instead of "
                f"srun (it gives every task its TF_CONFIG, TLS certificate and tokens; see "
                f"configs/slurm/)")
        return
    if launched is None or launched[0] <= 1:
        return
    count, source = launched
    instead = ", ".join(f"{n} ({path})" for n, path in _MULTI_PROCESS_CONFIGS.items())
    raise ConfigError(
        f"strategy.name: {name!r} trains in one process, but {source} starts {count} "
        f"processes: each would train its own unrelated copy; expected a multi-process "
        f"strategy: {instead}, or run the job as one process without a cluster")


def check_resume(cfg: Mapping[str, Any]) -> None:
    """The checks of a job with a ``checkpoint.dir``, before anything is built.

    Raises:
        ConfigError: ``checkpoint.allow_changes`` names a key that is not recorded.
        CheckpointDirError: the directory cannot be created or written (checked on every
            process: they share it, and all of them stop together).
        SettingsChangedError: the recorded settings differ and the change is not allowed.
        TrainingCompleteError: the checkpoint already completes the configured training.

    Example:
        >>> from jaxdist._src.job.rerun import check_resume
        >>> from jaxdist._src.job.config import load_config
        >>> check_resume(load_config(raw={"checkpoint": {"dir": "ckpt"}}))   # nothing yet
    """
    from jaxdist._src.train.checkpoint import check_checkpoint_dir
    from jaxdist._src.train.run_record import RunRecord, check_not_finished

    ck = cfg["checkpoint"]
    settings = shaping_settings(cfg)
    unknown = [k for k in ck["allow_changes"] if k not in settings]
    if unknown:
        raise ConfigError(f"checkpoint.allow_changes: {unknown[0]!r} is not a recorded "
                          f"setting; expected some of: {', '.join(settings)}")
    if ck["dir"] is None:
        return
    check_checkpoint_dir(ck["dir"])
    if not ck["resume"]:
        return
    RunRecord(ck["dir"], settings, ck["allow_changes"], writer=False).check()
    if not ck["allow_finished"]:
        steps = cfg["train"]["steps"]
        check_not_finished(ck["dir"], None if steps is not None else cfg["train"]["epochs"],
                           steps)


__all__ = ["SHAPING_KEYS", "SHAPING_SECTIONS", "check_one_copy", "check_resume",
           "shaping_settings"]
