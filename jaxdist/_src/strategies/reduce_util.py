"""``ReduceOp``: how values from different replicas are combined (tf.distribute.ReduceOp)."""

from __future__ import annotations

import enum


class ReduceOp(enum.Enum):
    """How values are reduced across replicas: ``SUM`` or ``MEAN`` (``tf.distribute.ReduceOp``).

    ``SUM`` adds the values of all replicas; ``MEAN`` averages them. The strings ``"SUM"`` and
    ``"MEAN"`` (any case) are accepted wherever a ``ReduceOp`` is.

    Example:
        >>> from jaxdist import ReduceOp
        >>> ReduceOp.from_value("mean") is ReduceOp.MEAN
        True
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @staticmethod
    def from_value(op: ReduceOp | str) -> ReduceOp:
        """Returns the ``ReduceOp`` for ``op`` (a ``ReduceOp`` or its name)."""
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str):
            try:
                return ReduceOp[op.upper()]
            except KeyError:
                pass
        raise ValueError(
            f"Unknown reduce op {op!r}: expected ReduceOp.SUM, ReduceOp.MEAN, 'SUM' or 'MEAN'."
        )
