"""``jaxdist.ray``: run a jaxdist cluster as Ray actors, from Python (a notebook) or the command
line (``python -m jaxdist.launch --backend ray``).

Every task (chief, workers, ps, evaluator) runs as a Ray actor that reserves its CPUs and GPUs,
spread over the Ray cluster's nodes; each gets a ``TF_CONFIG`` built from its node's address and
a port free there, its own TLS certificate and credentials (passed to its actor alone, never in
Ray's metadata), and its output comes back prefixed with its name. Needs Ray:
``pip install 'jaxdist[ray]'``. See docs/multi_host.md ("Ray").

Example:
    >>> import sys
    >>> import jaxdist.ray
    >>> code = jaxdist.ray.launch(                                   # doctest: +SKIP
    ...     [sys.executable, "-m", "jaxdist.train", "--config", "configs/multi_worker.yaml"],
    ...     workers=2, address="ray-head:6379", cpus_per_task=2)
    >>> code                                                          # doctest: +SKIP
    0
"""

from jaxdist._src.launch.ray_launch import RayLauncher, RayTaskLostError, launch

__all__ = ["RayLauncher", "RayTaskLostError", "launch"]
