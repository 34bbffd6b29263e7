"""``ClusterResolver`` base class, ``SimpleClusterResolver`` and ``UnionResolver`` (TF's names)."""

from __future__ import annotations

import abc
import os
from typing import Any

from jaxdist._src.cluster.cluster_spec import ClusterSpec, as_cluster_spec
from jaxdist._src.cluster.errors import ClusterConfigError, ClusterMergeError
from jaxdist._src.cluster.validation import quote

TOKEN_ENV = "JAXDIST_CLUSTER_TOKEN"


def format_master_url(master: str, rpc_layer: str | None = None) -> str:
    """``"grpc://host:port"`` when ``rpc_layer`` is set, else the address itself."""
    return f"{rpc_layer}://{master}" if rpc_layer else master


def local_accelerators() -> dict[str, int]:
    """Counts this process's accelerators by kind (``{"GPU": 8}``); CPUs are not counted.

    Note: this initialises JAX's backend, so call it after ``jax.distributed`` is up (or in a
    process that will not join a multi-process cluster).
    """
    import jax

    counts: dict[str, int] = {}
    for d in jax.local_devices():
        if d.platform != "cpu":
            kind = "TPU" if d.platform == "tpu" else "GPU"
            counts[kind] = counts.get(kind, 0) + 1
    return counts


class ClusterResolver(abc.ABC):
    """Where the tasks of a cluster are and which one this process is.

    Subclasses implement ``cluster_spec()`` (and usually ``master()``); ``task_type``,
    ``task_id``, ``rpc_layer``, ``environment`` and ``cluster_token`` are attributes.

    Example:
        >>> import jaxdist
        >>> import json, os
        >>> os.environ["TF_CONFIG"] = json.dumps({
        ...     "cluster": {"worker": ["localhost:12345", "localhost:23456"]},
        ...     "task": {"type": "worker", "index": 0}})
        >>> resolver = jaxdist.cluster_resolver.TFConfigClusterResolver()
        >>> resolver.cluster_spec().as_dict()
        {'worker': ['localhost:12345', 'localhost:23456']}
        >>> resolver.task_type, resolver.task_id
        ('worker', 0)
    """

    task_type: str | None = None
    task_id: int | None = None
    rpc_layer: str | None = None
    environment: str = ""

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """The cluster as a ``ClusterSpec`` (empty when there is no cluster)."""

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """The address of a task (default: this one), prefixed ``rpc_layer://`` when set.

        A task named explicitly must exist (``ValueError``, as in TF); this task's own address
        is ``""`` when the cluster does not list it.
        """
        explicit = task_type is not None and task_id is not None
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        if task_type is None or task_id is None:
            return ""
        spec = as_cluster_spec(self.cluster_spec())
        if not explicit and (task_type not in spec or task_id not in spec.task_indices(task_type)):
            return ""
        return format_master_url(
            spec.task_address(task_type, task_id), rpc_layer or self.rpc_layer
        )

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: Any = None) -> dict[str, int]:
        """Accelerators of this process by kind, e.g. ``{"GPU": 2}`` (``{}`` on CPU)."""
        del task_type, task_id, config_proto
        return local_accelerators()

    @property
    def cluster_token(self) -> str | None:
        """The shared secret of the cluster: TF_CONFIG's ``"token"``, else
        ``$JAXDIST_CLUSTER_TOKEN`` (``None`` when neither is set)."""
        return getattr(self, "_cluster_token", None) or os.environ.get(TOKEN_ENV) or None

    @cluster_token.setter
    def cluster_token(self, value: str | None) -> None:
        self._cluster_token = value

    def __repr__(self) -> str:
        # Never the token; never an exception (a bad TF_CONFIG shows as its error type).
        try:
            return (
                f"{type(self).__name__}(task_type={self.task_type!r}, task_id={self.task_id!r}, "
                f"cluster_spec={self.cluster_spec().as_dict()!r})"
            )
        except Exception as e:  # noqa: BLE001 - repr must not raise
            return f"{type(self).__name__}(<invalid configuration: {type(e).__name__}>)"


