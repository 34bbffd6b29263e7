"""Local stand-ins for the corpus programs' datasets (no downloads at run time).

Each function gives arrays of the original dataset's per-example shape and dtype; the row
count is chosen by the program (see its header for how it relates to the original's).
"""

from __future__ import annotations

import numpy as np
from sklearn.datasets import load_digits


def digits_as_mnist(rows: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 digits as MNIST-shaped data: ``(rows, 28, 28)`` uint8, labels int64.

    Each 8x8 image (values 0..16) is scaled to 0..255, enlarged 3x to 24x24 and padded to
    28x28, as MNIST centres a 20x20 digit in a 28x28 frame. Rows ``offset .. offset+rows-1``
    of the 1797 digits (wrapping around when more are asked for).

    Example:
        >>> x, y = digits_as_mnist(100)
        >>> x.shape, x.dtype, y[:3]
        ((100, 28, 28), dtype('uint8'), array([0, 1, 2]))
    """
    d = load_digits()
    idx = (np.arange(rows) + offset) % len(d.target)
    small = np.rint(d.images[idx] * (255.0 / 16.0)).astype(np.uint8)
    big = np.kron(small, np.ones((1, 3, 3), np.uint8))
    return np.pad(big, ((0, 0), (2, 2), (2, 2))), d.target[idx].astype(np.int64)


def ford_a_like(rows: int, length: int = 500, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic stand-in for UCR FordA: z-normalised univariate series, labels in {-1, 1}.

    Class 1 carries a sine burst; every series is z-normalised per row, as FordA is.
    """
    rng = np.random.default_rng(seed)
    y = rng.choice(np.array([-1, 1]), size=rows)
    t = np.linspace(0.0, 8.0 * np.pi, length)
    x = rng.normal(size=(rows, length)) + (y[:, None] > 0) * np.sin(t)[None, :]
    x = (x - x.mean(axis=1, keepdims=True)) / x.std(axis=1, keepdims=True)
    return x.astype(np.float64), y.astype(np.int64)


def imdb_like_token_ids(rows: int, vocab: int, length: int, seed: int = 0):
    """Synthetic stand-in for vectorised IMDB reviews: int64 token ids, 0 = padding.

    Reviews have random lengths (shorter ones zero-padded to ``length``, as
    ``TextVectorization(output_sequence_length=length)`` pads); label 1 reviews use more ids
    from the first tenth of the vocabulary.
    """
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, size=rows)
    ids = np.zeros((rows, length), np.int64)
    for i in range(rows):
        n = int(rng.integers(length // 4, length + 1))
        hi = vocab // 10 if y[i] else vocab
        ids[i, :n] = rng.integers(2, max(hi, 3), size=n)
    return ids, y.astype(np.int32)


def heart_like(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Synthetic stand-in for the Cleveland Clinic heart-disease CSV (keras-io's copy).

    The same 13 feature columns with the same kinds of values (integer categorical codes, a
    string ``thal`` with the CSV's values, numerical columns in realistic ranges) and a
    binary ``target`` that depends on a few of them.
    """
    rng = np.random.default_rng(seed)
    data = {
        "age": rng.integers(29, 78, rows),
        "sex": rng.integers(0, 2, rows),
        "cp": rng.integers(0, 5, rows),
        "trestbps": rng.integers(94, 201, rows),
        "chol": rng.integers(126, 565, rows),
        "fbs": rng.integers(0, 2, rows),
        "restecg": rng.integers(0, 3, rows),
        "thalach": rng.integers(71, 203, rows),
        "exang": rng.integers(0, 2, rows),
        "oldpeak": np.round(rng.uniform(0.0, 6.2, rows), 1),
        "slope": rng.integers(1, 4, rows),
        "ca": rng.integers(0, 4, rows),
        "thal": rng.choice(np.array(["fixed", "normal", "reversible"]), rows),
    }
    score = (data["cp"] >= 3) + (data["thalach"] < 140) + (data["thal"] == "reversible") \
        + data["exang"] + (data["oldpeak"] > 2.0)
    data["target"] = (score + rng.integers(0, 2, rows) >= 3).astype(np.int64)
    return data
