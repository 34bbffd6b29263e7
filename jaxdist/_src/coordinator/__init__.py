"""``jaxdist.coordinator``: TF2's ``tf.distribute.experimental.coordinator`` on jaxdist.

``ClusterCoordinator(strategy)`` schedules functions onto the worker tasks of a
parameter-server cluster and survives worker failures; see ``docs/coordinator.md``.

Example:
    >>> coordinator = jaxdist.coordinator.ClusterCoordinator(strategy)  # doctest: +SKIP
    >>> it = iter(coordinator.create_per_worker_dataset(dataset_fn))  # doctest: +SKIP
    >>> rv = coordinator.schedule(step_fn, args=(it,))  # doctest: +SKIP
    >>> coordinator.join()  # doctest: +SKIP
    >>> rv.fetch()  # doctest: +SKIP
"""

from jaxdist._src.coordinator.answer_codec import UntrustedPickleError
from jaxdist._src.coordinator.cluster_coordinator import (
    ClusterCoordinator,
    PerWorkerDataset,
    PerWorkerIterator,
    get_current_worker_index,
)
from jaxdist._src.coordinator.errors import (
    CancelledError,
    ClosureInputError,
    CoordinatorError,
    CoordinatorShutdownError,
    JoinTimeoutError,
    RemoteError,
    WorkerAuthenticationError,
    WorkerUnavailableError,
)
from jaxdist._src.coordinator.remote_value import PerWorkerValues, RemoteValue, RemoteValueStatus
from jaxdist._src.ps.errors import PSUnavailableError

__all__ = [
    "CancelledError",
    "ClosureInputError",
    "ClusterCoordinator",
    "CoordinatorError",
    "CoordinatorShutdownError",
    "JoinTimeoutError",
    "PSUnavailableError",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "PerWorkerValues",
    "RemoteError",
    "RemoteValue",
    "RemoteValueStatus",
    "UntrustedPickleError",
    "WorkerAuthenticationError",
    "WorkerUnavailableError",
    "get_current_worker_index",
]