class SimpleClusterResolver(ClusterResolver):
    """A resolver that returns what it was given (``SimpleClusterResolver``).

    Args:
        cluster_spec: a ``ClusterSpec`` or a dict of job -> addresses.
        master: the value ``master()`` returns when called without arguments ("" derives it).
        task_type: this task's type.
        task_id: this task's index.
        environment: e.g. ``"google"`` or ``""``.
        num_accelerators: a dict like ``{"GPU": 2}`` (``None``: count JAX's local devices).
        rpc_layer: e.g. ``"grpc"``.
        cluster_token: the cluster's shared secret (``None``: ``$JAXDIST_CLUSTER_TOKEN``).

    Example:
        >>> from jaxdist.cluster_resolver import ClusterSpec, SimpleClusterResolver
        >>> r = SimpleClusterResolver(ClusterSpec({"worker": ["h0:2222", "h1:2222"]}),
        ...                           task_type="worker", task_id=1)
        >>> r.master()
        'h1:2222'
    """

    def __init__(self, cluster_spec: Any, master: str = "", task_type: str | None = None,
                 task_id: int | None = None, environment: str = "",
                 num_accelerators: dict[str, int] | None = None, rpc_layer: str | None = None,
                 cluster_token: str | None = None):
        self._cluster_spec = as_cluster_spec(cluster_spec)
        self._master = master
        self.task_type = task_type
        self.task_id = task_id
        self.environment = environment
        self._num_accelerators = num_accelerators
        self.rpc_layer = rpc_layer
        self._cluster_token = cluster_token

    def cluster_spec(self) -> ClusterSpec:
        return self._cluster_spec

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        if task_type is None and task_id is None and self._master:
            return format_master_url(self._master, rpc_layer or self.rpc_layer) if (
                "://" not in self._master) else self._master
        return super().master(task_type, task_id, rpc_layer)

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: Any = None) -> dict[str, int]:
        if self._num_accelerators is not None:
            return dict(self._num_accelerators)
        return super().num_accelerators(task_type, task_id, config_proto)


class UnionResolver(ClusterResolver):
    """Merges the clusters of several resolvers (TF's ``UnionResolver``).

    A job that several resolvers define is merged as TF merges it (see ``cluster_spec``).
    ``task_type``, ``task_id``, ``rpc_layer``, ``environment`` and the token come from the
    first resolver unless given.

    Example:
        >>> from jaxdist.cluster_resolver import SimpleClusterResolver, UnionResolver
        >>> from jaxdist.cluster_resolver import TFConfigClusterResolver
        >>> ps = SimpleClusterResolver({"ps": ["h9:2222"]})
        >>> workers = TFConfigClusterResolver(tf_config={"cluster": {"worker": ["h1:2222"]}})
        >>> UnionResolver(workers, ps).cluster_spec().jobs
        ['worker', 'ps']
    """

    def __init__(self, *resolvers: ClusterResolver, task_type: str | None = None,
                 task_id: int | None = None, rpc_layer: str | None = None):
        if not resolvers:
            raise ClusterConfigError("UnionResolver needs at least one resolver")
        for r in resolvers:
            if not hasattr(r, "cluster_spec"):
                raise ClusterConfigError(
                    f"UnionResolver got {r!r}: expected cluster resolvers"
                )
        self._resolvers = tuple(resolvers)
        first = resolvers[0]
        self.task_type = task_type if task_type is not None else first.task_type
        self.task_id = task_id if task_id is not None else first.task_id
        self.rpc_layer = rpc_layer if rpc_layer is not None else first.rpc_layer
        self.environment = getattr(first, "environment", "")

    def cluster_spec(self) -> ClusterSpec:
        """The jobs of every resolver, merged as TF merges them.

        A job defined by several resolvers is merged: lists are concatenated in resolver
        order; as soon as one of them is sparse (a dict), all become index -> address and a
        task index defined twice raises ``ClusterMergeError`` (a ``KeyError``, as in TF).
        """
        specs = [as_cluster_spec(r.cluster_spec()).as_dict() for r in self._resolvers]
        merged: dict[str, Any] = {}
        for d in specs:  # a job is a dict as soon as one of its parts is
            for job, tasks in d.items():
                if job not in merged or isinstance(tasks, dict):
                    merged[job] = {} if isinstance(tasks, dict) else []
        for d in specs:
            for job, tasks in d.items():
                target = merged[job]
                if isinstance(target, list):
                    target.extend(tasks)
                    continue
                part = dict(enumerate(tasks)) if isinstance(tasks, list) else dict(tasks)
                both = sorted(set(part) & set(target))
                if both:
                    raise ClusterMergeError(
                        f"Duplicate keys detected when merging two ClusterSpecs: job "
                        f"{quote(job)} has task(s) {both} in more than one resolver"
                    )
                target.update(part)
        return ClusterSpec(merged)

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """A task's address from the merged cluster, else the first resolver's master."""
        if task_type is not None and task_id is not None:
            return format_master_url(self.cluster_spec().task_address(task_type, task_id),
                                     rpc_layer or self.rpc_layer)
        return self._resolvers[0].master(rpc_layer=rpc_layer)

    @property
    def cluster_token(self) -> str | None:  # type: ignore[override]
        for r in self._resolvers:
            token = getattr(r, "cluster_token", None)
            if token:
                return token
        return os.environ.get(TOKEN_ENV) or None

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: Any = None) -> dict[str, int]:
        return self._resolvers[0].num_accelerators(task_type, task_id, config_proto)


__all__ = [
    "ClusterResolver",
    "SimpleClusterResolver",
    "TOKEN_ENV",
    "UnionResolver",
    "format_master_url",
    "local_accelerators",
]
