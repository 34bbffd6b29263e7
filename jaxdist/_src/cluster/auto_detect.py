"""Which cluster environment this process runs in, and its resolver.

The environments (``cluster_env.ClusterEnvironment`` subclasses) are tried in this order, the
first present one wins:

1. ``tf_config``: ``TF_CONFIG`` is set (``TFConfigClusterResolver``);
2. ``slurm``: a Slurm job step, ``SLURM_PROCID`` and ``SLURM_STEP_NODELIST`` both set
   (``SlurmClusterResolver``, every task a worker);
3. ``tpu``: a TPU slice, ``TPU_PROCESS_ADDRESSES`` or ``TPU_WORKER_HOSTNAMES`` set
   (``TPUClusterResolver``).

``TF_CONFIG`` comes first because whoever sets it (jaxdist's launchers, under Slurm or Ray
too) says exactly which task each process is.

Example:
    >>> from jaxdist._src.cluster.auto_detect import detect_environment
    >>> detect_environment({"SLURM_PROCID": "0", "SLURM_STEP_NODELIST": "n[1-2]"}).name
    'slurm'
    >>> detect_environment({"TF_CONFIG": "{}", "SLURM_PROCID": "0",
    ...                     "SLURM_STEP_NODELIST": "n1"}).name
    'tf_config'
    >>> detect_environment({}) is None
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxdist._src.cluster.cluster_env import ClusterEnvironment, registered_environments
from jaxdist._src.cluster.errors import ClusterConfigError
from jaxdist._src.cluster.slurm import SlurmEnvironment
from jaxdist._src.cluster.tf_config import TFConfigEnvironment
from jaxdist._src.cluster.tpu_cluster_resolver import TPUEnvironment

#: The environments jaxdist defines, in the order they are tried.
BUILTIN_ENVIRONMENTS = (TFConfigEnvironment, SlurmEnvironment, TPUEnvironment)


def detect_environment(environ: Mapping[str, str] | None = None
                       ) -> type[ClusterEnvironment] | None:
    """The first registered environment present in ``environ`` (default ``os.environ``), in
    ``priority`` order, or ``None`` when none is."""
    for env in registered_environments():
        if env.is_env_present(environ):
            return env
    return None


def looked_for() -> str:
    """What detection looks for, for messages: ``"tf_config ($TF_CONFIG), slurm (...)"``."""
    return ", ".join(
        f"{env.name} ({' / '.join('$' + v for v in env.variables)})"
        for env in registered_environments())


def resolver_from_environment(required: bool = False) -> Any:
    """The resolver of the environment this process runs in (``detect_environment``).

    Args:
        required: raise when no environment is present instead of returning ``None``.

    Raises:
        ClusterConfigError: ``required`` and no environment is present (the message names the
            variables looked for); or the present environment's variables are malformed.
    """
    env = detect_environment()
    if env is None:
        if required:
            raise ClusterConfigError(
                f"no cluster environment found: looked for {looked_for()}; set TF_CONFIG or "
                f"pass a cluster resolver")
        return None
    return env.resolver()


__all__ = ["BUILTIN_ENVIRONMENTS", "detect_environment", "looked_for",
           "resolver_from_environment"]
