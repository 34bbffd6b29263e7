"""``PSVariables``: a pytree of variables that lives on ps tasks, split and placed by a layout.

A ``Layout`` says, for every leaf of the user's pytree, which shards it is cut into (rows on
axis 0) and which ps task holds each shard. ``PSVariables`` pulls the shards (every task in
parallel), reassembles the pytree, and pushes gradients shard by shard, each push carrying the
version the gradient was computed from.

Example:
    >>> import jax.numpy as jnp
    >>> import numpy as np
    >>> import jaxdist.ps
    >>> strategy = jaxdist.ParameterServerStrategy()   # no TF_CONFIG: trains locally
    >>> init_fn = lambda: {"w": jnp.zeros(3)}
    >>> params = strategy.create_variables(init_fn, optimizer=jaxdist.ps.optimizers.sgd(0.1))
    >>> tree = params.pull()                   # numpy pytree, versions recorded
    >>> _ = params.apply_gradients({"w": np.ones(3, np.float32)})  # ps applies sgd
    >>> params.pull()["w"]
    array([-0.1, -0.1, -0.1], dtype=float32)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxdist._src.ps.errors import PSInvalidArgumentError, VariablesNotReadyError
from jaxdist._src.ps.optimizers import OptimizerSpec
from jaxdist._src.ps.partitioners import num_shards_for, split_rows
from jaxdist._src.ps.placement import ReplicaDeviceSetter, VariableSpec


@dataclass(frozen=True)
class ShardInfo:
    """One piece of a leaf: its key on the ps, its task, and its rows ``[start, stop)``."""

    key: str
    task: int
    start: int
    stop: int


@dataclass(frozen=True)
class LeafInfo:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    shards: tuple[ShardInfo, ...]


def leaf_names(tree: Any) -> list[str]:
    """Readable, stable names of a pytree's leaves (``"dense/kernel"``)."""
    paths, _ = jax.tree_util.tree_flatten_with_path(tree)
    names = []
    for path, _ in paths:
        parts = []
        for k in path:
            for attr in ("key", "name", "idx"):
                if hasattr(k, attr):
                    parts.append(str(getattr(k, attr)))
                    break
            else:
                parts.append(str(k))
        names.append("/".join(parts) or "value")
    return names


