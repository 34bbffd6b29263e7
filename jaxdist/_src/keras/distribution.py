"""``StrategyDistribution``: a Keras ``DataParallel`` that uses a jaxdist strategy's mesh.

Keras's JAX trainer jits its train step with the shardings its distribution gives variables
and batches. Using the strategy's own mesh (explicit axes, entered by ``strategy.scope()``)
keeps one mesh in play: variables are replicated as the strategy keeps state, each global
batch is split along the replica axes, and XLA inserts the gradient all-reduce, so the loss
and gradients are those of the global batch (as TF's Keras under ``MirroredStrategy``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import keras
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist._src.compat import keras_internals as ki
from jaxdist._src.keras import central_storage, model_strategy
from jaxdist._src.strategies.central_storage import CentralStorageStrategy
from jaxdist._src.strategies.strategy import Strategy


class _Layout:
    """What Keras's JAX data iterator reads from a data layout: ``backend_layout``."""

    def __init__(self, sharding: NamedSharding):
        self.backend_layout = sharding


def unsupported_reason(strategy: Any) -> str | None:
    """Why Keras fit cannot follow ``strategy`` as a data-parallel distribution (or None)."""
    from jaxdist._src.strategies.parameter_server import ParameterServerStrategy

    if isinstance(strategy, ParameterServerStrategy):
        return (
            "a Keras model trains on parameter servers through "
            "jaxdist.keras.attach(model, strategy) after model.compile, not a scope"
        )
    if getattr(strategy, "compile_only", False):
        return (
            "a compile-only TPUStrategy (a TPU topology without a TPU) keeps Keras variables "
            "on the host and cannot fit; jaxdist.keras.compile_fit_step(model, x, y) compiles "
            "the fit step for it"
        )
    return None


def _check_supported(strategy: Any) -> None:
    if not isinstance(strategy, Strategy):
        raise TypeError(f"expected a jaxdist strategy, got {strategy!r}")
    why = unsupported_reason(strategy)
    if why is not None:
        raise NotImplementedError(f"jaxdist.keras with {type(strategy).__name__}: {why}")


class StrategyDistribution(keras.distribution.DataParallel):
    """Keras data parallelism over ``strategy.extended.mesh``.

    Args:
        strategy: ``MirroredStrategy``, ``OneDeviceStrategy``, ``TPUStrategy`` or
            ``CentralStorageStrategy`` (variables on its parameter device, see
            ``jaxdist._src.keras.central_storage``).

    Raises:
        NotImplementedError: the strategy is one Keras fit does not support yet (the message
            says which and what to use).

    Example:
        >>> import jaxdist, keras  # doctest: +NEEDS_KERAS
        >>> from jaxdist._src.keras.distribution import StrategyDistribution
        >>> with StrategyDistribution(jaxdist.MirroredStrategy()).scope():
        ...     model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    """

    #: Marks the distributions whose models pad and mask partial batches (``partial_batches``
    #: reads it from Keras's current distribution; other distributions lack it).
    masks_partial_batches = True

    def __init__(self, strategy: Strategy):
        _check_supported(strategy)
        ext = strategy.extended
        mesh = ext.mesh
        names = [f"{d.platform}:{d.id}" for d in mesh.devices.flat]
        device_mesh = keras.distribution.DeviceMesh(
            tuple(mesh.devices.shape), list(mesh.axis_names), names
        )
        # Keras would build an Auto-axes twin of the mesh; the strategy's scope has entered
        # its explicit mesh, and jit requires the two to match, so hand Keras the same one.
        ki.set_backend_mesh(device_mesh, mesh)
        # DataParallel takes 1-D meshes only (and its warning for others raises a TypeError in
        # Keras 3.x); a hierarchical all-reduce mesh has two replica axes, so initialise with a
        # flat twin and then keep the real mesh (data layouts span every replica axis).
        flat = keras.distribution.DeviceMesh((len(names),), [mesh.axis_names[0]], names)
        super().__init__(device_mesh=flat)
        # Across processes each one feeds its own rows of every global batch (as each TF worker
        # reads its shard of the dataset); Keras would otherwise want a tf.data dataset to shard.
        self.auto_shard_dataset = False
        self._device_mesh = device_mesh
        self._strategy = strategy
        self._data_sharding = NamedSharding(mesh, P(ext.replica_axis_names))
        self._state_sharding = ext.state_sharding
        self._central = isinstance(strategy, CentralStorageStrategy)
        if self._central:
            # Keras wants a mesh-backed layout: the parameter device's own one-device mesh.
            self._state_sharding = NamedSharding(ext.placement_mesh(), P())

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Keras's ``Distribution.scope()``, with jaxdist's trainer hooks active inside it
        (partial batches, the model's strategy kept outside the scope; see
        ``jaxdist._src.keras.model_strategy``).

        Example:
            >>> with StrategyDistribution(strategy).scope():  # doctest: +SKIP
            ...     model.fit(x, y)
        """
        with model_strategy.hooks(), super().scope():
            yield

    @property
    def strategy(self) -> Strategy:
        """The jaxdist strategy this distribution follows."""
        return self._strategy

    @property
    def batch_sharding(self) -> NamedSharding:
        """The sharding of a global batch: its rows split over the strategy's replicas."""
        return self._data_sharding

    @property
    def num_model_replicas(self) -> int:
        return self._strategy.num_replicas_in_sync

    def get_data_layout(self, data_shape: Any) -> Any:
        # Keras hands each process's own rows (make_array_from_process_local_data).
        me = jax.process_index()
        n = sum(d.process_index == me for d in self._strategy.extended.worker_devices)
        if data_shape and data_shape[0] is not None and data_shape[0] % n:
            # fit / evaluate / predict pad such batches (partial_batches); train_on_batch and
            # test_on_batch hand Keras's own data path the batch as it is.
            raise ValueError(
                f"a batch of {data_shape[0]} rows cannot be split over {n} replicas of "
                f"{self._strategy!r}: use a batch divisible by {n}, or fit / evaluate / "
                f"predict, which pad and mask a partial batch"
            )
        return _Layout(self._data_sharding)

    def get_variable_layout(self, variable: Any) -> Any:
        layout = ki.explicit_layout(variable)
        if layout is not None:
            return layout
        if self._central:
            central_storage.mark_central(variable, self._strategy)
        return self._state_sharding

    def get_tensor_layout(self, path: str) -> Any:
        return None

    def __repr__(self) -> str:
        return f"StrategyDistribution({self._strategy!r})"
