"""Distributed values (``PerReplica``, ``PerReplicaSpec``): the bottom layer of jaxdist.

Both ``_src.strategies`` (``Strategy.run`` returns them) and ``_src.input`` (distributed
datasets yield them) import this package; it imports only JAX and NumPy.

Example:
    >>> import numpy as np
    >>> from jaxdist._src.values.per_replica import PerReplica
    >>> v = PerReplica(np.arange(4).reshape(2, 2))
    >>> v.values
    (array([0, 1]), array([2, 3]))
"""
