"""tf.data's shuffle: the reservoir of ``buffer_size`` items, and the seed of an unseeded shuffle.

Example:
    >>> import numpy as np
    >>> from jaxdist._src.input.shuffling import reservoir_rows
    >>> sorted(reservoir_rows(range(5), 2, np.random.default_rng(0)).tolist())
    [0, 1, 2, 3, 4]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np


class FreshSeed:
    """An unseeded shuffle's entropy, drawn anew in every process that unpickles it.

    TF: each worker's copy of an unseeded dataset (``create_per_worker_dataset(dataset)``)
    shuffles differently; within one process, iterating again is repeatable.
    """

    def __init__(self):
        self.value = np.random.SeedSequence().entropy

    def __reduce__(self):
        return (FreshSeed, ())


def reservoir(items: Iterable[Any], buffer_size: int, rng: np.random.Generator
               ) -> Iterator[Any]:
    """tf.data's shuffle: a buffer of ``buffer_size`` items; each output is a uniformly drawn
    buffer item, replaced by the next input; at the end the buffer is emptied in random order."""
    buf: list[Any] = []
    for item in items:
        if len(buf) < buffer_size:
            buf.append(item)
            continue
        j = int(rng.integers(len(buf)))
        yield buf[j]
        buf[j] = item
    for j in rng.permutation(len(buf)):
        yield buf[j]


def reservoir_rows(rows: Any, buffer_size: int, rng: np.random.Generator) -> np.ndarray:
    """The row order ``reservoir`` gives for ``rows`` (one permutation when the buffer holds
    every row)."""
    rows = np.asarray(rows, np.int64)
    if buffer_size >= len(rows):
        return rows[rng.permutation(len(rows))]
    return np.fromiter(reservoir(rows.tolist(), buffer_size, rng), np.int64, len(rows))


__all__ = ["FreshSeed", "reservoir", "reservoir_rows"]
