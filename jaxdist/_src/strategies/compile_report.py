"""Compiling a strategy's step without running it, and what XLA says the program costs.

``compile_run(strategy, fn, args)`` lowers and compiles the very program ``strategy.run(fn,
args)`` would dispatch (``jit(shard_map(fn))`` over the strategy's mesh, ``PerReplica``
arguments split over the replicas, the rest replicated) from the shapes and dtypes of
``args`` alone: nothing is placed on a device and nothing runs. The devices may be real or the
compile-only devices of a TPU topology (``jaxdist.tpu.Topology("v5e:2x2")``).

The ``CompileReport`` holds XLA's memory analysis and cost analysis of the compiled program.
Under SPMD every device runs the same per-device program, so both are *per device*: one TPU
chip on v5e, v6e, and on v4 / v5p with megacore (JAX's default there), one TensorCore when a
topology asks for a device per core.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxdist._src.strategies.run_options import RunOptions
from jaxdist._src.values.per_replica import PerReplica, is_per_replica

#: HBM per chip of the TPU generations libtpu compiles for (public Cloud TPU specifications),
#: by ``device.device_kind``. A device that is one TensorCore of a two-core chip gets half.
HBM_BYTES_PER_CHIP: dict[str, int] = {
    "TPU v4": 32 * 2**30,
    "TPU v5 lite": 16 * 2**30,
    "TPU v5": 95 * 2**30,
    "TPU v5p": 95 * 2**30,
    "TPU v6 lite": 32 * 2**30,
}


class CompileOnlyError(RuntimeError):
    """A compile-only strategy (a TPU topology without a TPU) was asked to run something."""


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "unknown"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _devices_per_chip(devices: Sequence[Any]) -> int:
    cores = {getattr(d, "core_on_chip", 0) for d in devices}
    return max(1, len(cores))


def _hbm_bytes(device: Any, devices_per_chip: int) -> int | None:
    """HBM of one device: the runtime's limit for a device of this process, else the table."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - compile-only devices have no memory stats
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    chip = HBM_BYTES_PER_CHIP.get(getattr(device, "device_kind", ""))
    return None if chip is None else chip // devices_per_chip


