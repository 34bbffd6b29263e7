"""``DatasetIterator``: ``iter(dataset)``, with ``tf.data.Iterator``'s methods."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from jaxdist._src.input.optional import Optional


class DatasetIterator:
    """``iter(dataset)``: the elements in order, with ``tf.data.Iterator``'s ``get_next`` and
    ``get_next_as_optional`` (what the default strategy's "distributed" iterator is in TF).

    Example:
        >>> import jaxdist
        >>> it = iter(jaxdist.Dataset.range(2))
        >>> int(it.get_next()), int(next(it)), it.get_next_as_optional().has_value()
        (0, 1, False)
    """

    __slots__ = ("_it",)

    def __init__(self, it: Iterator[Any]):
        self._it = it

    def __iter__(self) -> DatasetIterator:
        return self

    def __next__(self) -> Any:
        return next(self._it)

    def get_next(self) -> Any:
        """The next element (``StopIteration`` at the end; TF: ``OutOfRangeError``)."""
        return next(self._it)

    def get_next_as_optional(self) -> Optional:
        """The next element as an ``Optional``: no value at the end of the data."""
        try:
            return Optional.from_value(next(self._it))
        except StopIteration:
            return Optional.empty(None)


__all__ = ["DatasetIterator"]
