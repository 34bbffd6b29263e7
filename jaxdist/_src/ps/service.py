"""``ParameterService``: the state one ps task holds, and every operation on it.

The service is plain Python over numpy arrays; ``jaxdist._src.ps.server`` puts it behind gRPC and
``jaxdist._src.ps.client.LocalClient`` calls it in-process (the no-cluster mode of
``ParameterServerStrategy``). Every variable (a shard of a user's leaf) has a version: the number
of updates applied to it. A push says which version its gradient was computed from; the service
records the staleness (versions applied since) and applies the optax update.

Example:
    >>> import numpy as np
    >>> from jaxdist.ps import ParameterService
    >>> from jaxdist._src.ps.optimizers import sgd
    >>> svc = ParameterService("ps:0")
    >>> svc.create({"w": np.zeros(3, np.float32)}, {"w": {"optimizer": sgd(0.1).to_json()}})
    {'w': 0}
    >>> svc.push({"w": np.ones(3, np.float32)}, {"w": 0}, worker=0)["w"]["version"]
    1
"""

from __future__ import annotations

import collections
import json
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxdist._src.ps.checkpoints import (
    check_keep,
    checkpoint_directory,
    latest_step,
    read_task_checkpoint,
    write_task_checkpoint,
)
from jaxdist._src.ps.errors import PSInvalidArgumentError, PSNotFoundError
from jaxdist._src.ps.host_update import HOST_ADD_MAX_BYTES, host_add, host_add_mode
from jaxdist._src.ps.optimizers import OptimizerSpec
from jaxdist._src.transport import wire
from jaxdist._src.transport.memory import aligned_copy, aligned_empty

# Least recently used first. Bounded: every learning-rate change (ReduceLROnPlateau, the
# LearningRate RPC) is a new spec, and a job that changes its rate often must not grow the ps
# without end; an evicted spec compiles again on its next use (same numbers).
_TX_CACHE: collections.OrderedDict[str, tuple[optax.GradientTransformation, Any, Any]] = (
    collections.OrderedDict())
_TX_CACHE_SIZE = 64
_TX_LOCK = threading.Lock()


def _transform(spec_json: dict[str, Any] | None):
    """(tx, jitted dense update, jitted row update) for a ps-side optimizer spec (cached)."""
    key = json.dumps(spec_json, sort_keys=True)
    with _TX_LOCK:
        if key in _TX_CACHE:
            _TX_CACHE.move_to_end(key)
            return _TX_CACHE[key]
    spec = OptimizerSpec.from_json(spec_json)
    if not spec.elementwise:
        raise PSInvalidArgumentError(
            f"optimizer {spec.name!r} is not elementwise and cannot run on a ps; split it with "
            f"OptimizerSpec.split() and apply the worker part before pushing"
        )
    tx = spec.build()

    def dense(param, grad, state):
        updates, state = tx.update(grad.astype(param.dtype), state, param)
        return optax.apply_updates(param, updates), state

    # Dense updates donate the old value and optimizer state: XLA writes the new ones into the
    # same buffers (a 64 MiB sgd update: 21 -> 4 ms). JAX donates nothing while a pull still
    # holds a numpy view of the value (it allocates instead), so a pull in flight never sees
    # its array change. Row updates work on gathered copies and donate nothing.
    entry = (tx, jax.jit(dense, donate_argnums=(0, 2)), jax.jit(dense))
    with _TX_LOCK:
        _TX_CACHE[key] = entry
        while len(_TX_CACHE) > _TX_CACHE_SIZE:
            _TX_CACHE.popitem(last=False)
    return entry


# ``assign_add``: the value's buffer is donated, as in the optimizer updates above.
_ASSIGN_ADD = jax.jit(lambda value, delta: value + delta.astype(value.dtype), donate_argnums=0)


