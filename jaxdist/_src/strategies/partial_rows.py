"""The real rows of a partial-batch step: which outputs of ``run`` are per row, and their rows.

On TF's last partial batch the replicas get different numbers of rows (some none); jaxdist
pads every replica's rows with zeros to one shape (``padded_rows``) so one SPMD program runs,
and the input ``PerReplica`` records each replica's real row count (``lengths``).

The rule for the outputs of such a step: an output that **varies per replica** and whose
per-replica **leading axis is the batch's row axis** is a per-row output (predictions,
per-example losses, labels passed through ...): it comes back as a ``PerReplica`` carrying the
step's ``lengths``, so ``.values``, ``experimental_local_results``, ``gather`` and ``reduce(...,
axis=0)`` see each replica's real rows only, in order. Every other output (scalars, sums,
gradients, replicated values) is returned as on a full step.

"Is the row axis" is decided from shapes, once per compiled step: an output qualifies if its
leading axis has the padded row count *and* follows the row count when the replica function is
traced again (abstractly, nothing runs) with one more row in every batch input. So a gradient
or a per-class vector whose size happens to equal the padded row count is not cut. A replica
function that cannot be traced with another row count (shapes fixed in its code) falls back to
the leading-axis test alone.

Example:
    >>> from jaxdist._src.strategies.partial_rows import per_row_lengths
    >>> per_row_lengths(((16, 13, 0, 0), 16), [(4, 16, 10), (4,)])   # (replicas, rows, ...)
    [(16, 13, 0, 0), None]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist._src.strategies.reduce_util import ReduceOp
from jaxdist._src.values.per_replica import PerReplica

#: ``(lengths, padded_rows)`` of a partial-batch step: each replica's real row count, and the
#: row count every replica's rows are padded to.
Partial = tuple[tuple[int, ...], int]


def per_row_lengths(
    partial: Partial | None,
    out_shapes: Sequence[Sequence[int]],
    inputs: Sequence[Any] = (),
    input_kinds: Sequence[str] = (),
    trace_shapes: Callable[[list[Any]], Sequence[Any]] | None = None,
) -> list[tuple[int, ...] | None]:
    """The ``lengths`` each output of a step carries (``None``: not a per-row output).

    Args:
        partial: the step's ``(lengths, padded_rows)``; ``None`` on a full step.
        out_shapes: the outputs' stacked shapes, ``(replicas, ...)``.
        inputs: the step's array inputs (stacked per-replica values and replicated arrays).
        input_kinds: ``"pr"`` (per-replica) or ``"arr"`` for each input.
        trace_shapes: traces the step abstractly on other inputs (``jax.ShapeDtypeStruct``s
            allowed) and returns its outputs' stacked shapes; ``None``: the leading-axis
            test alone.

    Example:
        >>> from jaxdist._src.strategies.partial_rows import per_row_lengths
        >>> per_row_lengths(((2, 1), 2), [(2, 2, 5), (2, 2)])
        [(2, 1), (2, 1)]
    """
    if partial is None:
        return [None] * len(out_shapes)
    lengths, padded = tuple(partial[0]), int(partial[1])
    candidates = [len(s) >= 2 and int(s[1]) == padded for s in out_shapes]
    if not any(candidates) or trace_shapes is None:
        return [lengths if c else None for c in candidates]
    grown = []
    for x, kind in zip(inputs, input_kinds):
        shape = tuple(getattr(x, "shape", ()))
        if kind == "pr" and len(shape) >= 2 and shape[1] == padded:
            x = jax.ShapeDtypeStruct((shape[0], padded + 1, *shape[2:]), x.dtype)
        grown.append(x)
    try:
        grown_shapes = [tuple(getattr(s, "shape", s)) for s in trace_shapes(grown)]
    except Exception:  # shapes fixed in the replica function: the leading-axis test alone
        return [lengths if c else None for c in candidates]
    if len(grown_shapes) != len(out_shapes):
        return [lengths if c else None for c in candidates]
    return [
        lengths if c and len(g) >= 2 and g[1] == padded + 1 else None
        for c, g in zip(candidates, grown_shapes)
    ]


def batch_dependent_outputs(closed_jaxpr: Any, dependent_inputs: Sequence[bool]) -> list[bool]:
    """Which outputs of a traced step may depend on the inputs marked True (its batch).

    Follows the data through the step's equations, into ``shard_map`` and ``jit`` bodies
    (where one equation's inputs and outputs are its body's); any other equation (a loop, a
    custom derivative) makes all its outputs depend on all its inputs. Conservative: an output
    marked False does not depend on those inputs.

    Example:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from jaxdist._src.strategies.partial_rows import batch_dependent_outputs
        >>> jaxpr = jax.make_jaxpr(lambda params, batch: (params + 1, jnp.sum(batch) * params))(
        ...     jnp.ones(()), jnp.ones(3))
        >>> batch_dependent_outputs(jaxpr, [False, True])
        [False, True]
    """
    def walk(jaxpr: Any, marked: Sequence[bool]) -> list[bool]:
        dep: set[int] = {id(v) for v, m in zip(jaxpr.invars, marked) if m}
        for eqn in jaxpr.eqns:
            ins = [id(v) in dep for v in eqn.invars]
            if not any(ins):
                continue
            inner = eqn.params.get("jaxpr")
            inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's open jaxpr
            if (inner is not None and hasattr(inner, "eqns")
                    and len(inner.invars) == len(eqn.invars)
                    and len(inner.outvars) == len(eqn.outvars)):
                outs = walk(inner, ins)
            else:
                outs = [True] * len(eqn.outvars)
            dep.update(id(v) for v, o in zip(eqn.outvars, outs) if o)
        return [id(v) in dep for v in jaxpr.outvars]

    return walk(getattr(closed_jaxpr, "jaxpr", closed_jaxpr), list(dependent_inputs))


def padding_warning(name: str, partial: Partial, outputs: Sequence[int]) -> str:
    """The one-time warning for a replica function that reduced a padded batch unmasked.

    Example:
        >>> from jaxdist._src.strategies.partial_rows import padding_warning
        >>> print(padding_warning("step_fn", ((32, 31), 32), [0])[:60])
        strategy.run(step_fn): a partial batch reached this replica
    """
    lengths, padded = partial
    return (
        f"strategy.run({name}): a partial batch reached this replica function with each "
        f"replica's rows zero-padded to {padded} (real rows per replica: {list(lengths)}; TF "
        f"hands each replica only its real rows), and output(s) {list(outputs)} depend on the "
        f"batch while the function never read the row mask: a mean over the rows, or a sum of "
        f"anything that is not zero on a zero row (a loss, a bias), counts the padding rows. "
        f"Mask them: `mask = "
        f"jaxdist.get_replica_context().row_mask(x.shape[0])` (True for real rows; "
        f"`ctx.valid_rows` is this replica's real row count), e.g. "
        f"`jnp.sum(jnp.where(mask, v, 0)) / jnp.sum(mask)`, or scale per-example losses with "
        f"`jaxdist.compute_average_loss(per_example, global_batch_size=...)`, which masks them. "
        f"Reading the mask (even outside the reduction) silences this warning; it is given "
        f"once per function."
    )


def wrap_outputs(flat: Sequence[Any], varying: Sequence[bool],
                 lengths: Sequence[tuple[int, ...] | None]) -> list[Any]:
    """The outputs of a compiled step: ``PerReplica`` for varying leaves (per-row ones of a
    partial step carry its ``lengths``), the replicated arrays as they are.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxdist._src.strategies.partial_rows import wrap_outputs
        >>> stacked_preds, total = jnp.ones((2, 4)), jnp.float32(5.0)   # 2 replicas, 4 rows
        >>> wrap_outputs([stacked_preds, total], [True, False], [(4, 1), None])
        [PerReplica(num_replicas=2, shape=(4,), dtype=float32, lengths=(4, 1)), Array(5., ...)]
    """
    return [PerReplica(x, n) if v else x for x, v, n in zip(flat, varying, lengths)]


def _parts(v: PerReplica) -> tuple[list[Any], bool]:
    """Each replica's real rows, and whether they are traced (inside a user's ``jax.jit``)."""
    if isinstance(v.stacked, jax.core.Tracer):
        return [v.stacked[i, :n] for i, n in enumerate(v.lengths or ())], True
    return [np.asarray(jax.device_get(p)) for p in v.values], False


def gather_rows(v: PerReplica, axis: int, sharding: Any) -> Any:
    """``strategy.gather`` of a partial-batch ``PerReplica``: the real rows, in replica order.

    Raises:
        ValueError: ``axis`` is not the row axis (replicas have different row counts).

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxdist import PerReplica
        >>> from jaxdist._src.strategies.partial_rows import gather_rows
        >>> per_row_predictions = PerReplica(jnp.ones((2, 3)), (3, 1))  # replica 1 has 1 row
        >>> gather_rows(per_row_predictions, 0, None)
        Array([1., 1., 1., 1.], dtype=float32)
    """
    parts, traced = _parts(v)
    ndim = max(len(v.shape), 1)
    if axis % ndim != 0:
        raise ValueError(
            f"A partial batch (per-replica rows {list(v.lengths or ())}) can only be gathered "
            f"along axis 0, got axis={axis}"
        )
    if traced:
        return jnp.concatenate(parts, axis=0)
    return jax.device_put(np.concatenate(parts, axis=0), sharding)


def reduce_rows(op: ReduceOp, v: PerReplica, axis: int | None) -> Any:
    """Reduces a partial-batch ``PerReplica`` as TF does: along ``axis=0`` over the real rows
    only; across replicas (``axis=None``) only if the replicas' shapes agree.

    Raises:
        ValueError: ``axis=None`` and the replicas have different row counts, or ``axis`` is
            not the row axis.

    Example:
        >>> import jax.numpy as jnp
        >>> from jaxdist import PerReplica, ReduceOp
        >>> from jaxdist._src.strategies.partial_rows import reduce_rows
        >>> per_row_losses = PerReplica(jnp.ones((2, 3)), (3, 1))   # replica 1 has 1 row
        >>> reduce_rows(ReduceOp.SUM, per_row_losses, 0)     # the sum over the real rows
        Array(4., dtype=float32)
    """
    parts, traced = _parts(v)
    xp = jnp if traced else np
    if axis is None:
        if len({tuple(p.shape) for p in parts}) != 1:
            raise ValueError(
                f"Cannot reduce per-replica values of different shapes "
                f"{[tuple(p.shape) for p in parts]} (a partial batch) with axis=None; pass "
                f"axis=0 to reduce over the rows"
            )
        total = sum(parts[1:], parts[0])
        return jnp.asarray(total / len(parts) if op is ReduceOp.MEAN else total)
    if axis % max(len(v.shape), 1) != 0:
        raise ValueError(
            f"A partial batch (per-replica rows {list(v.lengths or ())}) can only be reduced "
            f"along axis 0, got axis={axis}"
        )
    rows = xp.concatenate(parts, axis=0)
    total = xp.sum(rows, axis=0)
    if op is ReduceOp.MEAN:
        return jnp.asarray(total / rows.shape[0] if rows.shape[0] else xp.full_like(total, np.nan))
    return jnp.asarray(total)
