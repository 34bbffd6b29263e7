"""``jaxdist.coordinator``: TF's ``tf.distribute.coordinator``.

Example:
    >>> strategy = jaxdist.ParameterServerStrategy(resolver)  # doctest: +SKIP
    >>> coordinator = jaxdist.coordinator.ClusterCoordinator(strategy)  # doctest: +SKIP
"""

from jaxdist._src import publish as _publish
from jaxdist._src.cluster.credentials import (
    CoordinatorKeys,
    WorkerCredential,
    new_coordinator_token,
)
from jaxdist._src.coordinator import (
    CancelledError,
    ClosureInputError,
    ClusterCoordinator,
    CoordinatorError,
    CoordinatorShutdownError,
    JoinTimeoutError,
    PerWorkerDataset,
    PerWorkerIterator,
    PerWorkerValues,
    PSUnavailableError,
    RemoteError,
    RemoteValue,
    RemoteValueStatus,
    UntrustedPickleError,
    WorkerAuthenticationError,
    WorkerUnavailableError,
    get_current_worker_index,
)

__all__ = [
    "CancelledError",
    "ClosureInputError",
    "ClusterCoordinator",
    "CoordinatorError",
    "CoordinatorKeys",
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
    "WorkerCredential",
    "WorkerUnavailableError",
    "get_current_worker_index",
    "new_coordinator_token",
]

_publish(__name__, CancelledError, ClosureInputError, CoordinatorError, CoordinatorShutdownError,
         JoinTimeoutError, RemoteError, UntrustedPickleError, WorkerAuthenticationError,
         WorkerUnavailableError)
