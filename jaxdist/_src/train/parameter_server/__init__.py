"""The ``Trainer`` under ``ParameterServerStrategy``: configs, and the two hooks.

* ``config``: the ``parameter_server`` and ``parameter_server_coordinator`` strategies of job
  configs (keys, builders, the ps optimizer spec, ps/worker tasks that serve);
* ``between_graph``: ``ParameterServerHook``, TF1 between-graph training (every worker runs
  ``Trainer.fit``, pushes its gradients to the ps tasks);
* ``coordinated``: ``CoordinatorHook``, TF2 training with a ``ClusterCoordinator`` (the chief
  schedules steps onto the worker tasks), and ``parameter_server_hook``, which picks one of the
  two for a strategy.

The hooks talk to the ps tasks only through ``strategy.extended`` (``save``, ``restore``,
``latest_checkpoint_step``, ``mark_done``, ``wait_for_workers`` ...), never by RPC name.

Example:
    >>> import jaxdist
    >>> from jaxdist._src.train.parameter_server.coordinated import parameter_server_hook
    >>> parameter_server_hook(jaxdist.ParameterServerStrategy())    # no coordinator: TF1
    <...ParameterServerHook object at ...>
"""
