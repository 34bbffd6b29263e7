"""Cluster description: ClusterSpec, resolvers (TF_CONFIG, Slurm, TPU), jax.distributed bring-up.

This package imports nothing else of jaxdist.

Example:
    >>> from jaxdist.cluster import TFConfigClusterResolver, initialize_from_resolver
    >>> group = initialize_from_resolver(TFConfigClusterResolver(), timeout_seconds=60)
"""

from jaxdist.cluster.bringup import (
    DEFAULT_TIMEOUT_SECONDS,
    current_group,
    find_lost_tasks,
    initialize_from_resolver,
    lost_tasks,
    shutdown,
    wait_for_step,
)
from jaxdist.cluster.cluster_spec import ClusterSpec
from jaxdist.cluster.errors import (
    ClusterConfigError,
    ClusterError,
    ClusterTimeoutError,
    PeerLostError,
)
from jaxdist.cluster.handshake import ClusterAuthenticationError
from jaxdist.cluster.process_group import ProcessGroup, process_group
from jaxdist.cluster.resolver import (
    TOKEN_ENV,
    ClusterResolver,
    SimpleClusterResolver,
    UnionClusterResolver,
    UnionResolver,
)
from jaxdist.cluster.slurm import SlurmClusterResolver
from jaxdist.cluster.tf_config import TF_CONFIG_ENV, TFConfigClusterResolver, parse_tf_config
from jaxdist.cluster.tpu_cluster_resolver import TPUClusterResolver, TPUNotFoundError
from jaxdist.cluster.validation import (
    TASK_TYPES,
    is_chief,
    task_name,
    training_tasks,
    validate_cluster_spec,
)

__all__ = [
    "ClusterAuthenticationError",
    "DEFAULT_TIMEOUT_SECONDS",
    "TASK_TYPES",
    "TF_CONFIG_ENV",
    "TOKEN_ENV",
    "ClusterConfigError",
    "ClusterError",
    "ClusterResolver",
    "ClusterSpec",
    "ClusterTimeoutError",
    "PeerLostError",
    "ProcessGroup",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TPUClusterResolver",
    "TPUNotFoundError",
    "UnionClusterResolver",
    "UnionResolver",
    "current_group",
    "find_lost_tasks",
    "initialize_from_resolver",
    "is_chief",
    "lost_tasks",
    "parse_tf_config",
    "process_group",
    "shutdown",
    "task_name",
    "training_tasks",
    "validate_cluster_spec",
    "wait_for_step",
]
