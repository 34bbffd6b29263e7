"""Keras's mixed-sharding warning, without its false alarm on one device.

Keras 3.15 (``JAXTrainer._check_sharding_consistency``, called when a step's state shardings
are gathered) warns "Detected a mix of local (SingleDeviceSharding) and distributed
(mesh-aware) variables. This will cause a 'ValueError: Received incompatible devices for
jitted computation' ..." whenever a Keras distribution is active and some variable's value has
a ``SingleDeviceSharding`` while others have a mesh sharding. Under a strategy of one device
(``OneDeviceStrategy``, ``MirroredStrategy`` over one device, ``CentralStorageStrategy``'s
parameter device) that happens after every ``load_weights`` / ``set_weights`` / ``assign`` of a
host value: Keras's ``distribute_tensor`` keeps an array whose sharding is *equivalent* to the
variable's one-device mesh layout as it is, a ``SingleDeviceSharding`` on that same device.
Nothing is incompatible then (every value is on the one device; the step compiles and runs),
so the warning is wrong. ``wrap_check`` keeps Keras's check and skips it only when every state
sharding spans one and the same device; a real mix (state on different devices) still warns.

The wrapper is one of jaxdist's trainer hooks (``model_strategy.hooks``, active inside jaxdist
scopes only; Keras's check itself runs only under a Keras distribution). Keras versions before
3.15 have no such check and warn nothing: then nothing is wrapped.

Example:
    >>> check = wrap_check(keras_check)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
from typing import Any

from jaxdist._src.compat import keras_internals as ki


def _one_device(*groups: Any) -> bool:
    """Whether every sharding in ``groups`` places its array on the same single device."""
    devices: set = set()
    for group in groups:
        for sharding in group or ():
            device_set = getattr(sharding, "device_set", None)
            if device_set is None:
                return False
            devices |= set(device_set)
            if len(devices) > 1:
                return False
    return True


def wrap_check(original: Any) -> Any:
    """Keras's mixed-sharding check (``original``), skipped for state on one device.

    Example:
        >>> check = wrap_check(keras_check)  # doctest: +SKIP
    """

    @functools.wraps(original)
    def check(self: Any, *shardings: Any, **kwargs: Any) -> Any:
        if ki.hooks_active_here() and _one_device(*shardings, *kwargs.values()):
            return None
        return original(self, *shardings, **kwargs)

    return check


__all__ = ["wrap_check"]
