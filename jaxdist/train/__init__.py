"""``jaxdist.train``: the Keras-``fit``-like ``Trainer`` and the ``python -m jaxdist.train`` job
([trainer.md](trainer.md)); names are imported on first use, so ``import jaxdist`` stays free of
flax, optax and orbax.

Names are imported lazily so that ``import jaxdist`` does not import flax, optax or orbax.
Submodules: ``jaxdist.train.callbacks`` (Keras' callbacks), ``jaxdist.train.metrics`` (Keras'
metrics), ``jaxdist.train.models`` (``MLP``, ``CNN``), ``jaxdist.train.data`` (the configs'
datasets).

Example:
    >>> from jaxdist.train import Trainer, load_config
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Trainer": "jaxdist._src.train.trainer",
    "History": "jaxdist._src.train.callbacks",
    "NaNLossError": "jaxdist._src.train.loop",
    "TrainConfig": "jaxdist._src.train.options",
    "CheckpointConfig": "jaxdist._src.train.options",
    "LoggingConfig": "jaxdist._src.train.options",
    "TrainState": "jaxdist._src.train.state",
    "TrainerContext": "jaxdist._src.train.state",
    "TrainerHook": "jaxdist._src.train.hooks",
    "register_trainer_hook": "jaxdist._src.train.hook_registry",
    "ConfigError": "jaxdist._src.job.schema",
    "load_config": "jaxdist._src.job.config",
    "register_strategy": "jaxdist._src.job.strategy_registry",
    "run_job": "jaxdist._src.job.job",
    "Checkpointer": "jaxdist._src.train.checkpoint",
    "CheckpointDirError": "jaxdist._src.train.checkpoint",
    "CheckpointMismatchError": "jaxdist._src.train.checkpoint",
    "CheckpointWriteError": "jaxdist._src.train.checkpoint",
    "SettingsChangedError": "jaxdist._src.train.run_record",
    "TrainingCompleteError": "jaxdist._src.train.run_record",
    "MetricsLogger": "jaxdist._src.train.metrics",
    "ArrayData": "jaxdist._src.train.data",
    "DataError": "jaxdist._src.train.data",
    "EvaluatorTimeoutError": "jaxdist._src.train.evaluator",
    "Field": "jaxdist._src.job.schema",
    "PSCheckpointState": "jaxdist._src.train.evaluator",
    "SidecarEvaluator": "jaxdist._src.train.evaluator",
    "read_metrics": "jaxdist._src.train.metrics",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxdist.train' has no attribute {name!r}")
