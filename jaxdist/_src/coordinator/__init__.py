"""``jaxdist.coordinator``: TF2's ``tf.distribute.experimental.coordinator`` on jaxdist.

``ClusterCoordinator(strategy)`` schedules functions onto the worker tasks of a
parameter-server cluster and survives worker failures; see ``docs/coordinator.md``.

Example:
    >>> coordinator = jaxdist.coordinator.ClusterCoordinator(strategy)  # doctest: +SKIP
    >>> it = iter(coordinator.create_per_worker_dataset(dataset_fn))  # doctest: +SKIP
    >>> rv = coordinator.schedule(step_fn, args=(it,))  # doctest: +SKIP
    >>> coordinator.join()  # doctest: +SKIP
    >>> rv.fetch()  # doctest: +SKIP
"""
