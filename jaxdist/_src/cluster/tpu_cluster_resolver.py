"""``TPUClusterResolver``: finds the TPU of a Colab runtime, a Cloud TPU VM or a TPU pod slice.

On one TPU host JAX sees the cores directly. On a pod slice (several hosts, one process each)
Cloud TPU sets ``TPU_WORKER_HOSTNAMES`` (or ``TPU_PROCESS_ADDRESSES``) and ``TPU_WORKER_ID``;
the resolver turns them into a ``worker`` job and ``devices()`` brings up ``jax.distributed``
(coordinator on worker 0, port 8476 as JAX uses) before listing the cores.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax

from jaxdist._src.cluster.cluster_env import ClusterEnvironment
from jaxdist._src.cluster.cluster_spec import ClusterSpec
from jaxdist._src.cluster.errors import ClusterConfigError
from jaxdist._src.cluster.resolver import ClusterResolver

TPU_PORT = 8470
COORDINATOR_PORT = 8476


class TPUNotFoundError(RuntimeError):
    """No TPU device is visible to JAX."""


# How a pod slice's host joins the slice's jax.distributed group: the bring-up
# (jaxdist._src.distributed.bringup.initialize_from_resolver), which sits above this package and
# is registered by jaxdist/__init__.py (register_slice_connector), as the Keras scope hook is.
_slice_connector: Callable[..., Any] | None = None


def register_slice_connector(connect: Callable[..., Any]) -> None:
    """Sets what ``TPUClusterResolver.connect`` calls on a pod slice:
    ``connect(resolver, timeout_seconds=..., cpu_collectives=None)``."""
    global _slice_connector
    _slice_connector = connect


def _describe(devs) -> str:
    return ", ".join(f"{d.platform}:{d.id}" for d in devs) or "none"


class TPUClusterResolver(ClusterResolver):
    """Locates TPU cores (``tf.distribute.cluster_resolver.TPUClusterResolver``).

    On a Cloud TPU VM or a Colab TPU runtime the TPU is attached to the host and JAX's TPU
    backend sees its cores; ``tpu=None``, ``""`` or ``"local"`` means that local TPU. On a pod
    slice the hosts come from ``worker_hostnames`` or ``$TPU_WORKER_HOSTNAMES`` and this host's
    index from ``$TPU_WORKER_ID``; ``devices()`` then joins the slice's ``jax.distributed``
    group and returns this host's cores (``jax.devices()`` lists the whole slice).

    Args:
        tpu: ``None`` / ``""`` / ``"local"`` for the local TPU, or a TPU name (recorded, and
            looked up through ``TPU_NAME`` on Cloud TPU VMs).
        zone: GCE zone (recorded for compatibility).
        project: GCP project (recorded for compatibility).
        job_name: the job name used in ``cluster_spec()``.
        worker_hostnames: the pod slice's hosts (default: ``$TPU_WORKER_HOSTNAMES``).
        worker_id: this host's index in the slice (default: ``$TPU_WORKER_ID``, else 0).

    Example:
        >>> import jaxdist
        >>> resolver = jaxdist.cluster_resolver.TPUClusterResolver(tpu="local")
        >>> resolver.num_accelerators()        # on a v5e-8 VM  # doctest: +SKIP
        {'TPU': 8}
    """

    def __init__(
        self,
        tpu: str | None = None,
        zone: str | None = None,
        project: str | None = None,
        job_name: str = "worker",
        coordinator_name: str | None = None,
        coordinator_address: str | None = None,
        worker_hostnames: list[str] | str | None = None,
        worker_id: int | None = None,
        **kwargs: Any,
    ):
        self.tpu = tpu if tpu is not None else os.environ.get("TPU_NAME", "local")
        self.zone = zone
        self.project = project
        self.task_type = job_name
        self.rpc_layer = "grpc"
        self.environment = ""
        self.coordinator_name = coordinator_name
        self._coordinator_address = coordinator_address
        self._extra = kwargs
        hosts = worker_hostnames
        if hosts is None:
            hosts = os.environ.get("TPU_PROCESS_ADDRESSES") or os.environ.get(
                "TPU_WORKER_HOSTNAMES"
            )
        if isinstance(hosts, str):
            hosts = [h.strip() for h in hosts.split(",") if h.strip()]
        self.worker_hostnames: list[str] = [h.rsplit(":", 1)[0] if h.count(":") == 1 else h
                                            for h in (hosts or [])]
        if worker_id is None:
            raw = os.environ.get("TPU_WORKER_ID", "0")
            try:
                worker_id = int(raw)
            except ValueError:
                raise ClusterConfigError(
                    f"TPU_WORKER_ID={raw!r}: expected this host's index in the pod slice"
                ) from None
        self.task_id = int(worker_id)
        if self.worker_hostnames and not 0 <= self.task_id < len(self.worker_hostnames):
            raise ClusterConfigError(
                f"TPU worker id {self.task_id} is not an index of the slice's hosts "
                f"{self.worker_hostnames}"
            )

    @property
    def is_pod_slice(self) -> bool:
        """True when the TPU spans several hosts (one process each)."""
        return len(self.worker_hostnames) > 1

    def coordinator_address(self) -> str:
        """Where the slice's ``jax.distributed`` coordinator listens (worker 0, port 8476)."""
        if self._coordinator_address:
            return self._coordinator_address
        host = self.worker_hostnames[0] if self.worker_hostnames else "localhost"
        return f"{host}:{COORDINATOR_PORT}"

    def connect(self, timeout_seconds: float | None = None) -> None:
        """Joins the pod slice's ``jax.distributed`` group (no-op on one host)."""
        if self.is_pod_slice:
            if _slice_connector is None:
                raise ClusterConfigError(
                    "TPUClusterResolver.connect: no bring-up is registered to join the pod "
                    "slice; import jaxdist (it registers jax.distributed's bring-up)")
            _slice_connector(self, timeout_seconds=timeout_seconds, cpu_collectives=None)

    def devices(self) -> list[Any]:
        """The TPU devices of this host.

        Raises:
            TPUNotFoundError: JAX sees no TPU; the message lists the devices it found.
        """
        self.connect()
        try:
            tpus = jax.devices("tpu")
        except RuntimeError:
            tpus = []
        if not tpus:
            raise TPUNotFoundError(
                f"No TPU found (tpu={self.tpu!r}): JAX sees devices [{_describe(jax.devices())}]. "
                f"Run on a Cloud TPU VM or a Colab TPU runtime, or pass devices explicitly "
                f"(TPUStrategy(devices=jax.devices('cpu')))."
            )
        return [d for d in tpus if d.process_index == jax.process_index()]

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """``""`` for the local TPU; ``grpc://host:8470`` of a task on a pod slice."""
        if not self.is_pod_slice:
            return ""
        return super().master(task_type, task_id, rpc_layer)

    def cluster_spec(self) -> ClusterSpec:
        """``{job_name: ["host:8470", ...]}``: one task per TPU host."""
        hosts = self.worker_hostnames or ["localhost"]
        return ClusterSpec({self.task_type: [f"{h}:{TPU_PORT}" for h in hosts]})

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None
    ) -> dict[str, int]:
        try:
            return {"TPU": len(self.devices())}
        except TPUNotFoundError:
            return {}

    def get_tpu_system_metadata(self) -> dict[str, Any]:
        devs = self.devices()
        return {
            "num_cores": len(jax.devices("tpu")),
            "num_hosts": max(jax.process_count(), len(self.worker_hostnames) or 1),
            "num_of_cores_per_host": len(devs),
            "devices": devs,
        }

    def __repr__(self) -> str:
        if self.is_pod_slice:
            return (
                f"TPUClusterResolver(tpu={self.tpu!r}, worker {self.task_id} of "
                f"{self.worker_hostnames})"
            )
        return f"TPUClusterResolver(tpu={self.tpu!r})"


class TPUEnvironment(ClusterEnvironment):
    """A Cloud TPU host that knows its slice: ``TPU_PROCESS_ADDRESSES`` or
    ``TPU_WORKER_HOSTNAMES`` is set (``TPUClusterResolver()`` reads them)."""

    name = "tpu"
    priority = 30
    variables = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")

    @classmethod
    def resolver(cls) -> TPUClusterResolver:
        return TPUClusterResolver()
