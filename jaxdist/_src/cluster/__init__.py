"""Cluster description: ClusterSpec, resolvers (TF_CONFIG, Slurm, TPU), jax.distributed bring-up.

This package imports nothing else of jaxdist.

Example:
    >>> from jaxdist._src.cluster.bringup import initialize_from_resolver
    >>> from jaxdist._src.cluster.tf_config import TFConfigClusterResolver
    >>> group = initialize_from_resolver(TFConfigClusterResolver(), timeout_seconds=60)
"""
