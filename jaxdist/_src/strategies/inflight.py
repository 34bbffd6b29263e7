"""Bounding the number of dispatched-but-unfinished steps.

With more forced CPU devices than cores, dispatching many steps that contain cross-device
collectives without waiting lets XLA's CPU collective rendezvous time out and abort the process.
Waiting on step ``k - max_in_flight`` before dispatching step ``k`` avoids it; on accelerators
two steps in flight are enough to hide the dispatch latency.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import jax


def _waited(x: Any) -> bool:
    """Waits for ``x``; ``False`` (without waiting) when it was donated to a step dispatched
    since (that step consumes it, and waiting for that step covers it). JAX 0.11 can say
    "called on deleted or donated buffer" before ``is_deleted()`` does."""
    if x.is_deleted():
        return False
    try:
        x.block_until_ready()
    except Exception as e:
        if "donated" in str(e) or x.is_deleted():
            return False
        raise
    return True


def _wait(leaves: list[Any] | tuple[Any, Any]) -> None:
    """Waits for a step: for its first output not donated since.

    ``leaves`` is the step's flat outputs, or ``(marker, outputs)``: one output array to wait
    on (``run`` picks the last leaf, usually the loss), and the output pytree whose leaves are
    waited on as below if the marker was donated since.

    The outputs of one compiled step become ready together (the step's execution ends on every
    device of the mesh, and an output array spans its devices), so one live output stands for
    the step; an output donated to a later step is skipped (that step consumes it, and waiting
    for it covers it). One wait costs about 1 µs, a wait on every output about 2 µs each.
    """
    if type(leaves) is tuple:
        marker, outputs = leaves
        if _waited(marker):
            return
        leaves = [x for x in jax.tree.leaves(outputs) if hasattr(x, "block_until_ready")]
    for x in leaves:
        if _waited(x):
            return


def _wait_each(arrays: list[Any]) -> None:
    """Waits on each array, skipping those donated since (``_waited``)."""
    for x in arrays:
        _waited(x)


class StepThrottle:
    """Keeps at most ``max_in_flight`` steps dispatched and not finished.

    Example:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from jaxdist._src.strategies.inflight import StepThrottle
        >>> step, data = jax.jit(lambda x: x * 2), [jnp.ones(3)] * 4
        >>> throttle = StepThrottle(2)
        >>> for batch in data:
        ...     throttle.before_dispatch()
        ...     out = step(batch)
        ...     throttle.after_dispatch(out)
    """

    def __init__(self, max_in_flight: int = 2):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self._pending: collections.deque[Any] = collections.deque()
        self._lock = threading.Lock()

    def before_dispatch(self) -> None:
        """Waits until fewer than ``max_in_flight`` steps are pending."""
        pending = self._pending
        while len(pending) >= self.max_in_flight:
            try:
                oldest = pending.popleft()  # atomic: another thread may have taken it
            except IndexError:
                return
            _wait(oldest)

    def after_dispatch(self, outputs: Any, marker: Any = None) -> None:
        """Records the outputs of a step just dispatched (a pytree, or its flat leaves).

        ``marker``: one output array of the step to wait on (the others are waited on only if
        it was donated to a later step by then), which spares flattening the outputs.
        """
        if marker is not None:
            leaves = (marker, outputs)
        elif type(outputs) is list:  # a compiled step's flat outputs: arrays only
            leaves = outputs
        else:
            leaves = [x for x in jax.tree.leaves(outputs) if hasattr(x, "block_until_ready")]
        self._pending.append(leaves)  # atomic (a deque)

    def wait_all(self) -> None:
        """Waits for every pending step."""
        with self._lock:
            pending, self._pending = list(self._pending), collections.deque()
        for leaves in pending:
            _wait(leaves)
