"""``jaxdist.ps``: the parameter service (``ParameterServer``, ``PSClient``),
its variables, partitioners and TF1's ``replica_device_setter``.

Example:
    >>> import jaxdist
    >>> partitioner = jaxdist.ps.MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=2)
"""

from jaxdist._src import publish as _publish
from jaxdist._src.ps import (
    EmbeddingLookup,
    EmbeddingTable,
    FixedShardsPartitioner,
    GreedyLoadBalancingStrategy,
    Layout,
    LocalClient,
    MaxSizePartitioner,
    MinSizePartitioner,
    ParameterServer,
    ParameterService,
    Partitioner,
    PSAuthenticationError,
    PSCheckpointReader,
    PSCheckpointWriteError,
    PSClient,
    PSError,
    PSInvalidArgumentError,
    PSNotFoundError,
    PSUnavailableError,
    PSVariables,
    ReplicaDeviceSetter,
    StalenessTimeoutError,
    VariablesNotReadyError,
    VariableSpec,
    byte_size_load_fn,
    optimizers,
    replica_device_setter,
    split_rows,
)
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
