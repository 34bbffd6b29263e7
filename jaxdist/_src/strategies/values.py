"""``jaxdist._src.strategies.values``: the distributed values, kept under their TF module name.

They live in ``jaxdist._src.values`` (below both ``strategies`` and ``input``); this module
re-exports them so ``from jaxdist._src.strategies.values import PerReplica`` keeps working.
"""

from jaxdist._src.values.per_replica import (
    PerReplica,
    PerReplicaSpec,
    is_per_replica,
    local_components,
    regroup,
)

__all__ = ["PerReplica", "PerReplicaSpec", "is_per_replica", "local_components", "regroup"]
