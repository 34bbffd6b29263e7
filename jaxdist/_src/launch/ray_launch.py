"""``python -m jaxdist.launch --backend ray``: every task of a cluster as a Ray actor.

The local launcher's job (``launcher.py``: which task runs what, prefixed output, exit codes,
``--max-restarts``, Ctrl-C) with the tasks on the nodes of a Ray cluster instead of this
machine's processes:

1. joins the Ray cluster at ``address`` (``ray.init(address=...)``), or starts a local Ray
   and shuts it down at the end;
2. reserves one placement-group bundle per task (``cpus_per_task`` CPUs, ``gpus_per_task``
   GPUs; strategy ``SPREAD`` by default: the tasks go to as many nodes as possible,
   ``STRICT_SPREAD`` one per node) and creates one ``ray_actor.TaskRunner`` actor in each;
3. asks every actor for its node's address and a port free there, and builds ``TF_CONFIG``'s
   cluster from them (``worker:1`` at ``<its node's address>:<that port>``);
4. per task, a certificate from a throwaway CA (kept in memory) valid for its node's address
   and host name, the cluster token, and the chief's coordinator token or a worker's public
   key and answer key, all handed to that task's actor alone as arguments of its ``start``
   call (Ray's object store), which writes the TLS files to a private directory on its node
   and runs the command with the rest in its environment only. Nothing secret is in an
   actor's options, name, ``runtime_env``, a command line or the output;
5. prints every line of every task prefixed with its name, fetched from the actors, and
   supervises them as the local launcher does: exit codes, ``max_restarts``, SIGINT -> 130.
   A task whose actor (or node) is lost is reported as ``RayTaskLostError`` naming it; with no
   restart left the launch raises it (``python -m jaxdist.launch`` prints it and exits 1).

Example:
    >>> from jaxdist._src.launch.ray_launch import placement_bundles
    >>> placement_bundles(3, cpus_per_task=2, gpus_per_task=0)
    [{'CPU': 2.0}, {'CPU': 2.0}, {'CPU': 2.0}]
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jaxdist._src.cluster.errors import ClusterConfigError, ClusterError, ClusterTimeoutError
from jaxdist._src.cluster.validation import task_name
from jaxdist._src.launch.launcher import (
    CHECKPOINT_ROOT_ENV,
    PLACEMENT_STRATEGIES,
    Launcher,
    command_not_found,
    launcher_options,
)
from jaxdist._src.launch.local import task_env, task_list
from jaxdist._src.launch.ray_actor import TaskRunner
from jaxdist._src.security.pki import TaskCA, apply_task_security
from jaxdist._src.security.tls import INSECURE_ENV

#: What to install for ``--backend ray``.
INSTALL_HINT = "pip install 'jaxdist[ray]'"
#: The oldest Ray the backend supports.
MIN_RAY_VERSION = (2, 9)
#: Seconds an actor may take to answer one call before its task counts as lost.
DEFAULT_LOST_TIMEOUT = 60.0


class RayTaskLostError(ClusterError):
    """A task's Ray actor, or its node, was lost (or stopped answering) while the task ran.

    Attributes:
        task: the task's name (``"worker:1"``).
        node: the address of the node it ran on.
    """

    def __init__(self, task: str, node: str, reason: str):
        super().__init__(f"{task} (Ray actor on node {node}) was lost: {reason}")
        self.task = task
        self.node = node


def import_ray() -> Any:
    """The ``ray`` module, or a ``ClusterConfigError`` that says what to install.

    Raises:
        ClusterConfigError: Ray is not installed, or older than ``MIN_RAY_VERSION``.
    """
    try:
        import ray
    except ImportError as e:
        raise ClusterConfigError(f"--backend ray needs Ray, which is not installed ({e}): "
                                 f"{INSTALL_HINT}") from None
    version = tuple(int(p) for p in ray.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_RAY_VERSION:
        raise ClusterConfigError(f"--backend ray needs Ray >= "
                                 f"{'.'.join(map(str, MIN_RAY_VERSION))}, found "
                                 f"{ray.__version__}: {INSTALL_HINT}")
    return ray


def forwarded_env(specs: Sequence[str],
                  environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``--env NAME=VALUE`` / ``--env NAME`` (this process's value) as a dict.

    Raises:
        ClusterConfigError: a bad name, or ``NAME`` alone that this process does not have.

    Example:
        >>> from jaxdist._src.launch.ray_launch import forwarded_env
        >>> forwarded_env(["JAX_PLATFORMS=cpu", "HOME"], {"HOME": "/home/a"})
        {'JAX_PLATFORMS': 'cpu', 'HOME': '/home/a'}
    """
    environ = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for spec in specs:
        name, eq, value = spec.partition("=")
        if not name or not (name[0].isalpha() or name[0] == "_") or not all(
                c.isalnum() or c == "_" for c in name):
            raise ClusterConfigError(f"--env {spec!r}: expected NAME=VALUE or NAME (letters, "
                                     f"digits and _)")
        if not eq and name not in environ:
            raise ClusterConfigError(f"--env {name}: {name} is not set here; expected "
                                     f"NAME=VALUE or a variable of this environment")
        out[name] = value if eq else environ[name]
    return out


