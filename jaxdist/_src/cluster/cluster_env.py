"""The registry of cluster environments (jax's ``ClusterEnv`` way).

An environment is a place a job can run in and be described from its environment variables:
``TF_CONFIG``, a Slurm job step, a TPU pod slice. Each is a subclass of ``ClusterEnvironment``
defined beside its resolver (``tf_config.py``, ``slurm.py``, ``tpu_cluster_resolver.py``) and
registered by being defined; ``auto_detect.py`` imports them all and picks the first present one
in ``priority`` order (lowest first).

Example:
    >>> from jaxdist._src.cluster.cluster_env import ClusterEnvironment, registered_environments
    >>> class MyScheduler(ClusterEnvironment):
    ...     name = "my-scheduler"
    ...     priority = 90
    ...     variables = ("MY_SCHEDULER_RANK",)
    ...     @classmethod
    ...     def resolver(cls):
    ...         raise NotImplementedError
    >>> MyScheduler.is_env_present({"MY_SCHEDULER_RANK": "0"})
    True
    >>> MyScheduler in registered_environments()
    True
    >>> MyScheduler.unregister()
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar


class ClusterEnvironment:
    """One kind of environment a cluster can be read from; subclasses register themselves.

    A subclass sets ``name`` (what ``auto_detect.resolver_from_environment`` reports),
    ``priority`` (lower is tried first), ``variables`` (the environment variables it is
    recognised by, named in errors), and implements ``resolver()``; ``is_env_present`` is true
    by default when any of ``variables`` is set to a non-empty value.
    """

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 100
    variables: ClassVar[tuple[str, ...]] = ()

    _registry: ClassVar[list[type[ClusterEnvironment]]] = []

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.name:
            raise TypeError(f"{cls.__qualname__}: a ClusterEnvironment needs a name")
        if any(env.name == cls.name for env in ClusterEnvironment._registry):
            raise ValueError(f"a cluster environment named {cls.name!r} is already registered")
        ClusterEnvironment._registry.append(cls)

    @classmethod
    def unregister(cls) -> None:
        """Removes this environment from the registry (tests, plugins)."""
        if cls in ClusterEnvironment._registry:
            ClusterEnvironment._registry.remove(cls)

    @classmethod
    def is_env_present(cls, environ: Mapping[str, str] | None = None) -> bool:
        """Whether this process runs in this environment (default: any of ``variables`` set)."""
        env = os.environ if environ is None else environ
        return any(env.get(v) for v in cls.variables)

    @classmethod
    def resolver(cls) -> Any:
        """The ``ClusterResolver`` of this environment, read from this process's
        environment."""
        raise NotImplementedError(f"{cls.__qualname__} must implement resolver()")


def registered_environments() -> list[type[ClusterEnvironment]]:
    """The registered environments in the order they are tried (``priority``, then name)."""
    return sorted(ClusterEnvironment._registry, key=lambda env: (env.priority, env.name))


__all__ = ["ClusterEnvironment", "registered_environments"]
