"""tf.distribute's programming model on JAX: the strategies, contexts, cross-device ops,
distributed input and values, loss helpers, TF1's placement helpers, and the errors a training
program catches.

Example:
    >>> import jaxdist
    >>> import jax, jax.numpy as jnp
    >>> strategy = jaxdist.MirroredStrategy()          # every local device
    >>> with strategy.scope():
    ...     params = {"w": jnp.ones(3)}                # replicated
    >>> batch = strategy.experimental_distribute_values_from_function(
    ...     lambda ctx: jnp.full(3, ctx.replica_id_in_sync_group, jnp.float32))
    >>> def step(params, x):
    ...     return jaxdist.get_replica_context().all_reduce("SUM", params["w"] @ x)
    >>> out = strategy.run(step, args=(params, batch))
"""

import os
import sys

# Keras 3 picks its backend when first imported (TensorFlow by default): a program that imports
# jaxdist first gets Keras on JAX unless it chose a backend itself.
if "keras" not in sys.modules:
    os.environ.setdefault("KERAS_BACKEND", "jax")

# isort: off
# First: `python -m jaxdist.train` answers Ctrl-C (one line, exit 130) from its first import on.
from jaxdist._src.job import startup as _startup  # noqa: F401
# isort: on
from jaxdist import cluster_resolver, data, tpu
from jaxdist._src.cluster.errors import (
    ClusterConfigError,
    ClusterError,
    ClusterMergeError,
    ClusterTimeoutError,
    PeerLostError,
    ProcessFrozenError,
    TFConfigError,
)
from jaxdist._src.cluster.tpu_cluster_resolver import (
    register_slice_connector as _register_slice_connector,
)
from jaxdist._src.distributed.bringup import initialize_from_resolver as _initialize_from_resolver
from jaxdist._src.distributed.handshake import ClusterAuthenticationError
from jaxdist._src.distributed.termination import TerminationConfig
from jaxdist._src.input.dataset import Dataset
from jaxdist._src.input.distributed import DistributedDataset, DistributedIterator
from jaxdist._src.input.options import AutoShardPolicy, InputContext, InputOptions
from jaxdist._src.publish import publish as _publish
from jaxdist._src.security.tls import TLSConfig, TLSConfigError
from jaxdist._src.strategies.central_storage import CentralStorageStrategy
from jaxdist._src.strategies.compiled_run import register_run_state_hook as _register_run_state_hook
from jaxdist._src.strategies.context import (
    experimental_set_strategy,
    get_cross_replica_context,
    has_strategy,
    in_cross_replica_context,
)
from jaxdist._src.strategies.context import register_scope_hook as _register_scope_hook
from jaxdist._src.strategies.cross_device_ops import (
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)
from jaxdist._src.strategies.current import get_replica_context, get_strategy
from jaxdist._src.strategies.losses import compute_average_loss, scale_regularization_loss
from jaxdist._src.strategies.mirrored import MirroredStrategy
from jaxdist._src.strategies.multi_worker import (
    CommunicationImplementation,
    CommunicationOptions,
    MultiWorkerMirroredStrategy,
)
from jaxdist._src.strategies.nnx_state import NnxStateError
from jaxdist._src.strategies.one_device import OneDeviceStrategy
from jaxdist._src.strategies.reduce_util import ReduceOp
from jaxdist._src.strategies.replica_context import ReplicaContext
from jaxdist._src.strategies.replica_reduce import DoubleReductionError
from jaxdist._src.strategies.run_options import RunOptions
from jaxdist._src.strategies.strategy import Strategy, StrategyExtended, ValueContext
from jaxdist._src.strategies.tpu import TPUStrategy, experimental_connect_to_cluster
from jaxdist._src.values.per_replica import PerReplica, PerReplicaSpec

__version__ = "0.1.0"

_publish(__name__, ClusterAuthenticationError, ClusterConfigError, ClusterError, ClusterMergeError,
         ClusterTimeoutError, DoubleReductionError, NnxStateError, PeerLostError,
         ProcessFrozenError, TFConfigError, TLSConfigError)

