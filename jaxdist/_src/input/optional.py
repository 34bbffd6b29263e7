"""``Optional``: a value that may be absent (``tf.experimental.Optional``).

What ``DistributedIterator.get_next_as_optional()`` returns: the next batch, or no value at the
end of the data, with TF's names (``has_value``, ``get_value``, ``element_spec``,
``from_value``, ``empty``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jaxdist._src.values.per_replica import PerReplica, is_per_replica

_NO_VALUE = object()


def _spec_of(value: Any) -> Any:
    """Per leaf: a ``PerReplica``'s ``PerReplicaSpec``, an array's ``jax.ShapeDtypeStruct``."""
    def one(x):
        if isinstance(x, PerReplica):
            return x.spec
        return jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x))
    return jax.tree.map(one, value, is_leaf=is_per_replica)


class Optional:
    """A value that may be absent (``tf.experimental.Optional``).

    ``has_value()`` is a Python bool (TF's is a boolean tensor; both work in ``if``);
    ``get_value()`` of an empty optional raises ``ValueError`` with TF's message (TF raises
    ``InvalidArgumentError``). Not hashable and never ``None``: test it with ``has_value()``.

    Example:
        >>> import jaxdist
        >>> import numpy as np
        >>> opt = jaxdist.data.Optional.from_value(np.int32(42))
        >>> opt.has_value(), int(opt.get_value())
        (True, 42)
        >>> empty = jaxdist.data.Optional.empty(None)
        >>> empty.has_value()
        False
    """

    __slots__ = ("_value", "_spec")
    __hash__ = None  # type: ignore[assignment]  # not a static argument of strategy.run

    def __init__(self, value: Any = _NO_VALUE, element_spec: Any = _NO_VALUE):
        self._value = value
        self._spec = element_spec

    @staticmethod
    def from_value(value: Any) -> Optional:
        """An optional holding ``value``."""
        return Optional(value)

    @staticmethod
    def empty(element_spec: Any) -> Optional:
        """An optional with no value, of elements typed ``element_spec``."""
        return Optional(_NO_VALUE, element_spec)

    def has_value(self) -> bool:
        """Whether this optional holds a value."""
        return self._value is not _NO_VALUE

    def get_value(self) -> Any:
        """The value; ``ValueError`` when there is none (TF: ``InvalidArgumentError``)."""
        if self._value is _NO_VALUE:
            raise ValueError("The optional variant does not have a value.")
        return self._value

    @property
    def element_spec(self) -> Any:
        """The type of the value (``jax.ShapeDtypeStruct`` / ``PerReplicaSpec`` pytree)."""
        if self._spec is _NO_VALUE:
            if self._value is _NO_VALUE:
                raise ValueError("this empty Optional was made without an element_spec")
            return _spec_of(self._value)
        return self._spec() if callable(self._spec) else self._spec

    def __repr__(self) -> str:
        if self._value is _NO_VALUE:
            return "Optional(has_value=False)"
        return f"Optional(has_value=True, value={self._value!r})"


def empty_with_lazy_spec(spec: Callable[[], Any] | None) -> Optional:
    """An empty optional whose ``element_spec`` is computed when asked (a distributed
    iterator's, at the end of its data)."""
    return Optional(_NO_VALUE, spec if spec is not None else _NO_VALUE)


__all__ = ["Optional", "empty_with_lazy_spec"]
