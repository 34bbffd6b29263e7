"""The Trainer library behind ``jaxdist.train``: Keras' ``Model.fit`` for flax nnx models.

Modules: ``trainer`` (``Trainer``: construction, ``fit``/``evaluate``/``predict``) and its parts
``trainer_handle`` (what callbacks reach: ``stop_training``, ``learning_rate``, weights),
``replica_fns`` (the compiled replica functions), ``fit_inputs`` (host batches and input
blocks), ``fit_loop`` (``fit``'s epochs), ``checkpoint_wiring`` (checkpoint options, resume,
saves); ``options`` (``TrainConfig``, ``CheckpointConfig``, ``LoggingConfig``, resolved once),
``learning_rate`` (the config's schedules, the rate in an optax state), ``state``
(``TrainState``, ``TrainerContext``: the hooks' contract), ``hooks`` (``TrainerHook``,
``SyncHook``), ``hook_registry`` (the hook of each strategy class), ``parameter_server`` (the
hooks of ``ParameterServerStrategy``), ``loop`` (the fit loop's epoch plan, step runner and
reporter), ``inputs``/``data`` (what ``fit`` reads, in a resumable order), ``callbacks``,
``keras_metrics``, ``metrics`` (JSON lines, TensorBoard, progress), ``checkpoint`` (orbax),
``evaluator`` (``SidecarEvaluator``), ``runs`` (run directories).

The job that ``python -m jaxdist.train --config ...`` runs (its config schema, demo models and
data, CLI) is ``jaxdist._src.job``, which imports this package; this package never imports it.

Example:
    >>> from jaxdist._src.train.trainer import Trainer
"""