class CompileReport:
    """What XLA says a compiled step costs on each device (memory and FLOPs).

    Every number is per device: one chip of a v5e / v6e, or of a v4 / v5p in megacore mode
    (one device per chip, JAX's default); one core when the topology has a device per core
    (``unit`` says which).

    Attributes:
        compiled: the ``jax.stages.Compiled`` program (``compiled.as_text()`` for its HLO).
        memory_analysis: XLA's ``CompiledMemoryStats`` (``None`` if the backend has none).
        cost_analysis: XLA's cost analysis (``"flops"``, ``"bytes accessed"``, ...) as a dict.
        device_kind: e.g. ``"TPU v5 lite"``.
        num_devices: the devices the program spans.
        num_replicas: the strategy's replicas in sync.
        topology: the topology's name (``"v5e:2x2"``) or ``None`` for attached devices.
        compile_only: whether the devices are a topology's compile-only devices.
        unit: ``"chip"``, ``"core"`` (a device per TensorCore) or ``"device"`` (not a TPU).
        hbm_bytes: the memory of one device (``None``: not known for this device kind).
        what: the compiled program, in words.

    Example:
        >>> import jax, jaxdist
        >>> import jax.numpy as jnp
        >>> strategy = jaxdist.TPUStrategy(topology="v5e:2x2")  # doctest: +NEEDS_LIBTPU
        >>> batch = strategy.experimental_distribute_values_from_function(
        ...     lambda ctx: jax.ShapeDtypeStruct((32, 784), jnp.float32))
        >>> step = lambda params, x: jnp.sum(x @ params)
        >>> report = strategy.experimental_compile(step, args=(jnp.zeros((784, 10)), batch))
        >>> report.num_replicas, report.total_bytes > 0, report.flops > 0
        (4, True, True)
        >>> print(report)
        strategy.run(<lambda>) compiled for TPU v5 lite v5e:2x2 (4 chips, 4 replicas, compile only)
        per chip: memory ...
    """

    def __init__(self, compiled: Any, devices: Sequence[Any], num_replicas: int,
                 topology: str | None = None, compile_only: bool = False,
                 what: str = "the step"):
        self.compiled = compiled
        devices = list(devices)
        self.memory_analysis = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        if isinstance(cost, (list, tuple)):  # older jaxlibs: one dict per program
            cost = cost[0] if cost else None
        self.cost_analysis: dict[str, float] = dict(cost or {})
        first = devices[0]
        self.platform: str = first.platform
        self.device_kind: str = getattr(first, "device_kind", first.platform)
        self.num_devices = len(devices)
        self.num_replicas = int(num_replicas)
        self.topology = topology
        self.compile_only = bool(compile_only)
        self.what = what
        per_chip = _devices_per_chip(devices)
        if self.platform != "tpu":
            self.unit = "device"
        else:
            self.unit = "chip" if per_chip == 1 else "core"
        self.hbm_bytes = _hbm_bytes(first, per_chip) if self.platform == "tpu" else None

    def _mem(self, field: str) -> int | None:
        if self.memory_analysis is None:
            return None
        return int(getattr(self.memory_analysis, field))

    @property
    def argument_bytes(self) -> int | None:
        """The step's inputs on one device (state, batch slice)."""
        return self._mem("argument_size_in_bytes")

    @property
    def output_bytes(self) -> int | None:
        """The step's outputs on one device."""
        return self._mem("output_size_in_bytes")

    @property
    def temp_bytes(self) -> int | None:
        """Temporaries (activations, gradients in flight) on one device."""
        return self._mem("temp_size_in_bytes")

    @property
    def alias_bytes(self) -> int | None:
        """Outputs written into donated inputs' buffers (counted once in ``total_bytes``)."""
        return self._mem("alias_size_in_bytes")

    @property
    def generated_code_bytes(self) -> int | None:
        """The compiled program's own size on the device."""
        return self._mem("generated_code_size_in_bytes")

    @property
    def total_bytes(self) -> int | None:
        """Estimated peak memory of one device: arguments + outputs + temporaries + code -
        aliased (outputs that reuse donated inputs' buffers)."""
        parts = (self.argument_bytes, self.output_bytes, self.temp_bytes,
                 self.generated_code_bytes, self.alias_bytes)
        if any(p is None for p in parts):
            return None
        a, o, t, c, al = parts
        return a + o + t + c - al

    @property
    def fits(self) -> bool | None:
        """Whether ``total_bytes`` fits in ``hbm_bytes`` (``None`` when either is unknown)."""
        if self.total_bytes is None or self.hbm_bytes is None:
            return None
        return self.total_bytes <= self.hbm_bytes

    @property
    def flops(self) -> float | None:
        """XLA's FLOP count of one execution of the program on one device. XLA counts the
        body of a loop once: a ``lax.scan`` over ``steps_per_execution`` steps counts as
        about one step."""
        v = self.cost_analysis.get("flops")
        return None if v is None else float(v)

    @property
    def bytes_accessed(self) -> float | None:
        """XLA's estimate of the memory traffic of one execution on one device."""
        v = self.cost_analysis.get("bytes accessed")
        return None if v is None else float(v)

    @property
    def transcendentals(self) -> float | None:
        v = self.cost_analysis.get("transcendentals")
        return None if v is None else float(v)

    def as_dict(self) -> dict[str, Any]:
        """The report as plain values (for JSON or logs).

        Example:
            >>> import jaxdist
            >>> import jax.numpy as jnp
            >>> strategy = jaxdist.TPUStrategy(topology="v5e:2x2")  # doctest: +NEEDS_LIBTPU
            >>> report = strategy.experimental_compile(lambda x: x * 2, args=(jnp.ones(4),))
            >>> report.as_dict()["num_replicas"] == strategy.num_replicas_in_sync
            True
        """
        return {
            "what": self.what, "topology": self.topology, "device_kind": self.device_kind,
            "num_devices": self.num_devices, "num_replicas": self.num_replicas,
            "compile_only": self.compile_only, "unit": self.unit,
            "argument_bytes": self.argument_bytes, "output_bytes": self.output_bytes,
            "temp_bytes": self.temp_bytes, "alias_bytes": self.alias_bytes,
            "generated_code_bytes": self.generated_code_bytes,
            "total_bytes": self.total_bytes, "hbm_bytes": self.hbm_bytes, "fits": self.fits,
            "flops": self.flops, "bytes_accessed": self.bytes_accessed,
            "transcendentals": self.transcendentals,
        }

    def __str__(self) -> str:
        where = self.topology or f"{self.num_devices} devices"
        mode = ", compile only" if self.compile_only else ""
        head = (f"{self.what} compiled for {self.device_kind} {where} ({self.num_devices} "
                f"{self.unit}s, {self.num_replicas} replicas{mode})")
        mem = (f"per {self.unit}: memory {_fmt_bytes(self.total_bytes)} (arguments "
               f"{_fmt_bytes(self.argument_bytes)}, outputs {_fmt_bytes(self.output_bytes)}, "
               f"temporaries {_fmt_bytes(self.temp_bytes)}, code "
               f"{_fmt_bytes(self.generated_code_bytes)}, aliased "
               f"{_fmt_bytes(self.alias_bytes)})")
        if self.hbm_bytes is not None:
            share = 100.0 * (self.total_bytes or 0) / self.hbm_bytes
            mem += f" of {_fmt_bytes(self.hbm_bytes)} HBM ({share:.1f}%)"
        flops = "unknown" if self.flops is None else f"{self.flops:.4g}"
        traffic = _fmt_bytes(self.bytes_accessed)
        cost = (f"per {self.unit}: {flops} FLOPs, {traffic} accessed per execution (XLA counts "
                f"a loop body once)")
        return "\n".join([head, mem, cost])

    def __repr__(self) -> str:
        return (f"CompileReport({self.device_kind} x{self.num_devices}, total_bytes="
                f"{self.total_bytes}, flops={self.flops})")


