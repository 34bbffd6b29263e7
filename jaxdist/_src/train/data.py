"""Training data as the Trainer holds it (``ArrayData``), and the deterministic, resumable
order in which it reads it. (The demo datasets of job configs are in ``jaxdist._src.job.data``.)

The order of epoch ``e`` is a permutation drawn from ``numpy.random.default_rng([seed, e])``, so
a job that restarts at ``(epoch, step_in_epoch)`` sees exactly the batches an uninterrupted job
would have seen.

Example:
    >>> import numpy as np
    >>> from jaxdist._src.train.data import epoch_order
    >>> from jaxdist.train import ArrayData
    >>> data = ArrayData(np.zeros((10, 3), np.float32), np.arange(10) % 2)
    >>> epoch_order(len(data), epoch=0, seed=0).shape
    (10,)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from jaxdist._src.train.losses import categorical_crossentropy, sparse_categorical_crossentropy


class DataError(ValueError):
    """Arrays that cannot be used for training (mismatched rows, wrong dtype or rank).

    ``exit_code`` is the CLI's exit status for it: 1 (training failed), or 2 for input the
    user must fix before anything can run (labels of the wrong kind, a file that is not .npz).
    """

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


@dataclasses.dataclass
class ArrayData:
    """In-memory examples: features ``x`` and labels ``y`` with the same number of rows, and
    optional per-example weights ``w`` (Keras' ``sample_weight``).

    ``x`` is an array or a dict of arrays (named features, passed to the model as a dict).

    Example:
        >>> import numpy as np
        >>> from jaxdist.train import ArrayData
        >>> data = ArrayData(np.zeros((10, 4), np.float32), np.zeros((10,), np.int32))
        >>> len(data)
        10
    """

    x: Any
    y: np.ndarray
    w: np.ndarray | None = None

    def __post_init__(self):
        if isinstance(self.x, Mapping):
            self.x = {str(k): _features(v, f"x[{k!r}]", float_only=False)
                      for k, v in self.x.items()}
            if not self.x:
                raise DataError("x is an empty dict; expected named feature arrays")
        else:
            self.x = _features(self.x, "x", float_only=True)
        self.y = np.asarray(self.y)
        if self.y.ndim < 1:
            raise DataError(f"x and y must be batched arrays (rank >= 1), got y of shape "
                            f"{self.y.shape}")
        rows = {k: v.shape[0] for k, v in self.features().items()}
        for name, n in rows.items():
            if n != self.y.shape[0]:
                raise DataError(f"{name} has {n} rows but y has {self.y.shape[0]}; "
                                f"expected one label per example")
        if self.w is not None:
            self.w = np.asarray(self.w, np.float32)
            if self.w.shape != (self.y.shape[0],):
                raise DataError(f"sample_weight has shape {self.w.shape}; expected one weight "
                                f"per example, shape ({self.y.shape[0]},)")

    def features(self) -> dict[str, np.ndarray]:
        """``{name: array}`` of the features (``{"x": x}`` for a single array)."""
        return dict(self.x) if isinstance(self.x, dict) else {"x": self.x}

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def take(self, idx: np.ndarray) -> ArrayData:
        """The examples at ``idx``."""
        x = ({k: v[idx] for k, v in self.x.items()} if isinstance(self.x, dict)
             else self.x[idx])
        return ArrayData(x, self.y[idx], None if self.w is None else self.w[idx])

    @property
    def num_classes(self) -> int:
        """``max(y) + 1`` for integer labels."""
        return int(self.y.max()) + 1 if len(self) else 0


def _features(x: Any, name: str, float_only: bool) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim < 1:
        raise DataError(f"x and y must be batched arrays (rank >= 1), got {name} of shape "
                        f"{x.shape}")
    if not np.issubdtype(x.dtype, np.number) and x.dtype != np.bool_:
        raise DataError(f"{name} must be numeric, got dtype {x.dtype}")
    if float_only or np.issubdtype(x.dtype, np.floating):
        return x.astype(np.float32) if x.dtype != np.float32 else x
    return x




# ---------------------------------------------------------------------- batch order
def steps_per_epoch(num_examples: int, global_batch_size: int) -> int:
    """Full global batches per epoch (the last partial batch is dropped, as in training)."""
    return num_examples // global_batch_size


def epoch_order(num_examples: int, epoch: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """The example order of ``epoch``: the same for the same ``(seed, epoch)``, always."""
    if not shuffle:
        return np.arange(num_examples)
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def eval_batches(data: ArrayData, global_batch_size: int
                 ) -> Iterator[tuple[Any, np.ndarray, np.ndarray, np.ndarray]]:
    """Every example once, in order, as ``(x, y, weight, mask)`` global batches of a fixed size.

    The last batch is padded with zero rows whose ``mask`` is 0, so every batch has the same
    shape (one compiled evaluation step) and no example is dropped.
    """
    n, b = len(data), global_batch_size
    for start in range(0, n, b):
        part = data.take(np.arange(start, min(start + b, n)))
        yield pad_batch(part.x, part.y, part.w, b)


def pad_batch(x: Any, y: np.ndarray, w: np.ndarray | None, size: int
              ) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray]:
    """Pads a batch with zero rows to ``size`` rows; returns ``(x, y, weight, mask)``: ``mask``
    is 1 for real rows and 0 for padding, ``weight`` the sample weight (1 without ``w``) times
    the mask."""
    real = y.shape[0]

    def pad(a: np.ndarray) -> np.ndarray:
        if a.shape[0] == size:
            return a
        return np.concatenate([a, np.zeros((size - a.shape[0], *a.shape[1:]), a.dtype)])

    mask = np.zeros((size,), np.float32)
    mask[:real] = 1.0
    weight = mask.copy()
    if w is not None:
        weight[:real] = w
    x = {k: pad(v) for k, v in x.items()} if isinstance(x, dict) else pad(x)
    return x, pad(y), weight, mask


def check_labels(y: np.ndarray, out: Any, loss_fn: Any, what: str) -> None:
    """Labels of the wrong kind for the named losses: one clear error (exit status 2)."""
    out_ndim = getattr(out, "ndim", None)
    if loss_fn is sparse_categorical_crossentropy and out_ndim is not None:
        if y.ndim == out_ndim and y.ndim >= 2 and y.shape[-1] == out.shape[-1]:
            raise DataError(
                f"{what}: labels of shape {y.shape} look one-hot; loss "
                f"'sparse_categorical_crossentropy' expects integer class ids of shape "
                f"{y.shape[:-1]}: pass y.argmax(-1), or use loss='categorical_crossentropy'",
                exit_code=2)
        check_batch_labels(y, what, loss_fn)
    if loss_fn is categorical_crossentropy and out_ndim is not None and y.ndim == out_ndim - 1:
        raise DataError(
            f"{what}: labels of shape {y.shape} are class ids; loss 'categorical_crossentropy' "
            f"expects one-hot labels of shape {(*y.shape, out.shape[-1])}: use loss="
            f"'sparse_categorical_crossentropy'", exit_code=2)


def pad_rows(a: Any, rows: int) -> np.ndarray:
    """``a`` with zero rows appended up to ``rows`` rows."""
    a = np.asarray(a)
    return np.concatenate([a, np.zeros((rows - a.shape[0], *a.shape[1:]), a.dtype)])


def check_batch_labels(y: Any, what: str, loss_fn: Any) -> None:
    """Float labels that are not whole numbers cannot be class ids (sparse cross-entropy)."""
    if y is None or loss_fn is not sparse_categorical_crossentropy:
        return
    y = np.asarray(y)
    if np.issubdtype(y.dtype, np.floating):
        frac = np.mod(y, 1) != 0
        if frac.any():
            raise DataError(
                f"{what}: labels are floats such as {y[frac].flat[0]:g}; loss "
                f"'sparse_categorical_crossentropy' expects integer class ids: pass integer "
                f"labels (y.astype(int) if they are ids), or a loss for real-valued targets",
                exit_code=2)
