"""``jaxdist.coordinator``: TF2's ``tf.distribute.experimental.coordinator``: ``ClusterCoordinator``
schedules functions onto the worker tasks of a parameter-server cluster
([coordinator.md](coordinator.md)), and the coordinator credential ([security.md](security.md)).

Example:
    >>> strategy = jaxdist.ParameterServerStrategy(resolver)  # doctest: +SKIP
    >>> coordinator = jaxdist.coordinator.ClusterCoordinator(strategy)  # doctest: +SKIP
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
from jaxdist._src.publish import publish as _publish
from jaxdist._src.security.credentials import (
    CoordinatorKeys,
    WorkerCredential,
    new_coordinator_token,
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
