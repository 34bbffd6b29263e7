"""Cluster description: ClusterSpec, resolvers (TF_CONFIG, Slurm, TPU), jax.distributed bring-up.

This package imports nothing else of jaxdist.
"""
