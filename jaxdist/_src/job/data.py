"""The demo data of job configs: scikit-learn digits, a synthetic problem, your own ``.npz``.

``from_config(section)`` loads what a validated ``data`` section names, as ``ArrayData``
(``jaxdist.train.ArrayData``) pairs ``(train, validation)``.

Example:
    >>> from jaxdist.train.data import make_synthetic
    >>> train, val = make_synthetic(1000, 16, 4)
    >>> len(train), len(val)
    (800, 200)
"""

from __future__ import annotations

import gzip
import importlib.util
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxdist._src.train.data import ArrayData, DataError


def split(data: ArrayData, validation_split: float, seed: int = 0
          ) -> tuple[ArrayData, ArrayData | None]:
    """Splits off a shuffled ``validation_split`` fraction (stratified by label).

    The rows are those of scikit-learn's ``train_test_split(..., test_size=validation_split,
    random_state=seed, stratify=labels)`` (unstratified where stratifying is impossible, e.g. a
    class with one example), each part in its original order: ``_split_indices`` makes the same
    draws without importing scikit-learn (about a second of every job's start-up).

    Raises:
        ValueError: ``validation_split`` is not below 1, or leaves no training example.
    """
    if validation_split <= 0:
        return data, None
    labels = data.y if data.y.ndim == 1 and np.issubdtype(data.y.dtype, np.integer) else None
    idx_tr, idx_va = _split_indices(len(data), validation_split, seed, labels)
    return data.take(np.sort(idx_tr)), data.take(np.sort(idx_va))


def _split_indices(n: int, test_size: float, seed: int, labels: np.ndarray | None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The ``(train, test)`` rows of scikit-learn's ``train_test_split(np.arange(n),
    test_size=test_size, random_state=seed, stratify=labels)`` (its ``StratifiedShuffleSplit``,
    else ``ShuffleSplit``, with ``np.random.RandomState(seed)``), in draw order; ``labels=None``
    or a stratification that cannot be done gives the unstratified split, as ``split`` always
    did."""
    if not 0 < test_size < 1:
        raise ValueError(f"validation_split={test_size!r} should be in the (0, 1) range")
    n_test = math.ceil(test_size * n)
    n_train = n - n_test
    if n_train <= 0:
        raise ValueError(f"with {n} examples, validation_split={test_size!r} leaves no "
                         f"training example; lower it")
    if labels is not None:
        classes, y_indices, class_counts = np.unique(labels, return_inverse=True,
                                                     return_counts=True)
        if (class_counts.min() >= 2 and n_train >= len(classes)
                and n_test >= len(classes)):
            class_indices = np.split(np.argsort(y_indices, kind="stable"),
                                     np.cumsum(class_counts)[:-1])
            rng = np.random.RandomState(seed)
            n_i = _approximate_mode(class_counts, n_train, rng)
            t_i = _approximate_mode(class_counts - n_i, n_test, rng)
            train: list[int] = []
            test: list[int] = []
            for i in range(len(classes)):
                perm = class_indices[i].take(rng.permutation(class_counts[i]), mode="clip")
                train.extend(perm[:n_i[i]])
                test.extend(perm[n_i[i]:n_i[i] + t_i[i]])
            return np.asarray(train, np.int64), np.asarray(test, np.int64)
    permutation = np.random.RandomState(seed).permutation(n)
    return permutation[n_test:n_test + n_train], permutation[:n_test]


def _approximate_mode(class_counts: np.ndarray, n_draws: int,
                      rng: np.random.RandomState) -> np.ndarray:
    """scikit-learn's ``utils.extmath._approximate_mode``: how many examples each class gives
    to ``n_draws`` (proportional, floored, the rest by largest remainder, ties by ``rng``)."""
    continuous = class_counts / class_counts.sum() * n_draws
    floored = np.floor(continuous)
    need_to_add = int(n_draws - floored.sum())
    if need_to_add > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (inds,) = np.where(remainder == value)
            add_now = min(len(inds), need_to_add)
            floored[rng.choice(inds, size=add_now, replace=False)] += 1
            need_to_add -= add_now
            if need_to_add == 0:
                break
    return floored.astype(int)


def load_digits(validation_split: float = 0.2, seed: int = 0
                ) -> tuple[ArrayData, ArrayData | None]:
    """scikit-learn's 8x8 handwritten digits (1797 images, 10 classes), scaled to [0, 1].

    Read from the file scikit-learn ships (the one ``sklearn.datasets.load_digits`` reads)
    without importing scikit-learn.

    Returns:
        ``(train, validation)``; images have shape ``(8, 8, 1)`` and labels are int32.
    """
    images, target = _digits()
    x = (images.astype(np.float32) / 16.0)[..., None]
    return split(ArrayData(x, target.astype(np.int32)), validation_split, seed)


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """``(images, target)`` as ``sklearn.datasets.load_digits()`` has them: float64
    ``(1797, 8, 8)`` and int labels."""
    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    path = None
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data",
                            "digits.csv.gz")
    if path is None or not os.path.exists(path):  # another layout: ask scikit-learn
        from sklearn.datasets import load_digits as _load

        bunch = _load()
        return bunch.images, bunch.target
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def make_synthetic(num_examples: int = 4096, num_features: int = 32, num_classes: int = 10,
                   seed: int = 0, validation_split: float = 0.2
                   ) -> tuple[ArrayData, ArrayData | None]:
    """A learnable synthetic classification problem (Gaussian inputs, a random linear teacher).

    Example:
        >>> from jaxdist.train.data import make_synthetic
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
