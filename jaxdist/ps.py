"""``jaxdist.ps``: the parameter service, its variables, placement and partitioners
([parameter_server.md](parameter_server.md)).

Example:
    >>> import jaxdist
    >>> partitioner = jaxdist.ps.MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2)
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
from jaxdist._src.publish import publish as _publish
from jaxdist._src.transport.limits import ServerLimits

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
    "PSCheckpointWriteError",
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
    "ServerLimits",
    "StalenessTimeoutError",
    "VariableSpec",
    "VariablesNotReadyError",
    "byte_size_load_fn",
    "optimizers",
    "replica_device_setter",
    "split_rows",
]

_publish(__name__, PSAuthenticationError, PSCheckpointWriteError, PSError,
         PSInvalidArgumentError, PSNotFoundError, PSUnavailableError, StalenessTimeoutError,
         VariablesNotReadyError)
