"""``TPUClusterResolver``: finds the TPU of a Colab runtime or Cloud TPU VM through JAX."""

from __future__ import annotations

import os
from typing import Any

import jax


class TPUNotFoundError(RuntimeError):
    """No TPU device is visible to JAX."""


def _describe(devs) -> str:
    return ", ".join(f"{d.platform}:{d.id}" for d in devs) or "none"


class TPUClusterResolver:
    """Locates TPU cores (``tf.distribute.cluster_resolver.TPUClusterResolver``).

    On a Cloud TPU VM or a Colab TPU runtime the TPU is attached to the host and JAX's TPU
    backend sees its cores; ``tpu=None``, ``""`` or ``"local"`` means that local TPU.

    Args:
        tpu: ``None`` / ``""`` / ``"local"`` for the local TPU, or a TPU name (recorded, and
            looked up through ``TPU_NAME`` on Cloud TPU VMs).
        zone: GCE zone (recorded for compatibility).
        project: GCP project (recorded for compatibility).
        job_name: the job name used in ``cluster_spec()``.

    Example:
        >>> resolver = jaxdist.cluster_resolver.TPUClusterResolver(tpu="local")
        >>> resolver.num_accelerators()        # on a v5e-8 VM
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
        **kwargs: Any,
    ):
        self.tpu = tpu if tpu is not None else os.environ.get("TPU_NAME", "local")
        self.zone = zone
        self.project = project
        self.task_type = job_name
        self.task_id = 0
        self.rpc_layer = "grpc"
        self.coordinator_name = coordinator_name
        self.coordinator_address = coordinator_address
        self._extra = kwargs

    def devices(self) -> list[Any]:
        """The TPU devices of this host.

        Raises:
            TPUNotFoundError: JAX sees no TPU; the message lists the devices it found.
        """
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
        return ""

    def cluster_spec(self) -> dict[str, list[str]]:
        return {self.task_type: ["localhost:8470"]}

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
            "num_hosts": jax.process_count(),
            "num_of_cores_per_host": len(devs),
            "devices": devs,
        }

    def __repr__(self) -> str:
        return f"TPUClusterResolver(tpu={self.tpu!r})"
