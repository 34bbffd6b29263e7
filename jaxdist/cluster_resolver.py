"""``jaxdist.cluster_resolver``: TF's ``tf.distribute.cluster_resolver``: where the tasks of a
cluster are and which one this process is."""

from jaxdist._src.cluster.cluster_spec import ClusterSpec
from jaxdist._src.cluster.resolver import (
    ClusterResolver,
    SimpleClusterResolver,
    UnionResolver,
)
from jaxdist._src.cluster.slurm import SlurmClusterResolver
from jaxdist._src.cluster.tf_config import TFConfigClusterResolver
from jaxdist._src.cluster.tpu_cluster_resolver import TPUClusterResolver, TPUNotFoundError
from jaxdist._src.publish import publish as _publish

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TPUClusterResolver",
    "TPUNotFoundError",
    "UnionResolver",
]

_publish(__name__, TPUNotFoundError)