from jaxdist._src.compat import jax_internals as _jax_internals  # noqa: E402

_jax_internals.warn_if_unsupported()


def _keras_scope_hook(strategy):
    # strategy.scope() distributes Keras models once keras is imported (this never imports
    # it). jaxdist.keras sits above jaxdist._src.strategies, so the hook is wired in here, where
    # every import of jaxdist._src.strategies passes first.
    if "keras" not in sys.modules:
        return None
    from jaxdist._src.keras.api import strategy_scope_hook

    return strategy_scope_hook(strategy)


_register_scope_hook(_keras_scope_hook)


def _keras_run_state_hook(fn, args, kwargs):
    # strategy.run carries the Keras variables its function reaches (TF's custom loop with a
    # Keras model); nothing happens, and keras is never imported, until keras is imported.
    if "keras" not in sys.modules:
        return None
    from jaxdist._src.keras.custom_loop import run_state_hook

    return run_state_hook(fn, args, kwargs)


_register_run_state_hook(_keras_run_state_hook)

# TPUClusterResolver (in _src/cluster, below the bring-up) joins a pod slice's jax.distributed
# group through the bring-up, registered here where every import of jaxdist passes first.
_register_slice_connector(_initialize_from_resolver)


_LAZY = {  # imported on first use: `import jaxdist` stays free of flax, optax and orbax, and a
    # synchronous job never imports the parameter-server modules (ps/, coordinator/)
    "Checkpoint": "jaxdist._src.train.tracked_checkpoint",
    "CheckpointManager": "jaxdist._src.train.tracked_checkpoint",
    "FixedShardsPartitioner": "jaxdist._src.ps.partitioners",
    "GreedyLoadBalancingStrategy": "jaxdist._src.ps.placement",
    "MaxSizePartitioner": "jaxdist._src.ps.partitioners",
    "MinSizePartitioner": "jaxdist._src.ps.partitioners",
    "ParameterServerStrategy": "jaxdist._src.strategies.parameter_server",
    "PreemptionCheckpointHandler": "jaxdist._src.train.preemption_handler",
    "Server": "jaxdist._src.coordinator.server",
    "Trainer": "jaxdist._src.train.trainer",
    "byte_size_load_fn": "jaxdist._src.ps.placement",
    "replica_device_setter": "jaxdist._src.ps.placement",
}


#: Public submodules imported on first attribute access (``jaxdist.keras.scope`` after
#: ``import jaxdist``), as ``tf.keras`` resolves after ``import tensorflow``.
_LAZY_MODULES = ("coordinator", "keras", "launch", "ps", "ray", "server", "testing", "train")


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _LAZY_MODULES:
        return importlib.import_module(f"jaxdist.{name}")
    raise AttributeError(f"module 'jaxdist' has no attribute {name!r}")


__all__ = [
    "AutoShardPolicy",
    "CentralStorageStrategy",
    "Checkpoint",
    "CheckpointManager",
    "ClusterAuthenticationError",
    "ClusterConfigError",
    "ClusterError",
    "ClusterMergeError",
    "ClusterTimeoutError",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CrossDeviceOps",
    "Dataset",
    "DistributedDataset",
    "DistributedIterator",
    "DoubleReductionError",
    "FixedShardsPartitioner",
    "GreedyLoadBalancingStrategy",
    "HierarchicalCopyAllReduce",
    "InputContext",
    "InputOptions",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "NnxStateError",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "PeerLostError",
    "PerReplica",
    "PerReplicaSpec",
    "PreemptionCheckpointHandler",
    "ProcessFrozenError",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "RunOptions",
    "Server",
    "Strategy",
    "StrategyExtended",
    "TFConfigError",
    "TLSConfig",
    "TLSConfigError",
    "TPUStrategy",
    "TerminationConfig",
    "Trainer",
    "ValueContext",
    "byte_size_load_fn",
    "cluster_resolver",
    "compute_average_loss",
    "coordinator",
    "data",
    "experimental_connect_to_cluster",
    "experimental_set_strategy",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "ps",
    "replica_device_setter",
    "scale_regularization_loss",
    "tpu",
]
