"""The demo data of job configs: scikit-learn digits, a synthetic problem, your own ``.npz``.

``from_config(section)`` loads what a validated ``data`` section names, as ``ArrayData``
(``jaxdist.train.ArrayData``) pairs ``(train, validation)``.

Example:
    >>> train, val = make_synthetic(1000, 16, 4)
    >>> len(train), len(val)
    (800, 200)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxdist._src.train.data import ArrayData, DataError


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
    return data.take(idx_tr), data.take(idx_va)


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
    try:
        f = np.load(path)
        if not hasattr(f, "files"):  # a plain .npy array
            raise ValueError("it holds one array, not named arrays")
        with f:
            arrays = {k: f[k] for k in f.files}
    except (ValueError, OSError, EOFError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{os.fspath(path)}: is not a .npz file ({first}); expected a file "
                        f"written by numpy.savez with arrays 'x' and 'y'",
                        exit_code=2) from None
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


__all__ = ["from_config", "load_digits", "load_npz", "make_synthetic", "split"]
