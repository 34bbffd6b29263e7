"""``jaxdist.cluster_resolver``: TF's ``tf.distribute.cluster_resolver`` names."""

from jaxdist.cluster.cluster_spec import ClusterSpec
from jaxdist.cluster.resolver import (
    ClusterResolver,
    SimpleClusterResolver,
    UnionClusterResolver,
    UnionResolver,
)
from jaxdist.cluster.slurm import SlurmClusterResolver
from jaxdist.cluster.tf_config import TFConfigClusterResolver
from jaxdist.cluster.tpu_cluster_resolver import TPUClusterResolver, TPUNotFoundError

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TPUClusterResolver",
    "TPUNotFoundError",
    "UnionClusterResolver",
    "UnionResolver",
]
