"""``TPUStrategy``, TF's TPU entry points (``initialize_tpu_system``), and TPU topologies.

``Topology`` and ``DeviceAssignment`` carry TF's ``tf.tpu.experimental`` names. A topology
comes from the attached TPU (``initialize_tpu_system()``) or from a name such as ``"v5e:2x2"``:
then its devices are libtpu's compile-only devices (``jax.experimental.topologies``), and a
``TPUStrategy`` over them compiles its steps for that TPU on any machine with libtpu installed
(``pip install 'jaxdist[tpu]'``), without running them: ``strategy.experimental_compile``
returns the per-chip memory and FLOPs XLA's TPU compiler computes.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jaxdist._src.cluster.tpu_cluster_resolver import TPUClusterResolver
from jaxdist._src.strategies.compile_report import CompileOnlyError, CompileReport, compile_run
from jaxdist._src.strategies.devices import resolve_devices
from jaxdist._src.strategies.run_options import RunOptions
from jaxdist._src.strategies.strategy import Strategy, StrategyExtended, ValueContext
from jaxdist._src.values.per_replica import PerReplica

_TOPOLOGY_RE = re.compile(r"^(?P<gen>v\d+[a-z]*):(?P<dims>\d+(?:x\d+){1,2})$")
#: Generations whose chips have two TensorCores that JAX drives as one device (megacore).
_MEGACORE = ("v4", "v5p", "v5")
#: What libtpu reads from the environment when it loads on a machine without TPU chips: one
#: host, no metadata server to ask, and no chips to guard with its one-process lockfile
#: (/tmp/libtpu_lockfile), so several processes may compile at once. Set only while libtpu
#: loads, only where unset.
_NO_TPU_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost",
               "TPU_HOST_BOUNDS": "1,1,1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
_LIBTPU_LOCK = threading.Lock()


def libtpu_available() -> bool:
    """Whether libtpu can be imported (``pip install 'jaxdist[tpu]'``): what compiling for a
    named TPU topology needs.

    Example:
        >>> import jaxdist
        >>> jaxdist.tpu.libtpu_available()  # doctest: +NEEDS_LIBTPU
        True
    """
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


def _tpu_chips_attached() -> bool:
    from jaxdist._src.compat import jax_internals

    chips = jax_internals.num_tpu_chips()
    return True if chips is None else chips > 0  # an unknown jax: assume a TPU VM


@contextlib.contextmanager
def _libtpu_environment() -> Iterator[None]:
    """libtpu's environment for a machine without TPU chips, while it loads (then restored)."""
    if _tpu_chips_attached():
        yield
        return
    added = {k: v for k, v in _NO_TPU_ENV.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _topology_devices(name: str, options: dict[str, Any]) -> list[Any]:
    m = _TOPOLOGY_RE.match(name)
    if m is None:
        raise ValueError(
            f"TPU topology {name!r} is not a topology name: expected '<generation>:<chips per "
            f"axis>' as libtpu names them, e.g. 'v5e:2x2', 'v4:2x2x1', 'v5p:2x2x1', 'v6e:2x4'")
    if not libtpu_available():
        raise ImportError(
            f"compiling for TPU topology {name!r} needs libtpu, which is not installed: pip "
            f"install 'jaxdist[tpu]' (jax[tpu]=={jax.__version__})")
    from jax.experimental import topologies

    opts = dict(options)
    if m["gen"] in _MEGACORE:
        opts.setdefault("chip_config_name", "megacore")  # one device per chip, as on the TPU
    with _LIBTPU_LOCK, _libtpu_environment():
        try:
            desc = topologies.get_topology_desc(name, "tpu", **opts)
        except jax.errors.JaxRuntimeError as e:
            first = str(e).strip().splitlines()[0]
            raise ValueError(f"libtpu does not know TPU topology {name!r} with options "
                             f"{opts}: {first}") from None
    return list(desc.devices)


def _coords(device: Any, index: int) -> tuple[int, int, int, int]:
    c = getattr(device, "coords", None)
    if c is None:  # not a TPU (e.g. CPU devices standing in for one): a line of chips
        return (index, 0, 0, 0)
    c = list(c) + [0] * (3 - len(c))
    return (int(c[0]), int(c[1]), int(c[2]), int(getattr(device, "core_on_chip", 0)))


class Topology:
    """The physical layout of a TPU slice (``tf.tpu.experimental.Topology``).

    Made from a topology name, its devices are libtpu's compile-only devices for that slice
    (``jax.experimental.topologies``): a ``TPUStrategy`` over them compiles steps for the TPU
    on a machine without one. Made from devices (``initialize_tpu_system`` does this with the
    attached TPU's cores), it describes them.

    Args:
        name: a libtpu topology name, ``'<generation>:<chips per axis>'``: ``"v5e:2x2"``,
            ``"v4:2x2x1"``, ``"v5p:2x2x1"``, ``"v6e:2x4"``, ...
        devices: describe these devices instead (pass no ``name``).
        **options: libtpu topology options (``chip_config_name``, ``chips_per_host_bounds``,
            ``num_slices``, ``wrap``). v4 and v5p default to ``chip_config_name="megacore"``:
            one device per chip, as JAX drives those chips.

    Raises:
        ImportError: a name was given and libtpu is not installed (``pip install
            'jaxdist[tpu]'``).
        ValueError: the name is malformed or libtpu does not know it.

    Example:
        >>> import jaxdist
        >>> topology = jaxdist.tpu.Topology("v5e:2x2")  # doctest: +NEEDS_LIBTPU
        >>> topology.mesh_shape, topology.num_tasks, topology.device_kind
        (array([2, 2, 1, 1], dtype=int32), 1, 'TPU v5 lite')
    """

    def __init__(self, name: str | None = None, *, devices: Sequence[Any] | None = None,
                 **options: Any):
        if (name is None) == (devices is None):
            raise ValueError(f"Topology takes a topology name (e.g. 'v5e:2x2') or devices, "
                             f"got name={name!r}, devices={devices!r}")
        if name is not None:
            if not isinstance(name, str):
                raise TypeError(f"Topology name must be a string such as 'v5e:2x2', got "
                                f"{name!r}")
            devs = _topology_devices(name, options)
        else:
            if options:
                raise ValueError(f"libtpu options {sorted(options)} need a topology name")
            devs = list(devices)
            if not devs:
                raise ValueError("Topology(devices=...) needs at least one device")
        self._name = name
        self._options = dict(options)
        self._devices = tuple(devs)
        self._coords = [_coords(d, i) for i, d in enumerate(self._devices)]
        tasks = sorted({d.process_index for d in self._devices})
        self._task_of = {t: i for i, t in enumerate(tasks)}
        by_task: dict[int, list[int]] = {i: [] for i in range(len(tasks))}
        for j, d in enumerate(self._devices):
            by_task[self._task_of[d.process_index]].append(j)
        per_task = {len(v) for v in by_task.values()}
        if len(per_task) != 1:
            raise ValueError(f"the devices' hosts hold different numbers of devices "
                             f"({sorted(per_task)}); a TPU topology has the same on every host")
        self._by_task = by_task
        self._at = {c: j for j, c in enumerate(self._coords)}

    @property
    def name(self) -> str | None:
        """The topology name it was made from (``None``: made from devices)."""
        return self._name

    @property
    def devices(self) -> tuple[Any, ...]:
        """The JAX devices of the slice (compile-only devices for a named topology)."""
        return self._devices

    @property
    def compile_only(self) -> bool:
        """Whether the devices can only compile (a named topology), not run."""
        return self._name is not None

    @property
    def device_kind(self) -> str:
        """The devices' kind, e.g. ``"TPU v5 lite"``."""
        return getattr(self._devices[0], "device_kind", self._devices[0].platform)

    @property
    def mesh_shape(self) -> np.ndarray:
        """``[x, y, z, cores per chip]``: the slice's chips along each axis (TF's meaning)."""
        return (np.max(np.asarray(self._coords), axis=0) + 1).astype(np.int32)

    @property
    def mesh_rank(self) -> int:
        """The number of coordinates of a device: 4."""
        return 4

    @property
    def device_coordinates(self) -> np.ndarray:
        """``[num_tasks, num_tpus_per_task, 4]``: each host's devices' coordinates."""
        return np.asarray([[self._coords[j] for j in self._by_task[t]]
                           for t in range(self.num_tasks)], dtype=np.int32)

    @property
    def missing_devices(self) -> np.ndarray:
        """Coordinates inside ``mesh_shape`` with no device (``[n, 4]``)."""
        missing = [c for c in np.ndindex(*self.mesh_shape) if tuple(c) not in self._at]
        return np.asarray(missing, dtype=np.int32).reshape(-1, 4)

    @property
    def num_tasks(self) -> int:
        """The hosts (processes) of the slice."""
        return len(self._by_task)

    @property
    def num_tpus_per_task(self) -> int:
        """Devices per host."""
        return len(self._by_task[0])

    def _index(self, device_coordinates: Sequence[int]) -> int:
        c = tuple(int(v) for v in device_coordinates)
        c = c + (0,) * (4 - len(c))
        if c not in self._at:
            raise ValueError(f"no device at coordinates {list(device_coordinates)} in "
                             f"{self!r}; mesh_shape is {self.mesh_shape.tolist()}")
        return self._at[c]

    def device_at_coordinates(self, device_coordinates: Sequence[int]) -> Any:
        """The JAX device at ``[x, y, z, core]``.

        Example:
            >>> import jaxdist
            >>> topology = jaxdist.tpu.Topology("v5e:2x2")  # doctest: +NEEDS_LIBTPU
            >>> topology.device_at_coordinates([1, 0, 0, 0])
            TpuDevice(id=1, ...)
        """
        return self._devices[self._index(device_coordinates)]

    def task_ordinal_at_coordinates(self, device_coordinates: Sequence[int]) -> int:
        """The host (task) of the device at ``device_coordinates``."""
        return self._task_of[self.device_at_coordinates(device_coordinates).process_index]

    def tpu_device_ordinal_at_coordinates(self, device_coordinates: Sequence[int]) -> int:
        """The index among its host's devices of the device at ``device_coordinates``."""
        j = self._index(device_coordinates)
        task = self._task_of[self._devices[j].process_index]
        return self._by_task[task].index(j)

    def tpu_device_name_at_coordinates(self, device_coordinates: Sequence[int],
                                       job: str | None = None) -> str:
        """TF's name of the device at ``device_coordinates``
        (``/job:worker/task:0/device:TPU:1``)."""
        task = self.task_ordinal_at_coordinates(device_coordinates)
        ordinal = self.tpu_device_ordinal_at_coordinates(device_coordinates)
        prefix = "" if job is None else f"/job:{job}"
        return f"{prefix}/task:{task}/device:TPU:{ordinal}"

    def cpu_device_name_at_coordinates(self, device_coordinates: Sequence[int],
                                       job: str | None = None) -> str:
        """TF's name of the host CPU of the device at ``device_coordinates``."""
        task = self.task_ordinal_at_coordinates(device_coordinates)
        prefix = "" if job is None else f"/job:{job}"
        return f"{prefix}/task:{task}/device:CPU:0"

    def __repr__(self) -> str:
        what = repr(self._name) if self._name else "attached"
        mode = ", compile-only" if self.compile_only else ""
        return (f"Topology({what}: {len(self._devices)} x {self.device_kind}, mesh_shape "
                f"{self.mesh_shape.tolist()}, {self.num_tasks} task(s){mode})")


class DeviceAssignment:
    """Which device runs each replica (``tf.tpu.experimental.DeviceAssignment``).

    jaxdist's ``TPUStrategy`` is data parallel: one core (device) per replica. Build one with
    ``DeviceAssignment.build(topology, num_replicas=n)``.

    Args:
        topology: the ``Topology``.
        core_assignment: ``[num_replicas, 1, 4]`` device coordinates, one per replica.

    Raises:
        ValueError: a coordinate names no device of the topology, a device is used twice, or
            the array has the wrong shape.
        NotImplementedError: more than one core per replica (model parallelism).

    Example:
        >>> import jaxdist
        >>> topology = jaxdist.tpu.Topology("v4:2x2x1")  # doctest: +NEEDS_LIBTPU
        >>> assignment = jaxdist.tpu.DeviceAssignment.build(topology, num_replicas=2)
        >>> strategy = jaxdist.TPUStrategy(experimental_device_assignment=assignment)
    """

    def __init__(self, topology: Topology, core_assignment: Any):
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a jaxdist.tpu.Topology, got {topology!r}")
        ca = np.asarray(core_assignment, dtype=np.int32)
        if ca.ndim != 3 or ca.shape[2] != topology.mesh_rank or ca.shape[0] < 1:
            raise ValueError(f"core_assignment must have shape [num_replicas, "
                             f"num_cores_per_replica, {topology.mesh_rank}], got {ca.shape}")
        if ca.shape[1] != 1:
            raise NotImplementedError(
                f"core_assignment has {ca.shape[1]} cores per replica: jaxdist's TPUStrategy "
                f"runs one core per replica (data parallelism); model parallelism is not "
                f"supported")
        devs = [topology.device_at_coordinates(c) for c in ca[:, 0]]
        if len(set(devs)) != len(devs):
            raise ValueError(f"core_assignment {ca[:, 0].tolist()} uses a device twice")
        self._topology = topology
        self._core_assignment = ca
        self._devices = tuple(devs)

    @classmethod
    def build(cls, topology: Topology, computation_shape: Sequence[int] | None = None,
              computation_stride: Sequence[int] | None = None, num_replicas: int = 1,
              device_order_mode: Any = None) -> DeviceAssignment:
        """Assigns ``num_replicas`` replicas of one core each to the topology's devices, in
        the topology's device order (TF's ``DeviceAssignment.build``).

        Raises:
            ValueError: more replicas than devices.
            NotImplementedError: a ``computation_shape`` of more than one core.

        Example:
            >>> import jaxdist
            >>> from jaxdist.tpu import DeviceAssignment
            >>> topology = jaxdist.tpu.Topology("v5e:2x2")  # doctest: +NEEDS_LIBTPU
            >>> assignment = DeviceAssignment.build(topology, num_replicas=4)
            >>> assignment.num_replicas
            4
        """
        del computation_stride, device_order_mode
        if computation_shape is not None and int(np.prod(computation_shape)) != 1:
            raise NotImplementedError(
                f"computation_shape={list(computation_shape)} spans several cores: jaxdist's "
                f"TPUStrategy runs one core per replica (data parallelism)")
        n = int(num_replicas)
        if not 1 <= n <= len(topology.devices):
            raise ValueError(f"num_replicas={num_replicas}: {topology!r} has "
                             f"{len(topology.devices)} devices, expected 1 to "
                             f"{len(topology.devices)}")
        coords = [[topology._coords[j]] for j in range(n)]
        return cls(topology, coords)

    @property
    def topology(self) -> Topology:
        return self._topology

    @property
    def num_replicas(self) -> int:
        return int(self._core_assignment.shape[0])

    @property
    def num_cores_per_replica(self) -> int:
        return int(self._core_assignment.shape[1])

    @property
    def core_assignment(self) -> np.ndarray:
        """``[num_replicas, num_cores_per_replica, 4]`` device coordinates."""
        return self._core_assignment.copy()

    @property
    def devices(self) -> tuple[Any, ...]:
        """The JAX device of each replica, in replica order."""
        return self._devices

    def coordinates(self, replica: int, logical_core: int) -> tuple[int, ...]:
        """The coordinates of ``logical_core`` of ``replica``."""
        return tuple(int(v) for v in self._core_assignment[replica, logical_core])

    def lookup_replicas(self, task_id: int, logical_core: int) -> list[int]:
        """The replicas whose ``logical_core`` is on host ``task_id``.

        Raises:
            ValueError: no replica has that core on that host.
        """
        out = [r for r in range(self.num_replicas)
               if self._topology.task_ordinal_at_coordinates(
                   self.coordinates(r, logical_core)) == task_id]
        if not out:
            raise ValueError(f"no replica has logical core {logical_core} on task {task_id}")
        return out

    def tpu_ordinal(self, replica: int = 0, logical_core: int = 0) -> int:
        """The index among its host's devices of the core running ``replica``."""
        return self._topology.tpu_device_ordinal_at_coordinates(
            self.coordinates(replica, logical_core))

    def host_device(self, replica: int = 0, logical_core: int = 0,
                    job: str | None = None) -> str:
        """TF's name of the host CPU of ``replica``."""
        return self._topology.cpu_device_name_at_coordinates(
            self.coordinates(replica, logical_core), job=job)

    def tpu_device(self, replica: int = 0, logical_core: int = 0,
                   job: str | None = None) -> str:
        """TF's name of the TPU device of ``replica``."""
        return self._topology.tpu_device_name_at_coordinates(
            self.coordinates(replica, logical_core), job=job)

    def __repr__(self) -> str:
        return (f"DeviceAssignment({self.num_replicas} replicas x "
                f"{self.num_cores_per_replica} core on {self._topology!r})")


class _CompileOnlyExtended(StrategyExtended):
    """A ``TPUStrategy``'s internals over compile-only devices: steps compile, nothing runs.

    State made under ``scope()`` stays where it is made (host memory): only its shapes and
    dtypes reach the TPU compiler. Everything that would run on the topology's devices raises
    ``CompileOnlyError``; tracing (``strategy.run`` inside ``jax.jit(...).lower``, which
    ``experimental_compile`` does) works as on a TPU.
    """

    plain_run = False  # its run_compiled does more per call

    def __init__(self, strategy: Strategy, devices: Sequence[Any], topology: Topology):
        super().__init__(strategy, devices)
        self._topology = topology

    def compile_only_error(self, what: str) -> CompileOnlyError:
        t = self._topology
        return CompileOnlyError(
            f"{what}: this TPUStrategy is compile-only (TPU topology {t.name!r}, "
            f"{len(t.devices)} x {t.device_kind}, from libtpu without a TPU): it compiles "
            f"steps but cannot run them. Use strategy.experimental_compile(fn, args) for the "
            f"per-chip memory and FLOPs; to train, use TPUStrategy() on a TPU VM or Colab "
            f"TPU runtime, or TPUStrategy(devices=...) on other devices")

    def placement_mesh(self) -> Any:
        return None  # nothing is placed on compile-only devices

    def place(self, tree: Any) -> Any:
        return tree

    def run_compiled(self, fn: Callable, args=(), kwargs=None) -> Any:
        if trace_state_clean():
            raise self.compile_only_error(
                f"strategy.run({getattr(fn, '__qualname__', fn)})")
        return super().run_compiled(fn, args, kwargs)

    def reduce_leaf(self, op: Any, v: Any, axis: int | None) -> Any:
        if trace_state_clean():
            raise self.compile_only_error("strategy.reduce")
        return super().reduce_leaf(op, v, axis)

    def reduce_to(self, reduce_op: Any, value: Any, destinations: Any = None,
                  options: Any = None) -> Any:
        raise self.compile_only_error("strategy.extended.reduce_to")

    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        raise self.compile_only_error("strategy.extended.broadcast_to")

    def update(self, var: Any, fn: Callable, args=(), kwargs=None, group: bool = True) -> Any:
        raise self.compile_only_error("strategy.extended.update")


def trace_state_clean() -> bool:
    from jaxdist._src.strategies.strategy import trace_state_clean as clean

    return clean()


class TPUStrategy(Strategy):
    """Synchronous training on the cores of a TPU (``tf.distribute.TPUStrategy``).

    Mirrored over the TPU cores the resolver finds. Pass ``steps_per_execution`` to the
    Trainer to fold several steps into one compiled dispatch, as TF's TPU guide recommends.

    Given a named ``topology`` (or a ``DeviceAssignment`` on one), the strategy is
    compile-only: its devices are libtpu's compile-only devices for that TPU slice, and
    ``experimental_compile`` compiles steps for it on any machine with libtpu installed
    (``pip install 'jaxdist[tpu]'``), reporting the per-chip memory and FLOPs. Running
    anything on it (``run``, ``reduce``, a distributed dataset, ``Trainer.fit``, Keras
    ``fit``) raises ``CompileOnlyError``.

    Args:
        tpu_cluster_resolver: a ``TPUClusterResolver`` (default: the local TPU).
        experimental_device_assignment: a ``jaxdist.tpu.DeviceAssignment``: one replica on
            each of its devices (the replica mesh orders TPU devices as ``jax.make_mesh``
            does, along the chips' interconnect).
        experimental_spmd_xla_partitioning: accepted for compatibility (model parallelism is
            not supported).
        devices: run on these devices instead of the resolver's TPU cores (e.g. CPU devices for
            tests).
        topology: a ``jaxdist.tpu.Topology`` or a topology name such as ``"v5e:2x2"``: one
            replica per device of the topology.

    Raises:
        TPUNotFoundError: no TPU is attached and neither ``devices`` nor a topology was given;
            the message lists the devices found.
        ImportError: a topology name was given and libtpu is not installed.

    Example:
        >>> import jax, jaxdist
        >>> import jax.numpy as jnp
        >>> resolver = jaxdist.cluster_resolver.TPUClusterResolver(tpu="local")
        >>> jaxdist.tpu.initialize_tpu_system(resolver)  # doctest: +SKIP
        >>> strategy = jaxdist.TPUStrategy(resolver)    # doctest: +SKIP
        >>> compile_only = jaxdist.TPUStrategy(topology="v5e:2x2")  # doctest: +NEEDS_LIBTPU
        >>> step = lambda params, x: jnp.sum(x @ params)
        >>> batch = compile_only.experimental_distribute_values_from_function(
        ...     lambda ctx: jax.ShapeDtypeStruct((32, 784), jnp.float32))
        >>> print(compile_only.experimental_compile(step, args=(jnp.zeros((784, 10)), batch)))
        strategy.run(<lambda>) compiled for TPU v5 lite v5e:2x2 (4 chips, 4 replicas, compile only)
        ...
    """

    #: TF's replica context of this strategy runs a merge function in place: a merge_call
    #: inside control flow is allowed (only TF's mirrored replica threads refuse it).
    merge_call_checks_control_flow = False

    def __init__(
        self,
        tpu_cluster_resolver: TPUClusterResolver | None = None,
        experimental_device_assignment: DeviceAssignment | None = None,
        experimental_spmd_xla_partitioning: bool = False,
        devices: Sequence[Any] | None = None,
        topology: Topology | str | None = None,
    ):
        self._resolver = tpu_cluster_resolver or TPUClusterResolver()
        assignment = experimental_device_assignment
        if isinstance(topology, str):
            topology = Topology(topology)
        elif topology is not None and not isinstance(topology, Topology):
            raise TypeError(f"topology must be a jaxdist.tpu.Topology or a topology name "
                            f"such as 'v5e:2x2', got {topology!r}")
        if assignment is not None:
            if not isinstance(assignment, DeviceAssignment):
                raise TypeError(f"experimental_device_assignment must be a "
                                f"jaxdist.tpu.DeviceAssignment, got {assignment!r}")
            if topology is not None and topology is not assignment.topology:
                raise ValueError(f"topology {topology!r} is not the device assignment's "
                                 f"topology {assignment.topology!r}")
            topology = assignment.topology
        elif topology is not None:
            assignment = DeviceAssignment.build(topology, num_replicas=len(topology.devices))
        if assignment is not None and devices is not None:
            raise ValueError("pass devices or a topology / device assignment, not both")
        if assignment is not None:
            devs = assignment.devices
        elif devices is not None:
            devs = tuple(resolve_devices(devices))
        else:
            devs = tuple(self._resolver.devices())
        self._topology = topology
        self._device_assignment = assignment
        if topology is not None and topology.compile_only:
            extended: StrategyExtended = _CompileOnlyExtended(self, devs, topology)
        else:
            extended = StrategyExtended(self, devs)
        super().__init__(extended)

    @property
    def cluster_resolver(self) -> TPUClusterResolver:
        return self._resolver

    @property
    def topology(self) -> Topology | None:
        """The ``Topology`` given (directly or by the device assignment), else ``None``."""
        return self._topology

    @property
    def compile_only(self) -> bool:
        """Whether this strategy only compiles (its devices are a named topology's)."""
        return isinstance(self._extended, _CompileOnlyExtended)

    def experimental_compile(self, fn: Callable, args: Sequence[Any] = (),
                             kwargs: dict[str, Any] | None = None,
                             options: RunOptions | None = None) -> CompileReport:
        """Compiles ``run(fn, args, kwargs)`` for this strategy's devices without running it.

        Only the shapes and dtypes of the arguments are read: ``PerReplica`` values (e.g. from
        ``experimental_distribute_values_from_function``, whose function may return
        ``jax.ShapeDtypeStruct``) are split over the replicas, arrays and
        ``jax.ShapeDtypeStruct`` leaves are passed whole to every replica.

        Returns:
            A ``jaxdist.tpu.CompileReport``: XLA's memory and cost analysis of one device's
            program (``total_bytes``, ``flops``, ``memory_analysis``, ``cost_analysis``).

        Example:
            >>> import jax, jaxdist
            >>> import jax.numpy as jnp
            >>> strategy = jaxdist.TPUStrategy(topology="v5e:2x2")  # doctest: +NEEDS_LIBTPU
            >>> batch = strategy.experimental_distribute_values_from_function(
            ...     lambda ctx: jax.ShapeDtypeStruct((32, 784), jnp.float32))
            >>> step = lambda params, x: jnp.sum(x @ params)
            >>> report = strategy.experimental_compile(step, args=(jnp.zeros((784, 10)), batch))
            >>> report.total_bytes > 0, report.flops > 0
            (True, True)
        """
        return compile_run(self, fn, args, kwargs, options)

    # ------------------------------------------------------------ compile-only behaviour
    def _compile_only_error(self, what: str) -> CompileOnlyError:
        return self._extended.compile_only_error(what)  # type: ignore[attr-defined]

    def experimental_distribute_values_from_function(self, value_fn: Callable) -> Any:
        """As ``Strategy``'s, and for ``experimental_compile``: ``jax.ShapeDtypeStruct``
        values become a ``PerReplica`` of shapes; on a compile-only strategy array values stay
        on the host (stacked with numpy).

        Example:
            >>> import jax, jaxdist
            >>> import jax.numpy as jnp
            >>> strategy = jaxdist.TPUStrategy(topology="v5e:2x2")  # doctest: +NEEDS_LIBTPU
            >>> batch = strategy.experimental_distribute_values_from_function(
            ...     lambda ctx: jax.ShapeDtypeStruct((32, 784), jnp.float32))
        """
        n = self.num_replicas_in_sync
        values = [value_fn(ValueContext(i, n)) for i in range(n)]
        is_shape = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
        shapes_only = all(is_shape(x) for v in values
                          for x in jax.tree.leaves(v, is_leaf=is_shape))
        if not self.compile_only and not shapes_only:
            return super().experimental_distribute_values_from_function(lambda ctx: values[
                ctx.replica_id_in_sync_group])

        def stack(*parts: Any) -> PerReplica:
            shapes = {tuple(np.shape(p)) for p in parts}
            if len(shapes) != 1:
                raise ValueError(f"per-replica values must have the same shape, got "
                                 f"{sorted(shapes)}")
            if all(isinstance(p, jax.ShapeDtypeStruct) for p in parts):
                return PerReplica(jax.ShapeDtypeStruct((n, *parts[0].shape), parts[0].dtype))
            return PerReplica(np.stack([np.asarray(p) for p in parts]))

        return jax.tree.map(stack, *values, is_leaf=is_shape)

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None):
        if self.compile_only:
            raise self._compile_only_error("experimental_distribute_dataset")
        return super().experimental_distribute_dataset(dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None):
        if self.compile_only:
            raise self._compile_only_error("distribute_datasets_from_function")
        return super().distribute_datasets_from_function(dataset_fn, options)

    def gather(self, value: Any, axis: int) -> Any:
        if self.compile_only:
            raise self._compile_only_error("strategy.gather")
        return super().gather(value, axis)

    def __repr__(self) -> str:
        if self.compile_only:
            return (f"TPUStrategy(num_replicas_in_sync={self.num_replicas_in_sync}, "
                    f"topology={self._topology.name!r}, compile_only=True)")
        return super().__repr__()