def placement_bundles(tasks: int, cpus_per_task: float = 1.0,
                      gpus_per_task: float = 0.0) -> list[dict[str, float]]:
    """One placement-group bundle per task.

    Raises:
        ClusterConfigError: a count that is not a number >= 0 (CPUs: > 0).

    Example:
        >>> from jaxdist._src.launch.ray_launch import placement_bundles
        >>> placement_bundles(2, cpus_per_task=1, gpus_per_task=1)
        [{'CPU': 1.0, 'GPU': 1.0}, {'CPU': 1.0, 'GPU': 1.0}]
    """
    if not 0 < float(cpus_per_task) < float("inf"):
        raise ClusterConfigError(f"cpus_per_task must be a number > 0, got {cpus_per_task!r}")
    if not 0 <= float(gpus_per_task) < float("inf"):
        raise ClusterConfigError(f"gpus_per_task must be a number >= 0, got {gpus_per_task!r}")
    bundle = {"CPU": float(cpus_per_task)}
    if gpus_per_task:
        bundle["GPU"] = float(gpus_per_task)
    return [dict(bundle) for _ in range(tasks)]


def cluster_from_placement(names: Sequence[str],
                           places: dict[str, tuple[str, int]]) -> dict[str, list[str]]:
    """``TF_CONFIG``'s cluster from each task's ``(node address, port)``.

    Raises:
        ClusterConfigError: a task has no place, or two tasks share an address.

    Example:
        >>> from jaxdist._src.launch.ray_launch import cluster_from_placement
        >>> cluster_from_placement(["worker:0", "worker:1", "ps:0"],
        ...     {"worker:0": ("10.0.0.1", 9000), "worker:1": ("10.0.0.2", 9000),
        ...      "ps:0": ("10.0.0.1", 9001)})
        {'worker': ['10.0.0.1:9000', '10.0.0.2:9000'], 'ps': ['10.0.0.1:9001']}
    """
    cluster: dict[str, list[str]] = {}
    seen: dict[str, str] = {}
    for name in names:
        if name not in places:
            raise ClusterConfigError(f"task {name} has no place in the Ray cluster (placed: "
                                     f"{sorted(places)})")
        host, port = places[name]
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if address in seen:
            raise ClusterConfigError(f"tasks {seen[address]} and {name} were both given "
                                     f"{address}: expected one free port per task")
        seen[address] = name
        job, index = name.split(":")
        cluster.setdefault(job, []).append(address)
        if len(cluster[job]) != int(index) + 1:
            raise ClusterConfigError(f"task {name} is out of order in {list(names)}: expected "
                                     f"{job}:0 ... in order")
    return cluster


class RayTask:
    """The launcher's handle on one task's actor: what the local launcher's supervisor uses of
    a ``TaskProcess`` (``returncode``, ``running``, ``signal``, ``kill``, ``wait``), fed by
    the launcher's poller.

    Attributes:
        name: the task's name.
        node: the address of its node.
        lost: the ``RayTaskLostError`` once its actor was lost, else ``None``.
    """

    def __init__(self, name: str, actor: Any, node: str):
        self.name = name
        self.actor = actor
        self.node = node
        self.code: int | None = None
        self.lost: RayTaskLostError | None = None

    @property
    def returncode(self) -> int | None:
        return self.code

    def running(self) -> bool:
        return self.code is None

    def signal(self, sig: int) -> None:
        """Sends ``sig`` to the task's process group, on its node (nothing once ended)."""
        if self.code is None:
            try:
                self.actor.signal.remote(int(sig))
            except Exception:  # a dead actor: its task is reported by the poller
                pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code, or ``None`` if still running after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.code is None and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.05)
        return self.code


