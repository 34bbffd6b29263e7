"""``jaxdist.ps``: parameter servers: wire format, services, clients, placement, partitioners.

Example:
    >>> setter = jaxdist.ps.replica_device_setter(ps_tasks=2)
    >>> opt = jaxdist.ps.optimizers.adam(1e-3)
"""

from jaxdist.ps import optimizers, wire
from jaxdist.ps.checkpoints import PSCheckpointReader
from jaxdist.ps.client import LocalClient, PSClient
from jaxdist.ps.embedding import EmbeddingLookup, EmbeddingTable
from jaxdist.ps.errors import (
    PSAuthenticationError,
    PSError,
    PSInvalidArgumentError,
    PSNotFoundError,
    PSUnavailableError,
    StalenessTimeoutError,
    VariablesNotReadyError,
)
from jaxdist.ps.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
    split_rows,
)
from jaxdist.ps.placement import (
    GreedyLoadBalancingStrategy,
    ReplicaDeviceSetter,
    VariableSpec,
    byte_size_load_fn,
    replica_device_setter,
)
from jaxdist.ps.server import ParameterServer
from jaxdist.ps.service import ParameterService
from jaxdist.ps.variables import Layout, PSVariables

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
    "wire",
]
