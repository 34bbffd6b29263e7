"""The Trainer library behind ``jaxdist.train``: Keras' ``Model.fit`` for flax nnx models.

Modules: ``trainer`` (``Trainer``), ``options`` (``TrainConfig``, ``CheckpointConfig``,
``LoggingConfig``), ``state`` (``TrainState``, ``TrainerContext``: the hooks' contract),
``hooks`` (``TrainerHook``, ``SyncHook``), ``hook_registry`` (the hook of each strategy
class), ``parameter_server`` (the hooks of ``ParameterServerStrategy``), ``loop`` (the fit
loop's epoch plan, step runner and reporter), ``inputs``/``data`` (what ``fit`` reads, in a
resumable order), ``callbacks``, ``keras_metrics``, ``metrics`` (JSON lines, TensorBoard,
progress), ``checkpoint`` (orbax), ``evaluator`` (``SidecarEvaluator``), ``runs`` (run
directories).

The job that ``python -m jaxdist.train --config ...`` runs (its config schema, demo models and
data, CLI) is ``jaxdist._src.job``, which imports this package; this package never imports it.

Example:
    >>> from jaxdist._src.train.trainer import Trainer
"""