def _abstract(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    """The shape, dtype and sharding of an array-like leaf (an array, a ShapeDtypeStruct or a
    Python / numpy number)."""
    if isinstance(x, (bool, int, float, complex)):
        aval = jax.api_util.shaped_abstractify(x)
        return jax.ShapeDtypeStruct((), aval.dtype, sharding=sharding, weak_type=True)
    weak = bool(getattr(x, "weak_type", False))
    return jax.ShapeDtypeStruct(tuple(x.shape), np.dtype(x.dtype), sharding=sharding,
                                weak_type=weak)


def _is_array_like(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct,
                          bool, int, float, complex)) or hasattr(x, "__jax_array__")


def compile_run(strategy: Any, fn: Callable, args: Sequence[Any] = (),
                kwargs: dict[str, Any] | None = None, options: RunOptions | None = None,
                what: str | None = None) -> CompileReport:
    """Compiles ``strategy.run(fn, args, kwargs)`` for the strategy's devices without running it.

    Args:
        strategy: any synchronous jaxdist strategy (its devices may be compile-only).
        fn: the replica function, as for ``strategy.run``.
        args: as for ``strategy.run``; only shapes and dtypes are read. A ``PerReplica`` leaf
            (its ``stacked`` may be a ``jax.ShapeDtypeStruct`` of shape ``(replicas, ...)``)
            is split over the replicas; arrays, numbers and ``jax.ShapeDtypeStruct`` leaves
            are passed whole to every replica; other leaves are constants.
        kwargs: keyword arguments, treated like ``args``.
        options: ``RunOptions``; ``donate_argnums`` donates those arguments (XLA then reuses
            their buffers for outputs, which ``alias_bytes`` shows).
        what: the program, in words, for the report.

    Returns:
        A ``CompileReport``.

    Raises:
        ValueError: a ``PerReplica`` argument does not have one entry per replica.

    Example:
        >>> import jax, jaxdist
        >>> import jax.numpy as jnp
        >>> from jaxdist._src.strategies.compile_report import compile_run
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
        >>> dist_batch = strategy.experimental_distribute_values_from_function(
        ...     lambda ctx: jnp.ones((8, 3)))
        >>> step = lambda params, x: jnp.sum(x @ params)
        >>> report = compile_run(strategy, step, args=(jnp.ones((3, 2)), dist_batch))
        >>> report.flops > 0
        True
    """
    ext = strategy.extended
    n = strategy.extended.num_replicas_in_mesh
    args = tuple(args)
    kwargs = dict(kwargs or {})
    leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_per_replica)
    arg_sizes = [len(jax.tree.leaves(a, is_leaf=is_per_replica)) for a in args]
    arg_of_leaf = [i for i, size in enumerate(arg_sizes) for _ in range(size)]
    arg_of_leaf += [None] * (len(leaves) - len(arg_of_leaf))
    donate_args = set(options.donate_argnums) if options is not None else set()
    bad = sorted(i for i in donate_args if i >= len(args))
    if bad:
        raise ValueError(f"RunOptions.donate_argnums={tuple(sorted(donate_args))} names "
                         f"positions {bad}, but the step has {len(args)} positional arguments")
    dyn_pos: list[int] = []
    abstract: list[jax.ShapeDtypeStruct] = []
    donate: list[int] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, PerReplica):
            stacked = leaf.stacked
            if int(stacked.shape[0]) != n:
                raise ValueError(f"PerReplica argument of shape {tuple(stacked.shape)} has "
                                 f"{stacked.shape[0]} replicas, but {strategy!r} has {n}")
            spec = _abstract(stacked, ext.per_replica_sharding)
        elif _is_array_like(leaf):
            spec = _abstract(leaf, ext.replicated_sharding)
        else:
            continue  # a constant: closed over, as strategy.run treats it
        if arg_of_leaf[i] in donate_args:
            donate.append(len(abstract))
        dyn_pos.append(i)
        abstract.append(spec)

    def program(*dyn: Any) -> Any:
        rebuilt = list(leaves)
        for pos, x in zip(dyn_pos, dyn):
            leaf = leaves[pos]
            rebuilt[pos] = PerReplica(x, leaf.lengths) if isinstance(leaf, PerReplica) else x
        a, kw = treedef.unflatten(rebuilt)
        return strategy.run(fn, args=a, kwargs=kw)

    name = what or f"strategy.run({getattr(fn, '__qualname__', fn)})"
    compiled = jax.jit(program, donate_argnums=tuple(donate)).lower(*abstract).compile()
    topology = getattr(strategy, "topology", None)
    return CompileReport(
        compiled, ext.worker_devices, strategy.num_replicas_in_sync,
        topology=getattr(topology, "name", None),
        compile_only=bool(getattr(strategy, "compile_only", False)), what=name)