def initialize_tpu_system(cluster_resolver: TPUClusterResolver | None = None) -> Topology:
    """Checks the TPU is there and returns its ``Topology`` (TF's
    ``tpu.experimental.initialize_tpu_system``).

    JAX initialises the TPU runtime itself; on one TPU host this verifies the cores are visible.

    Raises:
        TPUNotFoundError: no TPU is visible; the message lists the devices found.

    Example:
        >>> topology = jaxdist.tpu.initialize_tpu_system()  # doctest: +SKIP
        >>> len(topology.devices), topology.num_tasks       # doctest: +SKIP
        (8, 1)
    """
    resolver = cluster_resolver or TPUClusterResolver()
    resolver.devices()  # raises TPUNotFoundError without a TPU
    return Topology(devices=jax.devices("tpu"))


def shutdown_tpu_system(cluster_resolver: TPUClusterResolver | None = None) -> None:
    """No-op: JAX owns the TPU runtime's lifetime (kept for TF compatibility).

    Example:
        >>> import jaxdist
        >>> jaxdist.tpu.shutdown_tpu_system()
    """
    del cluster_resolver


def experimental_connect_to_cluster(cluster_resolver: Any, **kwargs: Any) -> None:
    """TF's ``tf.config.experimental_connect_to_cluster``: checks the resolver's cluster (JAX needs
    no remote connection).

    For a TPU resolver on one host this checks the TPU is there. A resolver that names several
    processes brings up ``jax.distributed`` (see ``jaxdist._src.cluster``).

    Example:
        >>> import jaxdist
        >>> resolver = jaxdist.cluster_resolver.TPUClusterResolver(tpu="local")
        >>> jaxdist.experimental_connect_to_cluster(resolver)  # doctest: +SKIP
    """
    del kwargs
    if isinstance(cluster_resolver, TPUClusterResolver):
        cluster_resolver.devices()
        return
    from jaxdist._src.distributed.bringup import initialize_from_resolver  # multi-host bring-up

    initialize_from_resolver(cluster_resolver)
