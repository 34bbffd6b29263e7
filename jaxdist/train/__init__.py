"""jaxdist.train: the Keras-``fit``-like path and the ``python -m jaxdist.train`` job.

Modules: ``schema`` (every config key and default, once), ``config`` (YAML, overrides,
validation), ``strategy_registry`` (per strategy class: its config names and builders, and the
``TrainerHook`` the ``Trainer`` delegates to), ``hooks`` (``TrainerHook``, ``SyncHook``),
``parameter_server`` (training under ``ParameterServerStrategy``), ``data`` (digits,
synthetic, ``.npz``; resumable order), ``models`` (MLP, CNN), ``trainer`` (``Trainer``),
``checkpoint`` (orbax), ``metrics`` (JSON lines, TensorBoard, progress), ``job`` (config ->
``Trainer.fit``), ``__main__`` (the CLI).

Names are imported lazily so that ``import jaxdist`` does not import flax, optax or orbax.

Example:
    >>> from jaxdist.train import Trainer, load_config
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Trainer": "jaxdist.train.trainer",
    "History": "jaxdist.train.trainer",
    "NaNLossError": "jaxdist.train.trainer",
    "ConfigError": "jaxdist.train.config",
    "load_config": "jaxdist.train.config",
    "register_strategy": "jaxdist.train.strategy_registry",
    "run_job": "jaxdist.train.job",
    "Checkpointer": "jaxdist.train.checkpoint",
    "MetricsLogger": "jaxdist.train.metrics",
    "ArrayData": "jaxdist.train.data",
    "DataError": "jaxdist.train.data",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxdist.train' has no attribute {name!r}")
