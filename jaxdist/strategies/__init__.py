"""Distribution strategies, their context stack, cross-device ops and distributed values."""

from jaxdist.strategies.central_storage import CentralStorageStrategy
from jaxdist.strategies.context import (
    experimental_set_strategy,
    get_cross_replica_context,
    has_strategy,
    in_cross_replica_context,
)
from jaxdist.strategies.cross_device_ops import (
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)
from jaxdist.strategies.current import get_replica_context, get_strategy
from jaxdist.strategies.default import DefaultStrategy, get_default_strategy
from jaxdist.strategies.devices import resolve_device, resolve_devices
from jaxdist.strategies.inflight import StepThrottle
from jaxdist.strategies.losses import compute_average_loss, scale_regularization_loss
from jaxdist.strategies.mirrored import MirroredStrategy
from jaxdist.strategies.multi_worker import (
    CommunicationImplementation,
    CommunicationOptions,
    MultiWorkerMirroredStrategy,
)
from jaxdist.strategies.one_device import OneDeviceStrategy
from jaxdist.strategies.parameter_server import ParameterServerStrategy
from jaxdist.strategies.reduce_util import ReduceOp
from jaxdist.strategies.replica_context import ReplicaContext
from jaxdist.strategies.run_options import RunOptions
from jaxdist.strategies.strategy import Strategy, StrategyExtended, ValueContext
from jaxdist.strategies.tpu import TPUStrategy
from jaxdist.values import PerReplica

__all__ = [
    "CentralStorageStrategy",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CrossDeviceOps",
    "DefaultStrategy",
    "HierarchicalCopyAllReduce",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "PerReplica",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "RunOptions",
    "StepThrottle",
    "Strategy",
    "StrategyExtended",
    "TPUStrategy",
    "ValueContext",
    "compute_average_loss",
    "experimental_set_strategy",
    "get_cross_replica_context",
    "get_default_strategy",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "resolve_device",
    "resolve_devices",
    "scale_regularization_loss",
]
