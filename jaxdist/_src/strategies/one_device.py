"""``OneDeviceStrategy``: everything on one device."""

from __future__ import annotations

from typing import Any

from jaxdist._src.strategies.devices import resolve_device
from jaxdist._src.strategies.strategy import Strategy, StrategyExtended


class OneDeviceStrategy(Strategy):
    """Places state and computation on one device (``tf.distribute.OneDeviceStrategy``).

    Args:
        device: a JAX device or TF device string such as ``"/gpu:0"`` or ``"/cpu:0"``.

    Example:
        >>> import jaxdist
        >>> strategy = jaxdist.OneDeviceStrategy("/cpu:0")
        >>> strategy.num_replicas_in_sync
        1
    """

    #: TF's replica context of this strategy runs a merge function in place: a merge_call
    #: inside control flow is allowed (only TF's mirrored replica threads refuse it).
    merge_call_checks_control_flow = False

    def __init__(self, device: Any):
        dev = resolve_device(device)
        super().__init__(StrategyExtended(self, (dev,)))
        self._device = dev

    @property
    def device(self) -> Any:
        return self._device