def compile_global(strategy: Any, fn: Callable, state: Any, batch: Any,
                   donate_state: bool = True, what: str = "the step") -> CompileReport:
    """Compiles a global (GSPMD) step ``fn(state, batch)``: ``state`` placed as the strategy
    keeps state (replicated), ``batch`` split along its leading axis over the replicas.

    This is how Keras's JAX trainer distributes its ``train_step``; only shapes and dtypes of
    ``state`` and ``batch`` are read.

    Example:
        >>> import jax, jaxdist
        >>> import jax.numpy as jnp
        >>> from jaxdist._src.strategies.compile_report import compile_global
        >>> strategy = jaxdist.MirroredStrategy(jax.devices()[:2])
        >>> train_step = lambda w, batch: w - 0.1 * jnp.mean(batch[0] * batch[1])
        >>> x, y = jnp.ones((8, 3)), jnp.ones((8, 1))
        >>> report = compile_global(strategy, train_step, jnp.ones(3), (x, y))
    """
    ext = strategy.extended

    def spec(sharding: Any) -> Callable[[Any], Any]:
        return lambda x: None if x is None else _abstract(x, sharding)

    abstract_state = jax.tree.map(spec(ext.state_sharding), state)
    abstract_batch = jax.tree.map(spec(ext.per_replica_sharding), batch)
    jitted = jax.jit(fn, donate_argnums=(0,) if donate_state else ())
    compiled = jitted.lower(abstract_state, abstract_batch).compile()
    topology = getattr(strategy, "topology", None)
    return CompileReport(
        compiled, ext.worker_devices, strategy.num_replicas_in_sync,
        topology=getattr(topology, "name", None),
        compile_only=bool(getattr(strategy, "compile_only", False)), what=what)


__all__ = ["HBM_BYTES_PER_CHIP", "CompileOnlyError", "CompileReport", "compile_global",
           "compile_run"]
