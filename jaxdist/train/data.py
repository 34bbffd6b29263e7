"""Training data: scikit-learn's digits, a synthetic generator, your own ``.npz`` arrays, and
the deterministic, resumable order in which the Trainer reads them.

The order of epoch ``e`` is a permutation drawn from ``numpy.random.default_rng([seed, e])``, so
a job that restarts at ``(epoch, step_in_epoch)`` sees exactly the batches an uninterrupted job
would have seen.

Example:
    >>> train, val = load_digits(validation_split=0.2)
    >>> train.x.shape, train.y.shape
    ((1437, 8, 8, 1), (1437,))
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np


class DataError(ValueError):
    """Arrays that cannot be used for training (mismatched rows, wrong dtype or rank)."""


@dataclasses.dataclass
class ArrayData:
    """In-memory examples: features ``x`` and labels ``y`` with the same number of rows.

    Example:
        >>> data = ArrayData(np.zeros((10, 4), np.float32), np.zeros((10,), np.int32))
        >>> len(data)
        10
    """

    x: np.ndarray
    y: np.ndarray

    def __post_init__(self):
        self.x = np.asarray(self.x)
        self.y = np.asarray(self.y)
        if self.x.ndim < 1 or self.y.ndim < 1:
            raise DataError(f"x and y must be batched arrays (rank >= 1), got shapes "
                            f"{self.x.shape} and {self.y.shape}")
        if self.x.shape[0] != self.y.shape[0]:
            raise DataError(f"x has {self.x.shape[0]} rows but y has {self.y.shape[0]}; "
                            f"expected one label per example")
        if not np.issubdtype(self.x.dtype, np.number):
            raise DataError(f"x must be numeric, got dtype {self.x.dtype}")
        if self.x.dtype != np.float32:
            self.x = self.x.astype(np.float32)

    def __len__(self) -> int:
        return int(self.x.shape[0])

    @property
    def num_classes(self) -> int:
        """``max(y) + 1`` for integer labels."""
        return int(self.y.max()) + 1 if len(self) else 0


def as_array_data(data: Any, what: str = "data") -> ArrayData:
    """Accepts ``ArrayData``, an ``(x, y)`` pair, or a mapping with ``"x"`` and ``"y"``."""
    if isinstance(data, ArrayData):
        return data
    if isinstance(data, Mapping) and "x" in data and "y" in data:
        return ArrayData(data["x"], data["y"])
    if isinstance(data, (tuple, list)) and len(data) == 2:
        return ArrayData(*data)
    raise DataError(f"{what}: expected an (x, y) pair of arrays or ArrayData, got "
                    f"{type(data).__name__}")


def split(data: ArrayData, validation_split: float, seed: int = 0
          ) -> tuple[ArrayData, ArrayData | None]:
    """Splits off a shuffled ``validation_split`` fraction (stratified by label)."""
    if validation_split <= 0:
        return data, None
    from sklearn.model_selection import train_test_split

    labels = data.y if data.y.ndim == 1 and np.issubdtype(data.y.dtype, np.integer) else None
    try:
        idx_tr, idx_va = train_test_split(np.arange(len(data)), test_size=validation_split,
                                          random_state=seed, stratify=labels)
    except ValueError:
        idx_tr, idx_va = train_test_split(np.arange(len(data)), test_size=validation_split,
                                          random_state=seed)
    idx_tr, idx_va = np.sort(idx_tr), np.sort(idx_va)
    return (ArrayData(data.x[idx_tr], data.y[idx_tr]),
            ArrayData(data.x[idx_va], data.y[idx_va]))


def load_digits(validation_split: float = 0.2, seed: int = 0
                ) -> tuple[ArrayData, ArrayData | None]:
    """scikit-learn's 8x8 handwritten digits (1797 images, 10 classes), scaled to [0, 1].

    Returns:
        ``(train, validation)``; images have shape ``(8, 8, 1)`` and labels are int32.
    """
    from sklearn.datasets import load_digits as _load

    bunch = _load()
    x = (bunch.images.astype(np.float32) / 16.0)[..., None]
    return split(ArrayData(x, bunch.target.astype(np.int32)), validation_split, seed)


def make_synthetic(num_examples: int = 4096, num_features: int = 32, num_classes: int = 10,
                   seed: int = 0, validation_split: float = 0.2
                   ) -> tuple[ArrayData, ArrayData | None]:
    """A learnable synthetic classification problem (Gaussian inputs, a random linear teacher).

    Example:
        >>> train, val = make_synthetic(1000, 16, 4)
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_examples, num_features)).astype(np.float32)
    teacher = rng.standard_normal((num_features, num_classes)).astype(np.float32)
    y = np.argmax(x @ teacher, axis=1).astype(np.int32)
    return split(ArrayData(x, y), validation_split, seed)


def load_npz(path: str | os.PathLike, validation_split: float = 0.2, seed: int = 0
             ) -> tuple[ArrayData, ArrayData | None]:
    """Your own arrays: a ``.npz`` file with ``x`` and ``y`` (and optionally ``x_val``, ``y_val``).

    Without ``x_val``/``y_val`` a ``validation_split`` fraction is held out.

    Raises:
        DataError: a missing array or mismatched rows.
    """
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    for key in ("x", "y"):
        if key not in arrays:
            raise DataError(f"{os.fspath(path)}: has no array {key!r} (found "
                            f"{sorted(arrays)}); expected 'x' and 'y'")
    train = ArrayData(arrays["x"], arrays["y"])
    if "x_val" in arrays and "y_val" in arrays:
        return train, ArrayData(arrays["x_val"], arrays["y_val"])
    return split(train, validation_split, seed)


def from_config(section: Mapping[str, Any]) -> tuple[ArrayData, ArrayData | None]:
    """Loads the data a validated ``data`` config section names."""
    name = section["name"]
    vs, seed = section["validation_split"], section["split_seed"]
    if name == "digits":
        return load_digits(vs, seed)
    if name == "synthetic":
        return make_synthetic(section["num_examples"], section["num_features"],
                              section["num_classes"], seed, vs)
    return load_npz(section["path"], vs, seed)


# ---------------------------------------------------------------------- batch order
def steps_per_epoch(num_examples: int, global_batch_size: int) -> int:
    """Full global batches per epoch (the last partial batch is dropped, as in training)."""
    return num_examples // global_batch_size


def epoch_order(num_examples: int, epoch: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """The example order of ``epoch``: the same for the same ``(seed, epoch)``, always."""
    if not shuffle:
        return np.arange(num_examples)
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def batch_index(order: np.ndarray, step: int, global_batch_size: int) -> np.ndarray:
    """The example indices of global batch ``step`` of an epoch with ``order``."""
    return order[step * global_batch_size:(step + 1) * global_batch_size]


def eval_batches(data: ArrayData, global_batch_size: int
                 ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Every example once, in order, as ``(x, y, mask)`` global batches of a fixed size.

    The last batch is padded with zero rows whose ``mask`` is 0, so every batch has the same
    shape (one compiled evaluation step) and no example is dropped.
    """
    n, b = len(data), global_batch_size
    for start in range(0, n, b):
        x, y = data.x[start:start + b], data.y[start:start + b]
        real = x.shape[0]
        mask = np.ones((b,), np.float32)
        if real < b:
            x = np.concatenate([x, np.zeros((b - real, *x.shape[1:]), x.dtype)])
            y = np.concatenate([y, np.zeros((b - real, *y.shape[1:]), y.dtype)])
            mask[real:] = 0.0
        yield x, y, mask