class RayLauncher(Launcher):
    """Runs a command as every task of a cluster of Ray actors (see the module docstring).

    Args:
        command: the command (as for ``Launcher``).
        address: the Ray cluster (``HOST:PORT``); ``None`` starts a local Ray and shuts it
            down at the end (an already initialised Ray, e.g. in a notebook, is used as is).
        cpus_per_task: Ray CPUs each task reserves.
        gpus_per_task: Ray GPUs each task reserves (Ray sets ``CUDA_VISIBLE_DEVICES``).
        placement: the placement group's strategy: ``"SPREAD"``, ``"STRICT_SPREAD"`` or
            ``"PACK"``.
        placement_timeout: seconds to wait for Ray to place every task.
        lost_timeout: seconds an actor may take to answer before its task counts as lost.
        env: variables to set in every task (a task starts from its node's environment, as
            its raylet has it, not from this process's).
        **options: the ``Launcher`` options (``workers``, ``ps``, ``coordinator``,
            ``max_restarts`` ...).
    """

    def __init__(self, command: Sequence[str], address: str | None = None,
                 cpus_per_task: float = 1.0, gpus_per_task: float = 0.0,
                 placement: str = "SPREAD", placement_timeout: float = 120.0,
                 lost_timeout: float = DEFAULT_LOST_TIMEOUT,
                 env: Mapping[str, str] | None = None, **options: Any):
        super().__init__(command, **options)
        if placement not in PLACEMENT_STRATEGIES:
            raise ClusterConfigError(f"placement {placement!r} is not one of "
                                     f"{', '.join(PLACEMENT_STRATEGIES)}")
        self.names = [task_name(j, i) for j, i in task_list(self.cluster)]
        self.bundles = placement_bundles(len(self.names), cpus_per_task, gpus_per_task)
        self.address = address
        self.placement = placement
        self.placement_timeout = float(placement_timeout)
        self.lost_timeout = float(lost_timeout)
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self._ray: Any = None
        self._owns_ray = False
        self._pg: Any = None
        self._actors: dict[str, Any] = {}
        self._lost_actors: list[Any] = []  # killed at teardown, never waited for
        self._where: dict[str, dict] = {}
        self._ca: TaskCA | None = None
        self._handles: list[RayTask] = []  # the running tasks the poller follows
        self._handles_lock = threading.Lock()
        self._poller: threading.Thread | None = None
        self._stop_polling = threading.Event()

    def _fresh_cluster(self) -> dict[str, list[str]]:
        # The shape only: start() places the tasks and fills in their addresses.
        workers, ps, chief, evaluator = self._counts
        if workers < 0 or ps < 0 or (workers == 0 and not chief):
            raise ClusterConfigError(f"a cluster needs at least one chief or worker task "
                                     f"(workers={workers}, chief={chief}, ps={ps})")
        counts = {"chief": int(chief), "worker": workers, "ps": ps, "evaluator": int(evaluator)}
        return {job: ["(not placed)"] * n for job, n in counts.items() if n}

    # -- Ray --------------------------------------------------------------------------------

    def _connect(self) -> None:
        ray = self._ray = import_ray()
        if ray.is_initialized():
            return
        if self.address:
            ray.init(address=self.address, log_to_driver=False, logging_level="WARNING")
        else:
            need = int(sum(b["CPU"] for b in self.bundles) + 0.999)
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, need),
                     include_dashboard=False, log_to_driver=False, logging_level="WARNING")
            self._owns_ray = True

    def _place_actors(self) -> None:
        """The placement group and one actor per task (those missing or lost)."""
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self._pg is None:
            self._pg = placement_group(self.bundles, strategy=self.placement)
            ready = self._pg.ready()
            deadline = time.monotonic() + self.placement_timeout
            while not ray.wait([ready], timeout=0.5)[0]:
                if self._interrupted is not None:
                    return
                if time.monotonic() > deadline:
                    raise ClusterTimeoutError(
                        f"Ray could not place {len(self.bundles)} tasks ({self.bundles[0]} "
                        f"each, {self.placement}) within {self.placement_timeout:g} s: the "
                        f"cluster has {ray.available_resources()} free; expected enough "
                        f"nodes and resources (--cpus-per-task, --gpus-per-task, "
                        f"--placement)")
        runner = ray.remote(TaskRunner)
        for k, name in enumerate(self.names):
            if name in self._actors:
                continue
            b = self.bundles[k]
            self._actors[name] = runner.options(
                num_cpus=b["CPU"], num_gpus=b.get("GPU", 0), max_restarts=0,
                max_concurrency=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=k)).remote(name)

    def _call(self, name: str, method: str, *args: Any, timeout: float | None = None) -> Any:
        """One call on task ``name``'s actor; a lost actor raises ``RayTaskLostError``."""
        ray = self._ray
        ref = getattr(self._actors[name], method).remote(*args)
        wait = self.lost_timeout if timeout is None else timeout
        # ActorUnavailableError (Ray >= 2.30): the actor's node is unreachable for now
        lost = (ray.exceptions.RayActorError,
                getattr(ray.exceptions, "ActorUnavailableError", ray.exceptions.RayActorError))
        actor = self._actors[name]
        try:
            return ray.get(ref, timeout=wait)
        except ray.exceptions.GetTimeoutError:
            self._forget_actor(name, actor)
            raise RayTaskLostError(name, self._node(name), f"its actor did not answer "
                                   f"{method}() within {wait:g} s") from None
        except lost as e:
            self._forget_actor(name, actor)
            raise RayTaskLostError(name, self._node(name), _first_line(e)) from None

    def _forget_actor(self, name: str, actor: Any) -> None:
        """Task ``name``'s ``actor`` is lost: a restart places a new one, and the teardown
        kills it without waiting for an answer (its node may be gone or unreachable)."""
        if actor is not None and self._actors.get(name) is actor:
            self._actors.pop(name, None)
            self._lost_actors.append(actor)

    def _node(self, name: str) -> str:
        return str(self._where.get(name, {}).get("address", "(not placed)"))

    # -- the launcher's hooks ---------------------------------------------------------------

    def start(self) -> None:
        """Places every task, builds their cluster, and starts them."""
        self._place_actors()
        if self._interrupted is not None:
            return
        places = {}
        for name in self.names:  # where first: an actor answers once it runs on its node
            self._where[name] = self._call(name, "where", timeout=self.placement_timeout)
            places[name] = (str(self._where[name]["address"]), self._call(name, "free_port"))
        self.cluster = cluster_from_placement(self.names, places)
        if not self.insecure and self._ca is None:
            self._ca = TaskCA()
        if "ps" in self.cluster:
            os.makedirs(self.checkpoint_root, exist_ok=True)
        if self._poller is None:
            self._poller = threading.Thread(target=self._poll, name="ray-poll", daemon=True)
            self._poller.start()
        for name in self.names:  # before any task runs: its output comes after its place
            w = self._where[name]
            self._say(f"{name} runs on node {w['address']} (Ray node {w['node_id']}, host "
                      f"{w['hostname']}, actor pid {w['pid']})")
        for job, i in task_list(self.cluster):
            self._start_task(job, i)
        self._say(f"started {', '.join(self.tasks)} on {self.cluster}")
        if "ps" in self.cluster:
            self._say(f"ps tasks checkpoint under {self.checkpoint_root}")

    def _start_task(self, job: str, i: int) -> None:
        name = task_name(job, i)
        overlay = task_env(self.cluster, job, i, self.token, self.devices_per_process,
                           base=self.env)
        apply_task_security(overlay, job, i, None, self.coordinator_token)
        if not self.insecure:
            overlay.pop(INSECURE_ENV, None)
        overlay[CHECKPOINT_ROOT_ENV] = self.checkpoint_root
        pems = None
        if self._ca is not None:
            w = self._where[name]
            cert, key = self._ca.issue(name, [str(w["address"]), str(w["hostname"])])
            pems = (self._ca.ca_pem, cert, key)
        try:
            if name not in self._actors:  # a task restarted alone, whose actor was lost
                self._replace_actor(name)
        except RayTaskLostError as e:
            handle = RayTask(name, None, self._node(name))
            self.tasks[name] = handle
            self._mark_lost(handle, e)
            return
        handle = RayTask(name, self._actors[name], self._node(name))
        self.tasks[name] = handle
        try:
            self._call(name, "start", self.argv_for(job), overlay, pems, os.getcwd())
        except RayTaskLostError as e:
            self._mark_lost(handle, e)
            return
        except self._ray.exceptions.RayTaskError as e:  # the command could not start
            self._say(f"{name}: {_first_line(e.cause if hasattr(e, 'cause') else e)}")
            handle.code = 127
            return
        with self._handles_lock:
            self._handles.append(handle)

    def _replace_actor(self, name: str) -> None:
        """A new actor for task ``name`` (restarted alone: it keeps its address), in its
        bundle; ``RayTaskLostError`` when Ray put it on another node."""
        old = self._node(name)
        self._place_actors()
        self._where[name] = self._call(name, "where", timeout=self.placement_timeout)
        if self._node(name) != old:
            raise RayTaskLostError(name, old, f"its new actor is on node {self._node(name)}, "
                                   f"but a task restarted alone keeps its address")

    def _mark_lost(self, handle: RayTask, error: RayTaskLostError) -> None:
        self._forget_actor(handle.name, handle.actor)
        if handle.code is None:
            handle.lost = error
            self._say(f"{handle.name} lost: {type(error).__name__}: {error}")
            handle.code = 1  # restartable, as a failed task

    def _poll(self) -> None:
        """Fetches every running task's output and exit code from its actor (one thread)."""
        ray = self._ray
        pending: dict[int, tuple[RayTask, Any, float]] = {}
        while not self._stop_polling.is_set():
            now = time.monotonic()
            with self._handles_lock:
                handles = list(self._handles)
            for h in handles:
                if h.code is None and id(h) not in pending:
                    pending[id(h)] = (h, h.actor.poll.remote(), now)
            if not pending:
                self._stop_polling.wait(0.1)
                continue
            refs = [ref for _, ref, _ in pending.values()]
            ready = set(ray.wait(refs, num_returns=len(refs), timeout=0.2)[0])
            for key, (h, ref, sent) in list(pending.items()):
                if ref not in ready:
                    if time.monotonic() - sent > self.lost_timeout:
                        del pending[key]
                        self._mark_lost(h, RayTaskLostError(
                            h.name, h.node, f"its actor did not answer for "
                            f"{self.lost_timeout:g} s"))
                    continue
                del pending[key]
                try:
                    code, lines = ray.get(ref)
                except ray.exceptions.RayError as e:
                    self._mark_lost(h, RayTaskLostError(h.name, h.node, _first_line(e)))
                    continue
                self._echo(h.name, lines)
                if code is not None:
                    h.code = code
            with self._handles_lock:
                self._handles = [h for h in self._handles if h.code is None]
            self._stop_polling.wait(0.1)
        # stopped: the lines that the calls still in flight hand over are printed too
        refs = [ref for _, ref, _ in pending.values()]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=5.0)[0]) if refs else set()
        for h, ref, _ in pending.values():
            if ref in ready:
                try:
                    self._echo(h.name, ray.get(ref)[1])
                except ray.exceptions.RayError:
                    pass

    def _echo(self, name: str, lines: Sequence[str]) -> None:
        if lines:
            with self.lock:
                for line in lines:
                    self.out.write(f"[{name}] {line}\n")
                self.out.flush()

    def _drain_output(self, timeout: float = 10.0) -> None:
        """Prints what every task wrote since its last poll: a task stopped at the end of the
        run (a ps, an evaluator) may have written its last lines after it."""
        ray = self._ray
        deadline = time.monotonic() + timeout
        actors = dict(self._actors)
        while actors and time.monotonic() < deadline:
            refs = {name: actor.poll.remote() for name, actor in actors.items()}
            ready = set(ray.wait(list(refs.values()), num_returns=len(refs),
                                 timeout=max(0.1, deadline - time.monotonic()))[0])
            more = {}
            for name, ref in refs.items():
                if ref not in ready:
                    continue
                try:
                    lines = ray.get(ref)[1]
                except ray.exceptions.RayError:
                    continue
                if lines:
                    self._echo(name, lines)
                    more[name] = actors[name]
            actors = more

    def _fail(self, name: str, code: int) -> int:
        lost = getattr(self.tasks.get(name), "lost", None)
        status = super()._fail(name, code)
        if lost is not None:
            raise lost
        return status

    def run(self) -> int:
        """Joins (or starts) Ray, runs the tasks as the local launcher does, and removes every
        actor (and a Ray it started) at the end; returns the exit status.

        Raises:
            ClusterConfigError: Ray is not installed.
            RayTaskLostError: a task's actor or node was lost and no restart was left.
            ClusterTimeoutError: Ray could not place the tasks in time.
        """
        self._connect()
        try:
            return super().run()
        finally:
            self._teardown()

    def _teardown(self) -> None:
        ray = self._ray
        refs = []
        for actor in self._actors.values():
            try:
                refs.append(actor.shutdown.remote(self.grace))
            except Exception:
                pass
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=self.grace + 10.0)
        self._stop_polling.set()
        if self._poller is not None:
            self._poller.join(10.0)
        self._drain_output()
        for actor in [*self._actors.values(), *self._lost_actors]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self._actors.clear()
        self._lost_actors.clear()
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._pg)
            except Exception:
                pass
            self._pg = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def launch(command: Sequence[str], workers: int = 1, ps: int = 0, chief: bool = False,
           evaluator: bool = False, coordinator: bool = False, address: str | None = None,
           cpus_per_task: float = 1.0, gpus_per_task: float = 0.0, placement: str = "SPREAD",
           max_restarts: int = 0, env: Mapping[str, str] | None = None,
           **options: Any) -> int:
    """Runs ``command`` as every task of a cluster of Ray actors and returns the exit status.

    The Python face of ``python -m jaxdist.launch --backend ray`` (for a notebook): the same
    modes, credentials, prefixed output and exit codes; see ``RayLauncher``.

    Args:
        command: the argv every chief/worker task runs (ps tasks run ``python -m
            jaxdist.server`` unless the command is ``python -m jaxdist.train``).
        workers: worker tasks.
        ps: parameter-server tasks.
        chief: add a chief task.
        evaluator: add an evaluator task.
        coordinator: TF2 ``ClusterCoordinator`` mode (a chief runs the command, the workers
            serve).
        address: the Ray cluster (``"HOST:PORT"``); ``None`` starts a local Ray for the run
            (or uses the one this process already initialised).
        cpus_per_task: Ray CPUs per task.
        gpus_per_task: Ray GPUs per task.
        placement: ``"SPREAD"``, ``"STRICT_SPREAD"`` or ``"PACK"``.
        max_restarts: restarts from the latest checkpoint, as ``--max-restarts``.
        env: variables to set in every task (each starts from its node's environment).
        **options: further ``Launcher`` options (``devices_per_process``, ``grace``,
            ``insecure``, ``checkpoint_root``, ``out`` ...).

    Returns:
        0 when every training task finished, else the failing task's exit code (130 after
        Ctrl-C).

    Raises:
        ClusterConfigError: Ray is not installed, or a bad option.
        RayTaskLostError: a task's actor or node was lost and no restart was left.

    Example:
        >>> import sys, jaxdist.ray                                   # doctest: +SKIP
        >>> jaxdist.ray.launch([sys.executable, "-m", "jaxdist.train", "--config",
        ...                     "configs/multi_worker.yaml"], workers=2)   # doctest: +SKIP
        0
    """
    return RayLauncher(command, address=address, cpus_per_task=cpus_per_task,
                       gpus_per_task=gpus_per_task, placement=placement, workers=workers,
                       ps=ps, chief=chief, evaluator=evaluator, coordinator=coordinator,
                       max_restarts=max_restarts, env=env, **options).run()


def main_ray(args: Any, command: Sequence[str]) -> int:
    """``python -m jaxdist.launch --backend ray``: runs the parsed options; returns the exit
    status (2 without Ray, 1 when a task's actor or node was lost)."""
    if command_not_found(command):
        return 127
    try:
        return RayLauncher(command, address=args.address, cpus_per_task=args.cpus_per_task,
                           gpus_per_task=args.gpus_per_task, placement=args.placement,
                           placement_timeout=args.placement_timeout,
                           lost_timeout=args.lost_timeout,
                           env=forwarded_env(args.env), **launcher_options(args)).run()
    except ClusterConfigError as e:
        print(f"jaxdist.launch: {e}", file=sys.stderr)
        return 2
    except (RayTaskLostError, ClusterTimeoutError) as e:
        print(f"jaxdist.launch: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


__all__ = ["DEFAULT_LOST_TIMEOUT", "INSTALL_HINT", "RayLauncher", "RayTask", "RayTaskLostError",
           "cluster_from_placement", "forwarded_env", "import_ray", "launch", "main_ray",
           "placement_bundles"]
