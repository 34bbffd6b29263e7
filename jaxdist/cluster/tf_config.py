"""``TFConfigClusterResolver``: the cluster from the ``TF_CONFIG`` environment variable.

``TF_CONFIG`` is the JSON that Kubeflow's TFJob (and ``python -m jaxdist.launch``) sets on each
task::

    {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]},
     "task": {"type": "worker", "index": 0},
     "rpc_layer": "grpc", "environment": "cloud", "token": "..."}

``"token"`` is a jaxdist extension: the shared secret services of the cluster require.
"""

from __future__ import annotations

import json
import os
from typing import Any

from jaxdist.cluster.cluster_spec import ClusterSpec
from jaxdist.cluster.errors import ClusterConfigError
from jaxdist.cluster.resolver import TOKEN_ENV, ClusterResolver
from jaxdist.cluster.validation import quote, validate_cluster_spec

TF_CONFIG_ENV = "TF_CONFIG"


def parse_tf_config(raw: str | dict | None) -> dict[str, Any]:
    """Parses ``TF_CONFIG`` text (or a dict) and checks its shape.

    Raises:
        ClusterConfigError: not JSON, not an object, or a key of the wrong type; the message
            quotes it.
    """
    if raw is None or raw == "":
        return {}
    if isinstance(raw, str):
        try:
            config = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ClusterConfigError(
                f"TF_CONFIG is not valid JSON ({e.msg} at position {e.pos}): {raw[:200]!r}"
            ) from None
    else:
        config = raw
    if not isinstance(config, dict):
        raise ClusterConfigError(
            f"TF_CONFIG is {quote(config)}: expected a JSON object with \"cluster\" and \"task\""
        )
    cluster = config.get("cluster", {})
    if cluster is not None and not isinstance(cluster, dict):
        raise ClusterConfigError(
            f"TF_CONFIG \"cluster\" is {quote(cluster)}: expected an object of job name -> "
            f"list of \"host:port\""
        )
    task = config.get("task", {})
    if task is not None and not isinstance(task, dict):
        raise ClusterConfigError(
            f"TF_CONFIG \"task\" is {quote(task)}: expected {{\"type\": ..., \"index\": ...}}"
        )
    if task:
        unknown = sorted(set(task) - {"type", "index", "trial"})
        if unknown:
            raise ClusterConfigError(
                f"TF_CONFIG \"task\" is {quote(task)}: unknown key(s) {unknown}; expected "
                f"\"type\" and \"index\""
            )
        if "type" not in task:
            raise ClusterConfigError(
                f"TF_CONFIG \"task\" is {quote(task)}: it has no \"type\" (chief, worker, ps "
                f"or evaluator)"
            )
        index = task.get("index", 0)
        if isinstance(index, str) and index.isdigit():
            index = int(index)
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ClusterConfigError(
                f"TF_CONFIG \"task\" is {quote(task)}: \"index\" must be a non-negative integer"
            )
    for key in ("rpc_layer", "environment", "token"):
        if config.get(key) is not None and not isinstance(config[key], str):
            raise ClusterConfigError(
                f"TF_CONFIG {quote(key)} is {quote(config[key])}: expected a string"
            )
    return config


class TFConfigClusterResolver(ClusterResolver):
    """Reads the cluster and this task from ``TF_CONFIG`` (``TFConfigClusterResolver``).

    ``TF_CONFIG`` is read when the resolver is asked, so it may be set after construction.
    The cluster is validated with TF's rules (see ``jaxdist.cluster.validation``).

    Args:
        task_type: override ``TF_CONFIG["task"]["type"]``.
        task_id: override ``TF_CONFIG["task"]["index"]``.
        rpc_layer: override ``TF_CONFIG["rpc_layer"]``.
        environment: override ``TF_CONFIG["environment"]``.
        tf_config: use this JSON string or dict instead of the environment variable.

    Raises:
        ClusterConfigError: (from ``cluster_spec()``) ``TF_CONFIG`` breaks a rule; the message
            quotes the offending part.

    Example:
        >>> os.environ["TF_CONFIG"] = json.dumps({
        ...     "cluster": {"worker": ["localhost:12345", "localhost:23456"]},
        ...     "task": {"type": "worker", "index": 1}})
        >>> r = TFConfigClusterResolver()
        >>> r.task_type, r.task_id, r.master()
        ('worker', 1, 'localhost:23456')
    """

    def __init__(self, task_type: str | None = None, task_id: int | None = None,
                 rpc_layer: str | None = None, environment: str | None = None,
                 tf_config: str | dict | None = None):
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        self._environment = environment
        self._tf_config = tf_config

    def _config(self) -> dict[str, Any]:
        raw = self._tf_config if self._tf_config is not None else os.environ.get(TF_CONFIG_ENV)
        return parse_tf_config(raw)

    @property
    def task_type(self) -> str | None:  # type: ignore[override]
        if self._task_type is not None:
            return self._task_type
        task = self._config().get("task") or {}
        return task.get("type")

    @task_type.setter
    def task_type(self, value: str | None) -> None:
        self._task_type = value

    @property
    def task_id(self) -> int | None:  # type: ignore[override]
        if self._task_id is not None:
            return self._task_id
        task = self._config().get("task") or {}
        if not task:
            return None
        return int(task.get("index", 0))

    @task_id.setter
    def task_id(self, value: int | None) -> None:
        self._task_id = value

    @property
    def rpc_layer(self) -> str | None:  # type: ignore[override]
        if self._rpc_layer is not None:
            return self._rpc_layer
        return self._config().get("rpc_layer")

    @rpc_layer.setter
    def rpc_layer(self, value: str | None) -> None:
        self._rpc_layer = value

    @property
    def environment(self) -> str:  # type: ignore[override]
        if self._environment is not None:
            return self._environment
        return self._config().get("environment") or ""

    @property
    def cluster_token(self) -> str | None:  # type: ignore[override]
        return self._config().get("token") or os.environ.get(TOKEN_ENV) or None

    def cluster_spec(self) -> ClusterSpec:
        """The cluster of ``TF_CONFIG`` (empty without one), checked with TF's rules."""
        config = self._config()
        cluster = config.get("cluster") or {}
        spec = ClusterSpec(cluster)
        task_type, task_id = self.task_type, self.task_id
        if not spec:
            return spec
        validate_cluster_spec(spec, task_type, task_id, source="TF_CONFIG")
        return spec


__all__ = ["TFConfigClusterResolver", "TF_CONFIG_ENV", "parse_tf_config"]