def _jitted_assign_add(value: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """``_ASSIGN_ADD`` on a copy of ``value`` (what ``host_add_mode`` compares numpy with)."""
    return np.asarray(_ASSIGN_ADD(jnp.array(value), delta))


@dataclass
class _Var:
    key: str
    value: np.ndarray
    kind: str = "dense"  # "dense": whole-tensor pushes; "rows": row-sparse pushes
    optimizer: dict[str, Any] | None = None
    opt_state: Any = None
    version: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    stale_max: int = 0
    stale_sum: int = 0
    pushes: int = 0

    def stats(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "shape": list(self.value.shape),
            "dtype": wire.dtype_name(self.value.dtype),
            "kind": self.kind,
            "pushes": self.pushes,
            "staleness_max": self.stale_max,
            "staleness_mean": self.stale_sum / self.pushes if self.pushes else 0.0,
        }


def _value_refs(var: _Var) -> tuple[int, int]:
    """Reference counts of ``var.value`` and of the allocation it views (``(n, 0)`` when it
    owns its memory), as seen from here; the same code measures ``_UNSHARED`` below."""
    value = var.value
    base = value.base
    return sys.getrefcount(value), (sys.getrefcount(base) if base is not None else 0)


#: ``_value_refs`` of a value nothing but its ``_Var`` refers to (a pulled array, a view of
#: it, a JAX array made from it, a buffer being sent: each holds a reference and raises one
#: of the counts).
_UNSHARED = _value_refs(_Var("probe", aligned_copy(np.zeros(1, np.float32))))


def _unshared(var: _Var) -> bool:
    """True when nothing but ``var`` refers to its (numpy) value or the memory it views."""
    refs = _value_refs(var)
    return refs[0] <= _UNSHARED[0] and refs[1] <= _UNSHARED[1]


def _host_assign_add(var: _Var, grad: np.ndarray) -> np.ndarray | None:
    """``var.value + grad`` as a numpy add (``jaxdist._src.ps.host_update``), bit-identical to
    ``_ASSIGN_ADD``; ``None`` when this value or dtype is left to ``_ASSIGN_ADD``.

    Like the donating jitted add, it writes into the value's own buffer only when nothing
    else refers to it (a pull in flight keeps the old value unchanged: the sum then goes into
    a fresh buffer). Called under ``var.lock``.
    """
    value = var.value
    if type(value) is not np.ndarray:
        return None  # a jax array (a jitted add made it) or a subclass
    mode = host_add_mode(value.dtype, _jitted_assign_add)
    if mode is None or (value.nbytes > HOST_ADD_MAX_BYTES and mode != "exact"):
        return None
    base = value.base
    own = (value.flags.writeable and value.flags.c_contiguous
           and (base is None or (type(base) is np.ndarray and base.base is None)))
    del value, base
    if own and _unshared(var):
        out = var.value
    else:
        out = aligned_empty(var.value.nbytes).view(var.value.dtype).reshape(var.value.shape)
    return host_add(var.value, grad, out, mode)


def _writable(state: Any) -> Any:
    # Aligned, so the jitted updates take the leaves without copying them.
    return jax.tree.map(aligned_copy, state)


class ParameterService:
    """The variables, optimizer state, versions and SSP clock of one ps task.

    Args:
        task: the task's name for messages, e.g. ``"ps:0"``.
        checkpoint_dir: where ``save`` writes by default and where the service restores from
            at start (if a checkpoint exists there). Once ``confine_checkpoints()`` was called
            (``ParameterServer`` calls it), it is also the checkpoint root: ``save`` and
            ``restore`` refuse any directory outside it.
        checkpoint_root: the checkpoint root when it differs from ``checkpoint_dir`` (a
            server that should save under a directory without restoring from it at start).
    """

    def __init__(self, task: str = "ps:0", checkpoint_dir: str | None = None,
                 checkpoint_root: str | None = None):
        self.task = task
        self.incarnation = uuid.uuid4().hex
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_root = checkpoint_root or checkpoint_dir
        self._confined = False
        #: Bound on how long one ``clock`` call waits (a server sets its ``max_call_seconds``).
        self.max_wait_seconds = float("inf")
        self._vars: dict[str, _Var] = {}
        self._vars_lock = threading.Lock()
        self._markers: set[str] = set()
        self._clock_cond = threading.Condition()
        self._clocks: dict[int, float] = {}
        self.stopped = threading.Event()
        self.restored_step: int | None = None
        if checkpoint_dir and latest_step(checkpoint_dir, task) is not None:
            self.restore(checkpoint_dir)

    # ------------------------------------------------------------------ variables
    def _get(self, key: str) -> _Var:
        try:
            return self._vars[key]
        except KeyError:
            raise PSNotFoundError(
                f"{self.task} holds no variable {key!r} (it holds {len(self._vars)}: "
                f"{sorted(self._vars)[:8]}...); was it created by the chief?",
                task=self.task,
            ) from None

    def create(self, values: dict[str, np.ndarray], specs: dict[str, dict[str, Any]]) -> dict:
        """Creates variables that do not exist yet; returns ``{key: version}`` for all of them.

        Args:
            values: key -> initial value.
            specs: key -> ``{"optimizer": spec JSON or None, "kind": "dense" | "rows"}``.

        Raises:
            PSInvalidArgumentError: a key exists with another shape or dtype.
        """
        out = {}
        for key, value in values.items():
            spec = specs.get(key, {})
            value = aligned_copy(value)  # own, writable copy (aligned: no copy into jax)
            with self._vars_lock:
                var = self._vars.get(key)
                if var is not None:
                    if var.value.shape != value.shape or var.value.dtype != value.dtype:
                        raise PSInvalidArgumentError(
                            f"{self.task}: variable {key!r} exists with shape "
                            f"{var.value.shape} {var.value.dtype}, creation asked for "
                            f"{value.shape} {value.dtype}",
                            task=self.task,
                        )
                    out[key] = var.version
                    continue
                kind = spec.get("kind", "dense")
                if kind not in ("dense", "rows"):
                    raise PSInvalidArgumentError(f"variable kind {kind!r}: expected dense/rows")
                opt = spec.get("optimizer")
                state = None
                if opt is not None:
                    _check_optimizer_dtype(self.task, key, value.dtype, opt)
                    tx, _, _ = _transform(opt)
                    state = _writable(tx.init(jnp.asarray(value)))
                self._vars[key] = _Var(key, value, kind, opt, state)
                out[key] = 0
        return out

    def pull(self, keys: list[str]) -> dict[str, tuple[np.ndarray, int]]:
        """Current value and version of each key."""
        out = {}
        for key in keys:
            var = self._get(key)
            with var.lock:
                value = var.value
                if var.kind == "rows":
                    value = value.copy()
                elif isinstance(value, jax.Array):
                    # Taken under the lock: while this view lives, an update cannot donate
                    # (overwrite) the buffer it reads.
                    value = np.asarray(value)
                out[key] = (value, var.version)
        return out

    def pull_rows(self, key: str, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """Rows ``ids`` (local row indices) of a variable, and its version."""
        var = self._get(key)
        ids = self._check_ids(var, ids)
        with var.lock:
            return var.value[ids], var.version

    def _check_ids(self, var: _Var, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise PSInvalidArgumentError(
                f"{self.task}: row ids for {var.key!r} have dtype {ids.dtype}: expected integers",
                task=self.task,
            )
        ids = ids.reshape(-1).astype(np.int64)
        n = var.value.shape[0] if var.value.ndim else 0
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            bad = ids[(ids < 0) | (ids >= n)][0]
            raise PSInvalidArgumentError(
                f"{self.task}: row id {int(bad)} out of range for {var.key!r} with {n} rows",
                task=self.task,
            )
        return ids

    def _check_dtype(self, var: _Var, x: np.ndarray, what: str) -> None:
        if x.dtype != var.value.dtype:
            raise PSInvalidArgumentError(
                f"{self.task}: {what} for {var.key!r} has dtype {x.dtype}, the variable has "
                f"{var.value.dtype}; cast it to {var.value.dtype} before pushing (the ps never "
                f"casts: {x.dtype} -> {var.value.dtype} could lose values)",
                task=self.task,
            )

    def _record(self, var: _Var, version: int) -> int:
        stale = max(0, var.version - int(version))
        var.stale_max = max(var.stale_max, stale)
        var.stale_sum += stale
        var.pushes += 1
        return stale

    def push(self, grads: dict[str, np.ndarray], versions: dict[str, int], worker: int = 0):
        """Applies each gradient with the variable's optimizer; returns new versions/staleness.

        A variable without optimizer gets ``value += grad`` (an ``assign_add``): a numpy add
        on the host buffer for float32/64 and integers up to ``HOST_ADD_MAX_BYTES``
        (``jaxdist._src.ps.host_update``, bit-identical to XLA's; 64-bit dtypes at any size when
        JAX would narrow them), a jitted add otherwise.
        Optimizer updates are jitted XLA computations. Both write into the old value's buffer
        (XLA: donation) unless a pull still holds the old value, which then stays unchanged.
        """
        out = {}
        for key, grad in grads.items():
            var = self._get(key)
            grad = np.asarray(grad)
            if grad.shape != var.value.shape:
                raise PSInvalidArgumentError(
                    f"{self.task}: gradient for {key!r} has shape {grad.shape}, the variable "
                    f"has {var.value.shape}",
                    task=self.task,
                )
            self._check_dtype(var, grad, "gradient")
            with var.lock:
                stale = self._record(var, versions.get(key, var.version))
                state = None
                if var.optimizer is None:
                    new = _host_assign_add(var, grad)  # numpy, on the host buffer
                    if new is None:
                        new = _ASSIGN_ADD(var.value, grad)
                else:
                    _, dense, _ = _transform(var.optimizer)
                    new, state = dense(var.value, grad, var.opt_state)
                # Applied before the push is acknowledged (and a queue of dispatched
                # updates, each holding its gradient, cannot build up).
                if not isinstance(new, np.ndarray):
                    jax.block_until_ready((new, state))
                var.value = new  # a jax array: the next update may reuse its buffer
                var.opt_state = state
                var.version += 1
                out[key] = {"version": var.version, "staleness": stale}
        return out

    def push_rows(self, key: str, ids: np.ndarray, grads: np.ndarray, version: int,
                  worker: int = 0) -> dict[str, int]:
        """Row-sparse update: only rows ``ids`` (duplicates summed) and their optimizer state.

        Optimizer state leaves shaped like the variable are gathered and scattered by row (lazy
        row-wise sgd / adagrad / adam); scalar leaves (step counts) are shared by the table.
        """
        var = self._get(key)
        ids = self._check_ids(var, ids)
        grads = np.asarray(grads)
        if grads.shape != (ids.size, *var.value.shape[1:]):
            raise PSInvalidArgumentError(
                f"{self.task}: row gradients for {key!r} have shape {grads.shape}, expected "
                f"{(ids.size, *var.value.shape[1:])} for {ids.size} ids",
                task=self.task,
            )
        self._check_dtype(var, grads, "row gradients")
        uniq, inv = np.unique(ids, return_inverse=True)
        if uniq.size != ids.size:
            summed = np.zeros((uniq.size, *grads.shape[1:]), grads.dtype)
            np.add.at(summed, inv, grads)
            ids, grads = uniq, summed
        with var.lock:
            if isinstance(var.value, jax.Array):  # a dense update made it a jax array
                var.value = aligned_copy(var.value)
                var.opt_state = _writable(var.opt_state)
            elif var.kind != "rows" and not _unshared(var):
                # A dense pull hands out the value itself: rows are written into a copy.
                var.value = aligned_copy(var.value)
            stale = self._record(var, version)
            if var.optimizer is None:
                var.value[ids] += grads.astype(var.value.dtype)
            else:
                _, _, rowfn = _transform(var.optimizer)
                shape = var.value.shape
                rows_state = jax.tree.map(
                    lambda s: s[ids] if np.shape(s) == shape else s, var.opt_state
                )
                new_rows, new_state = rowfn(var.value[ids], grads, rows_state)
                var.value[ids] = np.asarray(new_rows)

                def put(full, part):
                    if np.shape(full) == shape:
                        full[ids] = np.asarray(part)
                        return full
                    return np.array(part)

                var.opt_state = jax.tree.map(put, var.opt_state, new_state)
            var.version += 1
            return {"version": var.version, "staleness": stale}

    def assign(self, values: dict[str, np.ndarray]) -> dict[str, int]:
        """Replaces the values of existing variables (TF's ``variable.assign``, Keras'
        ``set_weights``); the optimizer state is kept. Returns the new versions.

        Raises:
            PSInvalidArgumentError: a value's shape or dtype differs from the variable's.
        """
        out = {}
        for key, value in values.items():
            var = self._get(key)
            value = np.asarray(value)
            if value.shape != var.value.shape:
                raise PSInvalidArgumentError(
                    f"{self.task}: value for {key!r} has shape {value.shape}, the variable "
                    f"has {var.value.shape}", task=self.task)
            self._check_dtype(var, value, "value")
            value = aligned_copy(value)
            with var.lock:
                var.value = value
                var.version += 1
                out[key] = var.version
        return out

    def learning_rate(self, prefix: str, value: float | None = None) -> dict[str, Any]:
        """Reads (``value=None``) or sets the learning rate of the optimizers of the
        variables whose keys start with ``prefix``.

        Setting rewrites each optimizer spec's constant ``learning_rate`` (every transform of
        a chain that has one); the optimizer state is kept (its structure does not depend on
        the rate), the next push uses the new rate, and checkpoints record it. Each new
        rate compiles the update once per variable shape.

        Returns:
            ``{"learning_rate": the rate (None: no variable has one), "variables": count}``.

        Raises:
            PSInvalidArgumentError: a variable's rate follows a schedule (the ps recomputes it
                every update), or no variable under ``prefix`` has an optimizer.
        """
        with self._vars_lock:
            items = [v for k, v in self._vars.items() if k.startswith(prefix)]
        rates = [_spec_learning_rate(v.optimizer) for v in items if v.optimizer is not None]
        rates = [r for r in rates if r is not None]
        if value is None:
            return {"learning_rate": rates[0] if rates else None, "variables": len(rates)}
        if not rates:
            raise PSInvalidArgumentError(
                f"{self.task}: no variable under {prefix!r} has an optimizer with a "
                f"learning_rate to set", task=self.task)
        if any(isinstance(r, dict) for r in rates):
            raise PSInvalidArgumentError(
                f"{self.task}: the learning rate of {prefix!r} follows a schedule, which the ps "
                f"recomputes at every update; use a constant learning rate to change it at run "
                f"time (e.g. with ReduceLROnPlateau)", task=self.task)
        changed = 0
        for var in items:
            if var.optimizer is None or _spec_learning_rate(var.optimizer) is None:
                continue
            spec = _with_learning_rate(var.optimizer, float(value))
            tx, _, _ = _transform(spec)
            with var.lock:
                if var.opt_state is not None and (
                        jax.tree.structure(tx.init(jnp.zeros((), var.value.dtype)))
                        != jax.tree.structure(var.opt_state)):
                    # Same transforms, same structure: only a different spec could differ.
                    raise PSInvalidArgumentError(
                        f"{self.task}: the optimizer state of {var.key!r} does not fit "
                        f"{spec}", task=self.task)
                var.optimizer = spec
            changed += 1
        return {"learning_rate": float(value), "variables": changed}

    # ------------------------------------------------------------------ status / markers
    def set_marker(self, name: str) -> None:
        """Records a marker (the chief sets ``ready/<collection>`` after creating it)."""
        with self._vars_lock:
            self._markers.add(name)

    def status(self) -> dict[str, Any]:
        """Variables (version, shape, dtype, staleness stats), markers, incarnation."""
        with self._vars_lock:
            variables = {k: v.stats() for k, v in self._vars.items()}
            markers = sorted(self._markers)
        with self._clock_cond:
            clocks = {str(k): v for k, v in self._clocks.items()}
        return {
            "task": self.task,
            "incarnation": self.incarnation,
            "variables": variables,
            "markers": markers,
            "clocks": clocks,
            "restored_step": self.restored_step,
        }

    # ------------------------------------------------------------------ SSP clock
    def clock(self, worker: int, clock: float, num_workers: int, max_staleness: int | None,
              wait_s: float) -> dict[str, Any]:
        """Records that ``worker`` starts step ``clock``; waits (up to ``wait_s``) until it is at
        most ``max_staleness`` steps ahead of the slowest of ``num_workers`` workers.

        ``clock = inf`` marks a worker as finished (it no longer holds others back).
        """
        deadline = time.monotonic() + min(wait_s, self.max_wait_seconds)
        with self._clock_cond:
            self._clocks[worker] = max(self._clocks.get(worker, 0), clock)
            self._clock_cond.notify_all()

            def slowest():
                return min(
                    ((self._clocks.get(w, 0), w) for w in range(num_workers)),
                    default=(clock, worker),
                )

            if max_staleness is None or clock == float("inf"):
                return {"ok": True, "slowest": list(slowest())}
            while True:
                low, who = slowest()
                if clock - low <= max_staleness:
                    return {"ok": True, "slowest": [low, who]}
                left = deadline - time.monotonic()
                if left <= 0:
                    return {"ok": False, "slowest": [low, who]}
                self._clock_cond.wait(left)

    # ------------------------------------------------------------------ checkpoints
    def confine_checkpoints(self) -> None:
        """From now on ``save`` / ``restore`` only use directories under the checkpoint root.

        A directory a request names is resolved (relative to the root, symlinks followed)
        and refused unless it lies under the root; without a root every ``save`` / ``restore``
        is refused. A server reachable over the network calls this: a token holder then
        cannot make it write, prune or read files elsewhere.

        Example:
            >>> from jaxdist.ps import ParameterService
            >>> svc = ParameterService("ps:0", checkpoint_dir="/ckpt")
            >>> svc.confine_checkpoints()
            >>> svc.save("/etc", step=1)
            Traceback (most recent call last):
            ...
            jaxdist.ps.PSInvalidArgumentError: ps:0 refuses save to '/etc': it resolves to '/etc',
            outside ...
        """
        self._confined = True

    def _checkpoint_directory(self, requested: str | None, what: str) -> str | None:
        """The directory ``what`` (save / restore) may use for ``requested``."""
        return checkpoint_directory(self.task, requested, what, confined=self._confined,
                                    root=self.checkpoint_root, default=self.checkpoint_dir)

    def save(self, directory: str | None, step: int, keep: int | None = None) -> str:
        """Writes every variable, its optimizer state and version to
        ``<directory>/<task>/ckpt-<step>`` atomically (temp dir, then rename); returns the path.

        Args:
            keep: then delete this task's older checkpoints beyond the newest ``keep`` (and
                leftovers of interrupted saves), never the one the chief's pointer names (the
                last step every ps saved). ``None`` keeps all.
        """
        check_keep(self.task, keep)
        directory = self._checkpoint_directory(directory, "save")
        variables: dict[str, dict[str, Any]] = {}
        arrays: dict[str, np.ndarray] = {}
        with self._vars_lock:
            items = list(self._vars.items())
        for key, var in items:
            with var.lock:
                state_leaves = jax.tree.leaves(var.opt_state) if var.opt_state is not None else []
                variables[key] = {
                    "kind": var.kind,
                    "optimizer": var.optimizer,
                    "version": var.version,
                    "num_state": len(state_leaves),
                }
                arrays[f"v/{key}"] = np.array(var.value)
                for i, leaf in enumerate(state_leaves):
                    arrays[f"s/{key}/{i}"] = np.array(leaf)
        return write_task_checkpoint(directory, self.task, step, variables, arrays,
                                     markers=self._markers, keep=keep)

    def restore(self, directory: str | None = None, step: int | None = None) -> int:
        """Replaces all state with checkpoint ``step`` (default: the latest); returns the step."""
        directory = self._checkpoint_directory(directory, "restore")
        step, meta, arrays = read_task_checkpoint(directory, self.task, step)
        new_vars = {}
        for key, info in meta["variables"].items():
            value = aligned_copy(arrays[f"v/{key}"])
            state = None
            if info["optimizer"] is not None:
                tx, _, _ = _transform(info["optimizer"])
                template = tx.init(jnp.asarray(value))
                leaves = [aligned_copy(arrays[f"s/{key}/{i}"])
                          for i in range(info["num_state"])]
                state = jax.tree.unflatten(jax.tree.structure(template), leaves)
            new_vars[key] = _Var(key, value, info["kind"], info["optimizer"], state,
                                 version=int(info["version"]))
        with self._vars_lock:
            self._vars = new_vars
            self._markers = set(meta.get("markers", []))
        self.restored_step = step
        return step


def _check_optimizer_dtype(task: str, key: str, dtype: np.dtype, opt: dict) -> None:
    """Refuses an optimizer variable JAX cannot hold in its own dtype on this ps.

    Optimizer updates are jitted: without ``jax_enable_x64`` JAX computes a float64 / int64
    variable's update in 32 bits and the variable would silently come back as float32 (its
    small updates lost) after the first push.
    """
    if dtype.itemsize == 8 and dtype.kind in "fiu" and not jax.config.jax_enable_x64:
        name = opt.get("name", "the optimizer") if isinstance(opt, dict) else "the optimizer"
        narrow = np.dtype(dtype.kind + "4")
        raise PSInvalidArgumentError(
            f"{task}: variable {key!r} is {dtype} with ps-side optimizer {name!r}, but this ps "
            f"runs JAX without jax_enable_x64, which would compute its updates in 32 bits and "
            f"turn it into {narrow} after the first push; create it as {narrow} (e.g. "
            f"np.asarray(value, np.{narrow})), or start every ps task with JAX_ENABLE_X64=1",
            task=task,
        )


def _spec_learning_rate(spec: dict[str, Any] | None) -> Any:
    """The ``learning_rate`` of an optimizer spec JSON (the first one of a chain): a number,
    a schedule description (dict), or ``None``."""
    if not spec:
        return None
    if spec.get("name") == "chain":
        for part in spec.get("parts", []):
            rate = _spec_learning_rate(part)
            if rate is not None:
                return rate
        return None
    rate = spec.get("kwargs", {}).get("learning_rate")
    return float(rate) if isinstance(rate, (int, float)) and not isinstance(rate, bool) \
        else rate


def _with_learning_rate(spec: dict[str, Any], value: float) -> dict[str, Any]:
    """``spec`` with every constant ``learning_rate`` set to ``value``."""
    if spec.get("name") == "chain":
        return {**spec, "parts": [_with_learning_rate(p, value) for p in spec.get("parts", [])]}
    kwargs = spec.get("kwargs", {})
    if "learning_rate" not in kwargs:
        return spec
    return {**spec, "kwargs": {**kwargs, "learning_rate": value}}


__all__ = ["ParameterService"]
