"""``MirroredStrategy``: synchronous data parallelism over the local devices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from jaxdist._src.strategies.cross_device_ops import CrossDeviceOps
from jaxdist._src.strategies.devices import resolve_devices
from jaxdist._src.strategies.strategy import Strategy, StrategyExtended


class MirroredStrategy(Strategy):
    """Synchronous training on several devices of one machine (``tf.distribute.MirroredStrategy``).

    State created under ``scope()`` is replicated on every device (one buffer per device);
    ``run`` executes the step on every device with its slice of the batch; reductions use
    ``cross_device_ops``.

    Args:
        devices: JAX devices or TF device strings (``"/gpu:0"``, ``"/cpu:1"``, ...). ``None``:
            every local device of the default backend.
        cross_device_ops: ``NcclAllReduce()``, ``HierarchicalCopyAllReduce()`` or
            ``ReductionToOneDevice()``. Default: ``NcclAllReduce(num_packs=0)`` (one all-reduce
            per value, which XLA's all-reduce combiner batches).

    Example:
        >>> import jaxdist
        >>> strategy = jaxdist.MirroredStrategy(["/cpu:0", "/cpu:1"])  # doctest: +NEEDS_2_DEVICES
        >>> strategy.num_replicas_in_sync
        2
    """

    def __init__(
        self,
        devices: Sequence[Any] | None = None,
        cross_device_ops: CrossDeviceOps | None = None,
    ):
        devs = resolve_devices(devices, default=jax.local_devices())
        super().__init__(StrategyExtended(self, devs, cross_device_ops))
