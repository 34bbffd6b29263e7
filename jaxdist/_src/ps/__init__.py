"""``jaxdist.ps``: parameter servers: services, clients, variables, placement, partitioners.

Example:
    >>> import jaxdist.ps
    >>> setter = jaxdist.ps.replica_device_setter(ps_tasks=2)
    >>> opt = jaxdist.ps.optimizers.adam(1e-3)
"""

from jaxdist._src.ps import optimizers
from jaxdist._src.ps.checkpoints import PSCheckpointReader
from jaxdist._src.ps.client import LocalClient, PSClient
from jaxdist._src.ps.embedding import EmbeddingLookup, EmbeddingTable
from jaxdist._src.ps.errors import (
    PSAuthenticationError,
    PSCheckpointWriteError,
    PSError,
    PSInvalidArgumentError,
    PSNotFoundError,
    PSUnavailableError,
    StalenessTimeoutError,
    VariablesNotReadyError,
)
from jaxdist._src.ps.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
    split_rows,
)
from jaxdist._src.ps.placement import (
    GreedyLoadBalancingStrategy,
    ReplicaDeviceSetter,
    VariableSpec,
    byte_size_load_fn,
    replica_device_setter,
)
from jaxdist._src.ps.server import ParameterServer
from jaxdist._src.ps.service import ParameterService
from jaxdist._src.ps.variables import Layout, PSVariables

__all__ = [
    "EmbeddingLookup",
    "EmbeddingTable",
    "FixedShardsPartitioner",
    "GreedyLoadBalancingStrategy",
    "Layout",
    "LocalClient",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "PSAuthenticationError",
    "PSCheckpointReader",
    "PSClient",
    "PSCheckpointWriteError",
    "PSError",
    "PSInvalidArgumentError",
    "PSNotFoundError",
    "PSUnavailableError",
    "PSVariables",
    "ParameterServer",
    "ParameterService",
    "Partitioner",
    "ReplicaDeviceSetter",
    "StalenessTimeoutError",
    "VariableSpec",
    "VariablesNotReadyError",
    "byte_size_load_fn",
    "optimizers",
    "replica_device_setter",
    "split_rows",
]
