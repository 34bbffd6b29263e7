"""Distribution strategies, their context stack, cross-device ops and distributed values."""

from jaxdist._src.strategies.central_storage import CentralStorageStrategy
from jaxdist._src.strategies.context import (
    experimental_set_strategy,
    get_cross_replica_context,
    has_strategy,
    in_cross_replica_context,
)
from jaxdist._src.strategies.cross_device_ops import (
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)
from jaxdist._src.strategies.current import get_replica_context, get_strategy
from jaxdist._src.strategies.default import DefaultStrategy, get_default_strategy
from jaxdist._src.strategies.devices import resolve_device, resolve_devices
from jaxdist._src.strategies.inflight import StepThrottle
from jaxdist._src.strategies.losses import compute_average_loss, scale_regularization_loss
from jaxdist._src.strategies.mirrored import MirroredStrategy
from jaxdist._src.strategies.multi_worker import (
    CommunicationImplementation,
    CommunicationOptions,
    MultiWorkerMirroredStrategy,
)
from jaxdist._src.strategies.one_device import OneDeviceStrategy
from jaxdist._src.strategies.parameter_server import ParameterServerStrategy
from jaxdist._src.strategies.reduce_util import ReduceOp
from jaxdist._src.strategies.replica_context import ReplicaContext
from jaxdist._src.strategies.run_options import RunOptions
from jaxdist._src.strategies.strategy import Strategy, StrategyExtended, ValueContext
from jaxdist._src.strategies.tpu import TPUStrategy
from jaxdist._src.values import PerReplica

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
