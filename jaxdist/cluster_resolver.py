"""``jaxdist.cluster_resolver``: TF's ``tf.distribute.cluster_resolver`` names."""

from jaxdist.cluster.tpu_cluster_resolver import TPUClusterResolver, TPUNotFoundError

__all__ = ["TPUClusterResolver", "TPUNotFoundError"]
