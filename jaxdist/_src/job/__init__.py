"""The ``python -m jaxdist.train`` job: a YAML config -> strategy, data, model, ``Trainer.fit``.

Modules: ``schema`` (every config key, its default and the ``Trainer`` option it sets),
``config`` (YAML, ``--set`` overrides, validation), ``strategy_registry`` (each
``strategy.name``: its keys and builder), ``parameter_server`` (the parameter-server strategies'
config and ps tasks that serve), ``optimizers`` (the ``optimizer`` section), ``models`` (demo
MLP and CNN), ``data`` (demo data: digits, synthetic, ``.npz``), ``job`` (``run_job``,
``compile_job``), ``sidecar`` (an ``evaluator`` task), ``cli`` (the command line).

It sits on the Trainer library (``jaxdist._src.train``), never the other way round.

Example:
    >>> from jaxdist._src.job.cli import main
    >>> main(["--config", "configs/default.yaml", "--print-config"])  # doctest: +SKIP
    0
"""
