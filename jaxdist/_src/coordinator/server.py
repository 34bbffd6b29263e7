"""``jaxdist.Server``: run a ps or worker task (``tf.distribute.Server``), and
``python -m jaxdist.server``.

A ps task serves its variables over gRPC on the address the cluster spec gives it, checks the
cluster token on every request, and runs until told to stop (a ``Stop`` RPC, ``stop()``,
SIGTERM or SIGINT). With ``checkpoint_dir`` it restores the latest checkpoint at start.

A worker task (TF2 ``ClusterCoordinator`` mode) serves the worker service: it runs the
functions the coordinator sends (cloudpickle, accepted only when signed by the chief) against
the ps tasks, with its own ``ParameterServerStrategy`` over its local devices. It imports Keras
(when a function needs it) on the JAX backend: it sets ``KERAS_BACKEND=jax`` at start, and
refuses to start when the environment names another backend.

Example:
    $ TF_CONFIG='{"cluster": {"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223"]},
    ...           "task": {"type": "ps", "index": 0}, "token": "s3cret"}' \\
    ...   python -m jaxdist.server --checkpoint_dir /tmp/ckpt
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

from jaxdist._src.cluster.task_info import task_info
from jaxdist._src.coordinator.worker_runtime import WorkerRuntime
from jaxdist._src.coordinator.worker_service import WorkerServer
from jaxdist._src.distributed.exit_codes import SERVER_IGNORES_SIGTERM_ENV
from jaxdist._src.ps.server import ParameterServer
from jaxdist._src.ps.service import ParameterService

log = logging.getLogger("jaxdist.server")


def configure_logging() -> None:
    """A server task's log: jaxdist's own messages from INFO up, other libraries' from
    WARNING up (JAX's INFO lines, such as "Unable to initialize backend 'tpu'" on a machine
    without one, would read as errors in every task's output).

    Example:
        >>> from jaxdist._src.coordinator.server import configure_logging
        >>> configure_logging()
    """
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("jaxdist").setLevel(logging.INFO)

#: Default of ``--checkpoint_root`` (``jaxdist.launch --coordinator`` sets its working directory).
CHECKPOINT_ROOT_ENV = "JAXDIST_PS_CHECKPOINT_ROOT"



def use_keras_jax_backend(task: str) -> None:
    """Makes a worker task import Keras on the JAX backend, whatever the chief's program did.

    The chief's functions unpickle on the worker; those that use Keras import it there. A
    program that sets ``KERAS_BACKEND=jax`` itself (``os.environ`` before ``import keras``)
    sets it in its own process only, and Keras's default backend is TensorFlow, so the worker
    sets ``KERAS_BACKEND=jax`` before anything imports keras.

    Raises:
        ValueError: the environment names another backend, or keras is already imported on
            another backend (one line naming it and the fix).

    Example:
        >>> import os
        >>> from jaxdist._src.coordinator.server import use_keras_jax_backend
        >>> use_keras_jax_backend("worker:0")
        >>> os.environ["KERAS_BACKEND"]
        'jax'
    """
    backend = os.environ.get("KERAS_BACKEND", "")
    if backend and backend != "jax":
        raise ValueError(
            f"{task}: KERAS_BACKEND={backend!r} in the environment, but jaxdist workers run "
            f"Keras on the JAX backend: unset KERAS_BACKEND or set KERAS_BACKEND=jax")
    keras = sys.modules.get("keras")
    loaded = getattr(getattr(keras, "backend", None), "backend", None)
    if callable(loaded) and loaded() != "jax":
        raise ValueError(
            f"{task}: keras was imported on the {loaded()!r} backend before the worker "
            f"started; jaxdist workers run Keras on the JAX backend: set KERAS_BACKEND=jax "
            f"before keras is imported")
    os.environ["KERAS_BACKEND"] = "jax"


def _address(info: Any, job: str, index: int) -> str:
    """The cluster spec's address of ``job:index``; a clear error when the task is not in it."""
    addresses = info.cluster.get(job, [])
    if not 0 <= index < len(addresses):
        raise ValueError(f"task {job}:{index} is not in the cluster: its {job} job has "
                         f"{len(addresses)} tasks {addresses}")
    return addresses[index]

class Server:
    """A ps or worker task of a cluster (``tf.distribute.Server``).

    Args:
        cluster_resolver: a resolver, a ClusterSpec / dict, or ``None`` (read ``TF_CONFIG``).
        job_name: the job (default: the resolver's ``task_type``): ``"ps"``, or ``"worker"``
            (runs the functions a ``ClusterCoordinator`` sends).
        task_index: the task (default: the resolver's ``task_id``).
        protocol: ``"grpc"`` (the only one).
        start: start serving now.
        token: the cluster token (default: the resolver's, else ``$JAXDIST_CLUSTER_TOKEN``).
        checkpoint_dir: restore the latest checkpoint from here at start; default save
            directory.
        strategy_factory: (worker) ``(task_info, timeout) -> strategy`` used to run the
            functions (default: a ``ParameterServerStrategy`` over the local devices).
        tls: the mutual-TLS identity (``jaxdist.TLSConfig``), ``"insecure"``
            for plaintext on loopback, or ``None`` to read TF_CONFIG ``"tls"`` /
            ``JAXDIST_TLS_*`` / ``JAXDIST_INSECURE``.
        coordinator: (worker) a ``jaxdist.coordinator.WorkerCredential`` (the chief's
            public key and this worker's answer key) or the coordinator token (``None``:
            TF_CONFIG ``"coordinator_public_key"`` and ``"coordinator_answer_key"`` /
            ``JAXDIST_COORDINATOR_PUBLIC_KEY`` and ``JAXDIST_COORDINATOR_ANSWER_KEY``).
        checkpoint_root: (ps) the only directory ``Save`` / ``Restore`` requests may use
            (and its subdirectories); default ``checkpoint_dir``.
        limits: (ps) request size, call duration and calls per client
            (``jaxdist.ps.ServerLimits``; default: from the environment).

    Raises:
        ValueError: not a ps task, no token, or the cluster has no such task.
        TLSConfigError: no TLS material and plaintext on loopback not asked for.

    Example:
        >>> import jaxdist
        >>> resolver = jaxdist.cluster_resolver.TFConfigClusterResolver()
        >>> server = jaxdist.Server(resolver)   # on a ps or worker task  # doctest: +SKIP
        >>> server.join()          # until stopped  # doctest: +SKIP
    """

    def __init__(self, cluster_resolver: Any = None, job_name: str | None = None,
                 task_index: int | None = None, protocol: str = "grpc", start: bool = True,
                 *, token: str | None = None, checkpoint_dir: str | None = None,
                 strategy_factory: Any = None, tls: Any = None,
                 coordinator: Any = None, limits: Any = None,
                 checkpoint_root: str | None = None):
        if protocol != "grpc":
            raise ValueError(f"protocol {protocol!r} is not supported: expected 'grpc'")
        if isinstance(cluster_resolver, dict) and "cluster" not in cluster_resolver:
            from jaxdist._src.cluster.task_info import TaskInfo

            info = TaskInfo({k: list(v) for k, v in cluster_resolver.items()}, job_name,
                            task_index or 0, token)
        else:
            info = task_info(cluster_resolver)
        job = job_name or info.task_type
        index = info.task_id if task_index is None else int(task_index)
        self.job = job
        if job == "worker":
            self._init_worker(info, index, token, strategy_factory, start, tls, coordinator)
            return
        if job != "ps":
            raise ValueError(
                f"jaxdist.Server serves ps and worker tasks: job_name must be 'ps' or "
                f"'worker', got {job!r} (the chief runs ParameterServerStrategy and the "
                f"ClusterCoordinator instead)"
            )
        address = _address(info, "ps", index)
        self.task = f"ps:{index}"
        self.service = ParameterService(self.task, checkpoint_dir=checkpoint_dir,
                                        checkpoint_root=checkpoint_root)
        self._server = ParameterServer(self.service, address, token or info.token,
                                       limits=limits, tls=tls)
        if start:
            self.start()

    def _init_worker(self, info: Any, index: int, token: str | None, strategy_factory: Any,
                     start: bool, tls: Any, coordinator: Any) -> None:
        from dataclasses import replace

        address = _address(info, "worker", index)
        self.task = f"worker:{index}"
        use_keras_jax_backend(self.task)
        worker_info = replace(info, task_type="worker", task_id=index,
                              token=token or info.token)
        self.runtime = WorkerRuntime(worker_info, strategy_factory)
        self._server = WorkerServer(self.runtime, address, coordinator, tls=tls)
        self.service = self._server.service
        if start:
            self.start()

    @property
    def target(self) -> str:
        """``grpc://host:port`` of this server."""
        return f"grpc://{self._server.address}"

    @property
    def address(self) -> str:
        return self._server.address

    def start(self) -> None:
        self._server.start()
        log.info("%s serving on %s", self.task, self._server.address)

    def join(self, timeout: float | None = None) -> bool:
        """Blocks until the server stops; returns False if ``timeout`` passed first."""
        return self._server.wait_for_stop(timeout)

    def stop(self) -> None:
        self._server.stop()


def main(argv: list[str] | None = None, strategy_factory: Any = None) -> int:
    """Command-line entry point of ``python -m jaxdist.server``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m jaxdist.server",
        description="Run a jaxdist parameter-server or worker task (cluster from TF_CONFIG).",
    )
    parser.add_argument("--checkpoint_dir", default=None,
                        help="restore the latest checkpoint from here at start")
    parser.add_argument("--task_index", type=int, default=None,
                        help="override TF_CONFIG's task index")
    parser.add_argument("--checkpoint_root", default=os.environ.get(CHECKPOINT_ROOT_ENV),
                        help="(ps) Save/Restore requests may only use this directory and its "
                        f"subdirectories (default: ${CHECKPOINT_ROOT_ENV}, else "
                        "--checkpoint_dir; neither: refused)")
    parser.add_argument("--max_request_bytes", type=int, default=None,
                        help="(ps) payload bytes one request may declare (default: "
                        "$JAXDIST_PS_MAX_REQUEST_BYTES, else 1 GiB or a quarter of RAM)")
    parser.add_argument("--max_call_seconds", type=float, default=None,
                        help="(ps) cancel a call still running after this long (default: "
                        "$JAXDIST_PS_MAX_CALL_SECONDS, else 300)")
    parser.add_argument("--max_calls_per_client", type=int, default=None,
                        help="(ps) calls in flight per client: its TLS certificate, or in "
                        "plaintext its connection (default: $JAXDIST_PS_MAX_CALLS_PER_CLIENT, "
                        "else 8)")
    parser.add_argument("--max_idle_seconds", type=float, default=None,
                        help="(ps) cancel a call whose request or response stream makes no "
                        "progress for this long (default: $JAXDIST_PS_MAX_IDLE_SECONDS, else "
                        "30)")
    args = parser.parse_args(argv)
    configure_logging()
    try:
        from jaxdist._src.transport.limits import ServerLimits

        limits = ServerLimits.from_env(args.max_request_bytes, args.max_call_seconds,
                                       args.max_calls_per_client,
                                       max_idle_seconds=args.max_idle_seconds)
        server = Server(None, task_index=args.task_index, start=False,
                        checkpoint_dir=args.checkpoint_dir, strategy_factory=strategy_factory,
                        limits=limits, checkpoint_root=args.checkpoint_root)
    except (ValueError, OSError) as e:
        print(f"jaxdist.server: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()
        server.service.stopped.set()

    # Under Slurm a preemption's SIGTERM reaches every process of the step: a ps must keep
    # serving while the workers agree where to stop and save; jaxdist.slurm sets
    # SERVER_IGNORES_SIGTERM_ENV and stops it with SIGINT once they have ended.
    ignore_term = os.environ.get(SERVER_IGNORES_SIGTERM_ENV) == "1"
    signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore_term else on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start()
    print(f"jaxdist.server {server.task} listening on {server.address}", flush=True)
    while not server.join(timeout=0.5):
        pass
    server.stop()
    print(f"jaxdist.server {server.task} stopped", flush=True)
    if server.job == "worker" and server.service.busy:
        # A function is still running (e.g. waiting for a lost ps): abandon it, the
        # coordinator runs it again elsewhere. Waiting would hold the exit up to its timeout.
        sys.stderr.flush()
        os._exit(0)
    return 0


__all__ = ["Server", "configure_logging", "main", "use_keras_jax_backend"]
