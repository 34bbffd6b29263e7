"""``CentralStorageStrategy``: one copy of the state, replicated compute."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, SingleDeviceSharding

from jaxdist._src.strategies.devices import resolve_device, resolve_devices
from jaxdist._src.strategies.reduce_util import ReduceOp
from jaxdist._src.strategies.strategy import Strategy, StrategyExtended
from jaxdist._src.values.per_replica import PerReplica


def _default_parameter_device(compute: Sequence[Any]) -> Any:
    if len(compute) == 1:
        return compute[0]
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return compute[0]


class CentralStorageExtended(StrategyExtended):
    """State lives on ``parameter_device``; ``run`` broadcasts it to the compute devices."""

    def __init__(self, strategy, compute_devices, parameter_device):
        super().__init__(strategy, compute_devices)
        self._parameter_device = parameter_device
        self._param_sharding = SingleDeviceSharding(parameter_device)
        self._param_mesh = jax.make_mesh(
            (1,), ("replica",), axis_types=(AxisType.Auto,), devices=[parameter_device]
        )

    @property
    def parameter_devices(self):
        return (self._parameter_device,)

    @property
    def state_sharding(self):
        return self._param_sharding

    def placement_mesh(self):
        return self._param_mesh

    def _scope_context(self):
        # Arrays created under scope() go to the parameter device. A context mesh of the
        # parameter device would clash with the compute mesh of run/reduce under the scope.
        return jax.default_device(self._parameter_device)

    def _post_run(self, out):
        # Outputs that are the same on every replica (new state, reduced gradients) are kept
        # once, on the parameter device: between steps exactly one copy exists.
        def to_param(x):
            if isinstance(x, PerReplica) or not isinstance(x, jax.Array):
                return x
            return jax.device_put(x, self._param_sharding)

        return jax.tree.map(to_param, out, is_leaf=lambda x: isinstance(x, PerReplica))

    def reduce_leaf(self, op, v, axis):
        # Outputs of ``run`` that are the same on every replica are kept once, on the parameter
        # device (``_post_run``): they still stand for one value per replica, as TF's outputs
        # of a central-storage step do (SUM of them is num_replicas x the value).
        if (
            isinstance(v, jax.Array)
            and not isinstance(v, jax.core.Tracer)
            and not self.is_mirrored(v)
            and v.sharding.device_set == self._param_sharding.device_set
        ):
            x = v
            if axis is not None:
                x = jnp.mean(x, axis=axis) if op is ReduceOp.MEAN else jnp.sum(x, axis=axis)
            return x * self._num_replicas if op is ReduceOp.SUM else x
        return super().reduce_leaf(op, v, axis)

    def reduce_to(self, reduce_op, value, destinations=None, options=None):
        if destinations is None:
            destinations = self._param_sharding
        return super().reduce_to(reduce_op, value, destinations, options)


class CentralStorageStrategy(Strategy):
    """State stored once (on the host CPU by default), compute replicated on the devices.

    ``tf.distribute.experimental.CentralStorageStrategy``: variables live on
    ``parameter_device``; each step broadcasts them to the compute devices, gradients are
    reduced onto the parameter device (``extended.reduce_to``), and the update is applied there
    (``extended.update``). Outputs of ``run`` that are identical on every replica are moved to
    the parameter device, so between steps exactly one copy of the state exists.

    Args:
        compute_devices: JAX devices or TF device strings (default: every local device).
        parameter_device: where state lives (default: the host CPU, or the only compute device
            if there is one).

    Example:
        >>> import jaxdist
        >>> import jax.numpy as jnp
        >>> strategy = jaxdist.CentralStorageStrategy(  # doctest: +NEEDS_2_DEVICES
        ...     ["/cpu:0", "/cpu:1"], "/cpu:0")
        >>> with strategy.scope():
        ...     w = jnp.zeros((4,))      # one copy, on /cpu:0
    """

    def __init__(self, compute_devices: Sequence[Any] | None = None, parameter_device: Any = None):
        compute = resolve_devices(compute_devices, default=jax.local_devices())
        param = (
            resolve_device(parameter_device)
            if parameter_device is not None
            else _default_parameter_device(compute)
        )
        super().__init__(CentralStorageExtended(self, compute, param))
