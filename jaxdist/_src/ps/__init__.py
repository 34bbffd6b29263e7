"""``jaxdist.ps``: parameter servers: services, clients, variables, placement, partitioners.

Example:
    >>> import jaxdist.ps
    >>> setter = jaxdist.ps.replica_device_setter(ps_tasks=2)
    >>> opt = jaxdist.ps.optimizers.adam(1e-3)
"""
