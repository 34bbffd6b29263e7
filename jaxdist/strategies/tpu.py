"""``TPUStrategy`` and the TF TPU entry points (``initialize_tpu_system``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxdist.cluster.tpu_cluster_resolver import TPUClusterResolver
from jaxdist.strategies.devices import resolve_devices
from jaxdist.strategies.strategy import Strategy, StrategyExtended


class TPUStrategy(Strategy):
    """Synchronous training on the cores of a TPU (``tf.distribute.TPUStrategy``).

    Mirrored over the TPU cores the resolver finds. Pass ``steps_per_execution`` to the
    Trainer to fold several steps into one compiled dispatch, as TF's TPU guide recommends.

    Args:
        tpu_cluster_resolver: a ``TPUClusterResolver`` (default: the local TPU).
        experimental_device_assignment: accepted for compatibility (the core order of the mesh).
        devices: run on these devices instead of the resolver's TPU cores (e.g. CPU devices for
            tests).

    Raises:
        TPUNotFoundError: no TPU is attached and ``devices`` was not given; the message lists
            the devices found.

    Example:
        >>> resolver = jaxdist.cluster_resolver.TPUClusterResolver(tpu="local")
        >>> jaxdist.tpu.initialize_tpu_system(resolver)
        >>> strategy = jaxdist.TPUStrategy(resolver)
    """

    #: TF's replica context of this strategy runs a merge function in place: a merge_call
    #: inside control flow is allowed (only TF's mirrored replica threads refuse it).
    _merge_call_checks_control_flow = False

    def __init__(
        self,
        tpu_cluster_resolver: TPUClusterResolver | None = None,
        experimental_device_assignment: Any = None,
        experimental_spmd_xla_partitioning: bool = False,
        devices: Sequence[Any] | None = None,
    ):
        self._resolver = tpu_cluster_resolver or TPUClusterResolver()
        if devices is None:
            devs = tuple(self._resolver.devices())
        else:
            devs = resolve_devices(devices)
        self._device_assignment = experimental_device_assignment
        super().__init__(StrategyExtended(self, devs))

    @property
    def cluster_resolver(self) -> TPUClusterResolver:
        return self._resolver


def initialize_tpu_system(cluster_resolver: TPUClusterResolver | None = None) -> dict[str, Any]:
    """Checks the TPU is there and returns its metadata (TF's ``tpu.experimental.initialize...``).

    JAX initialises the TPU runtime itself; on one TPU host this verifies the cores are visible.

    Raises:
        TPUNotFoundError: no TPU is visible; the message lists the devices found.

    Example:
        >>> meta = jaxdist.tpu.initialize_tpu_system()
        >>> meta["num_cores"]
        8
    """
    resolver = cluster_resolver or TPUClusterResolver()
    return resolver.get_tpu_system_metadata()


def shutdown_tpu_system(cluster_resolver: TPUClusterResolver | None = None) -> None:
    """No-op: JAX owns the TPU runtime's lifetime (kept for TF compatibility).

    Example:
        >>> jaxdist.tpu.shutdown_tpu_system()
    """
    del cluster_resolver


def experimental_connect_to_cluster(cluster_resolver: Any, **kwargs: Any) -> None:
    """TF's ``tf.config.experimental_connect_to_cluster``.

    For a TPU resolver on one host this checks the TPU is there. A resolver that names several
    processes brings up ``jax.distributed`` (see ``jaxdist.cluster``).

    Example:
        >>> resolver = jaxdist.cluster_resolver.TPUClusterResolver(tpu="local")
        >>> jaxdist.experimental_connect_to_cluster(resolver)
    """
    del kwargs
    if isinstance(cluster_resolver, TPUClusterResolver):
        cluster_resolver.devices()
        return
    from jaxdist.cluster import initialize_from_resolver  # multi-host bring-up

    initialize_from_resolver(cluster_resolver)
