"""Who is in the cluster: ClusterSpec, TF's resolvers (TF_CONFIG, Slurm, TPU), the registry of
cluster environments that picks one, TF's multi-worker rules, a task's place in it.

This package imports nothing else of jaxdist but ``compat``; the bring-up is in
``_src/distributed/``, TLS and credentials in ``_src/security/``.

Example:
    >>> from jaxdist._src.cluster.auto_detect import detect_environment
    >>> detect_environment({"TF_CONFIG": '{"cluster": {"worker": ["h0:2222"]}}'}).name
    'tf_config'
"""
