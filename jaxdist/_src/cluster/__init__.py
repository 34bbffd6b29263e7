"""Cluster description: ClusterSpec, resolvers (TF_CONFIG, Slurm, TPU), jax.distributed bring-up.

This package imports nothing else of jaxdist.

Example:
    >>> from jaxdist._src.cluster import TFConfigClusterResolver, initialize_from_resolver
    >>> group = initialize_from_resolver(TFConfigClusterResolver(), timeout_seconds=60)
"""

from jaxdist._src.cluster.bringup import (
    DEFAULT_TIMEOUT_SECONDS,
    current_group,
    find_lost_tasks,
    initialize_from_resolver,
    lost_tasks,
    should_load_checkpoint,
    should_save_checkpoint,
    shutdown,
    wait_for_step,
)
from jaxdist._src.cluster.cluster_spec import ClusterSpec
from jaxdist._src.cluster.errors import (
    ClusterConfigError,
    ClusterError,
    ClusterMergeError,
    ClusterTimeoutError,
    PeerLostError,
    ProcessFrozenError,
    TFConfigError,
)
from jaxdist._src.cluster.handshake import ClusterAuthenticationError
from jaxdist._src.cluster.process_group import ProcessGroup, process_group
from jaxdist._src.cluster.resolver import (
    TOKEN_ENV,
    ClusterResolver,
    SimpleClusterResolver,
    UnionResolver,
)
from jaxdist._src.cluster.slurm import SlurmClusterResolver
from jaxdist._src.cluster.tf_config import TF_CONFIG_ENV, TFConfigClusterResolver, parse_tf_config
from jaxdist._src.cluster.tpu_cluster_resolver import TPUClusterResolver, TPUNotFoundError
from jaxdist._src.cluster.validation import (
    TASK_TYPES,
    collective_leader,
    id_in_cluster,
    is_chief,
    normalize_cluster_spec,
    task_count,
    task_name,
    training_tasks,
    validate_cluster_spec,
    worker_count,
)

__all__ = [
    "ClusterAuthenticationError",
    "DEFAULT_TIMEOUT_SECONDS",
    "TASK_TYPES",
    "TF_CONFIG_ENV",
    "TOKEN_ENV",
    "ClusterConfigError",
    "ClusterError",
    "ClusterMergeError",
    "ClusterResolver",
    "ClusterSpec",
    "ClusterTimeoutError",
    "PeerLostError",
    "ProcessFrozenError",
    "ProcessGroup",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TFConfigError",
    "TPUClusterResolver",
    "TPUNotFoundError",
    "UnionResolver",
    "collective_leader",
    "current_group",
    "find_lost_tasks",
    "id_in_cluster",
    "initialize_from_resolver",
    "is_chief",
    "lost_tasks",
    "normalize_cluster_spec",
    "parse_tf_config",
    "process_group",
    "should_load_checkpoint",
    "should_save_checkpoint",
    "shutdown",
    "task_count",
    "task_name",
    "training_tasks",
    "validate_cluster_spec",
    "wait_for_step",
    "worker_count",
]