class Layout:
    """Where each leaf of a pytree lives: shards (rows on axis 0) and their ps tasks.

    Args:
        collection: a name prefix for the ps keys (e.g. ``"model"``).
        abstract: the pytree (arrays or ``jax.ShapeDtypeStruct``s).
        setter: the placement device function.
        partitioner: how many shards each leaf gets (``None``: one).
        colocate_task: put every leaf, unsplit, on this task (``colocate_vars_with``).
    """

    def __init__(self, collection: str, abstract: Any, setter: ReplicaDeviceSetter,
                 partitioner: Any = None, colocate_task: int | None = None):
        leaves, self.treedef = jax.tree.flatten(abstract)
        names = leaf_names(abstract)
        self.collection = collection
        self.leaves: list[LeafInfo] = []
        for name, leaf in zip(names, leaves):
            shape = tuple(int(d) for d in np.shape(leaf))
            dtype = np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
            full = f"{collection}/{name}"
            if colocate_task is not None or not shape:
                n = 1
            else:
                n = num_shards_for(partitioner, shape, dtype)
            shards = []
            for i, (start, stop) in enumerate(split_rows(shape[0], n) if shape else [(0, 0)]):
                key = full if n == 1 else f"{full}/part_{i}"
                part_shape = (stop - start, *shape[1:]) if shape else ()
                if colocate_task is not None:
                    task = colocate_task
                else:
                    task = setter.task_of(VariableSpec(key, part_shape, dtype))
                shards.append(ShardInfo(key, task, start, stop))
            self.leaves.append(LeafInfo(full, shape, dtype, tuple(shards)))

    def keys_by_task(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for leaf in self.leaves:
            for s in leaf.shards:
                out.setdefault(s.task, []).append(s.key)
        return out

    def split(self, tree: Any, what: str = "value") -> dict[int, dict[str, np.ndarray]]:
        """Cuts a pytree shaped like the layout into ``{task: {key: shard array}}``.

        A ``"gradient"`` of another dtype than its variable is cast to the variable's dtype
        when the cast stays within its kind (float32 -> bfloat16, int -> float), as the ps
        accepts only the variable's own dtype; any other (complex -> float, float -> int)
        raises, naming both dtypes.
        """
        leaves = self.treedef.flatten_up_to(tree)
        out: dict[int, dict[str, np.ndarray]] = {}
        for info, x in zip(self.leaves, leaves):
            x = np.asarray(jax.device_get(x))
            if x.shape != info.shape:
                raise PSInvalidArgumentError(
                    f"{what} for {info.name!r} has shape {x.shape}, the variable has {info.shape}"
                )
            if what == "gradient" and x.dtype != info.dtype:
                if not np.can_cast(x.dtype, info.dtype, "same_kind"):
                    raise PSInvalidArgumentError(
                        f"{what} for {info.name!r} has dtype {x.dtype}, the variable has "
                        f"{info.dtype}: a {x.dtype} -> {info.dtype} cast would lose values "
                        f"(e.g. an imaginary part); compute the gradient in {info.dtype}"
                    )
                x = x.astype(info.dtype)
            for s in info.shards:
                part = x if len(info.shards) == 1 else x[s.start:s.stop]
                out.setdefault(s.task, {})[s.key] = part
        return out

    def placement(self) -> Any:
        """A pytree like the variables whose leaves list their shards' ps device strings."""
        return self.treedef.unflatten(
            [[f"/job:ps/task:{s.task}" for s in leaf.shards] for leaf in self.leaves]
        )


class PSVariables:
    """A handle to a pytree of variables held by ps tasks.

    Not an array: pass it to ``strategy.run`` (which pulls it) or call ``pull()`` yourself.
    ``apply_gradients(grads)`` pushes a gradient pytree of the same structure.
    """

    def __init__(self, client: Any, layout: Layout, worker_transform: OptimizerSpec | None,
                 worker_index: int = 0, reduce_fn: Callable[[Any], Any] | None = None):
        self._client = client
        self.layout = layout
        self._worker_spec = worker_transform
        self._worker_tx = worker_transform.build() if worker_transform is not None else None
        self._worker_state = None
        self._worker_index = worker_index
        self._reduce_fn = reduce_fn
        self._versions: dict[str, int] = {}
        self.last_push: dict[str, dict[str, int]] = {}

    @property
    def name(self) -> str:
        return self.layout.collection

    @property
    def worker_transform(self) -> OptimizerSpec | None:
        """The optimizer a worker applies to its gradients before pushing them (``None``: the
        gradients are pushed as they are). A closure that captures this handle rebuilds it on
        the worker with it."""
        return self._worker_spec

    @property
    def versions(self) -> dict[str, int]:
        """Versions of the shards as of the last ``pull``."""
        return dict(self._versions)

    def placement(self) -> Any:
        """Pytree of ``["/job:ps/task:<i>", ...]`` (one per shard) for every leaf."""
        return self.layout.placement()

    def pull(self) -> Any:
        """Fetches every shard (all ps tasks in parallel) and returns the numpy pytree."""
        by_task = self.layout.keys_by_task()
        tasks = sorted(by_task)
        results = self._client.call_many([(t, "Pull", {"keys": by_task[t]}, {}) for t in tasks])
        got: dict[str, np.ndarray] = {}
        for meta, arrays in results:
            got.update(arrays)
            self._versions.update(meta["versions"])
        leaves = []
        for info in self.layout.leaves:
            parts = [got[s.key] for s in info.shards]
            x = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
            leaves.append(x.reshape(info.shape))
        return self.layout.treedef.unflatten(leaves)

    read_value = pull

    def apply_gradients(self, grads: Any) -> dict[str, dict[str, int]]:
        """Pushes ``grads`` (same structure as the variables); each ps applies its optimizer.

        ``PerReplica`` leaves are summed over the replicas first. A worker-side transform
        (``clip_by_global_norm``) is applied to the whole gradient before the push.

        Returns:
            ``{key: {"version": new version, "staleness": versions applied in between}}``.
        """
        if self._reduce_fn is not None:
            grads = self._reduce_fn(grads)
        grads = jax.device_get(grads)
        if self._worker_tx is not None:
            if self._worker_state is None:
                self._worker_state = self._worker_tx.init(grads)
            grads, self._worker_state = self._worker_tx.update(grads, self._worker_state)
            grads = jax.device_get(grads)
        parts = self.layout.split(grads, "gradient")
        calls = []
        for task in sorted(parts):
            versions = {k: self._versions.get(k, 0) for k in parts[task]}
            calls.append(
                (task, "Push", {"versions": versions, "worker": self._worker_index}, parts[task])
            )
        out: dict[str, dict[str, int]] = {}
        for meta, _ in self._client.call_many(calls):
            out.update(meta["results"])
        self.last_push = out
        return out

    def assign(self, tree: Any) -> None:
        """Replaces the variables' values with ``tree`` (same structure, shapes and dtypes),
        every ps task in parallel; the optimizer state on the ps is kept (Keras'
        ``set_weights``). Every shard's version goes up by one.

        Example:
            >>> import jax, jaxdist
            >>> import jax.numpy as jnp
            >>> import numpy as np
            >>> strategy = jaxdist.ParameterServerStrategy()   # no TF_CONFIG: trains locally
            >>> params = strategy.create_variables(lambda: {"w": jnp.ones(3)})
            >>> params.assign(jax.tree.map(np.zeros_like, params.pull()))
        """
        parts = self.layout.split(jax.device_get(tree), "value")
        for meta, _ in self._client.call_many(
                [(task, "Assign", {}, parts[task]) for task in sorted(parts)]):
            self._versions.update(meta["versions"])

    def learning_rate(self) -> float | None:
        """The learning rate the ps tasks' optimizers apply now (``None``: none has a
        constant one). A schedule's description is returned as a dict."""
        task = min(self.layout.keys_by_task())
        meta, _ = self._client.call(task, "LearningRate", {"prefix": f"{self.name}/"})
        return meta["learning_rate"]

    def set_learning_rate(self, value: float) -> None:
        """Sets the learning rate of every ps task's optimizer for these variables; the
        next push uses it (the optimizer state is kept). Authenticated like every ps call.

        Raises:
            PSInvalidArgumentError: the rate follows a schedule, or is not in [0, 1e6].

        Example:
            >>> import jax.numpy as jnp
            >>> import jaxdist.ps
            >>> strategy = jaxdist.ParameterServerStrategy()   # no TF_CONFIG: trains locally
            >>> params = strategy.create_variables(lambda: {"w": jnp.ones(3)},
            ...                                    optimizer=jaxdist.ps.optimizers.sgd(0.1))
            >>> params.set_learning_rate(1e-4)      # e.g. from ReduceLROnPlateau
        """
        tasks = sorted(self.layout.keys_by_task())
        self._client.call_many([(t, "LearningRate", {"prefix": f"{self.name}/",
                                                     "value": float(value)}, {})
                                for t in tasks])

    def __repr__(self) -> str:
        n = sum(len(leaf.shards) for leaf in self.layout.leaves)
        return (f"PSVariables({self.name!r}, leaves={len(self.layout.leaves)}, shards={n}, "
                f"ps_tasks={self._client.num_tasks})")


def wait_for_marker(client: Any, marker: str, timeout: float, waiting_for: str) -> None:
    """Polls ps 0 until ``marker`` is set; raises ``VariablesNotReadyError`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        left = deadline - time.monotonic()
        meta, _ = client.call(0, "Status", {}, timeout=max(0.5, min(left, 10.0)))
        if marker in meta.get("markers", []):
            return
        if time.monotonic() + delay > deadline:
            raise VariablesNotReadyError(
                f"{waiting_for} did not create {marker.split('/', 1)[-1]!r} on "
                f"{client.task_name(0)} within {timeout:.1f} s (is the chief running?)",
                task=client.task_name(0),
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


__all__ = ["Layout", "LeafInfo", "PSVariables", "ShardInfo", "leaf_names", "wait_for_marker"]
