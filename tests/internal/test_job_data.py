"""The job configs' demo data: digits read without scikit-learn, and ``split`` drawing the rows
scikit-learn's ``train_test_split`` draws (jaxdist does not import scikit-learn for them: about
a second of every job's start-up)."""

import numpy as np
import pytest

from jaxdist._src.job import data as job_data
from jaxdist._src.train.data import ArrayData

sklearn_split = pytest.importorskip("sklearn.model_selection")


def _sklearn_rows(n, labels, validation_split, seed):
    """What ``split`` returned when it called scikit-learn (stratified, else unstratified)."""
    try:
        tr, va = sklearn_split.train_test_split(np.arange(n), test_size=validation_split,
                                                random_state=seed, stratify=labels)
    except ValueError:
        tr, va = sklearn_split.train_test_split(np.arange(n), test_size=validation_split,
                                                random_state=seed)
    return np.sort(tr), np.sort(va)


def test_digits_are_scikit_learns():
    from sklearn.datasets import load_digits

    images, target = job_data._digits()
    ref = load_digits()
    np.testing.assert_array_equal(images, ref.images)
    np.testing.assert_array_equal(target, ref.target)
    train, val = job_data.load_digits(0.2, 0)
    assert (len(train), len(val)) == (1437, 360)
    assert train.x.shape[1:] == (8, 8, 1) and train.y.dtype == np.int32


CASES = [
    # (rows, labels, validation_split, seed)
    *[(1797, "digits", vs, seed) for vs in (0.1, 0.2, 0.25, 1 / 3, 0.5, 0.9)
      for seed in (0, 1, 7)],
    (260, "4 classes", 0.2, 0), (260, "4 classes", 0.37, 3),
    (101, "imbalanced", 0.2, 0), (101, "imbalanced", 0.3, 5),
    (50, "one example of a class", 0.2, 0),     # cannot stratify: unstratified
    (30, "20 classes", 0.2, 1),                # fewer test rows than classes: unstratified
    (64, "float labels", 0.25, 2),             # not integer labels: unstratified
]


def _labels(n, kind):
    rng = np.random.default_rng(n)
    if kind == "digits":
        return job_data._digits()[1].astype(np.int32)
    if kind == "4 classes":
        return rng.integers(0, 4, n).astype(np.int32)
    if kind == "imbalanced":
        return np.where(rng.random(n) < 0.9, 0, rng.integers(1, 3, n)).astype(np.int64)
    if kind == "one example of a class":
        y = rng.integers(0, 3, n).astype(np.int32)
        y[7] = 9
        return y
    if kind == "20 classes":
        return np.repeat(np.arange(15), 2)[:n].astype(np.int32)
    return rng.normal(size=n).astype(np.float32)


@pytest.mark.parametrize("n,kind,vs,seed", CASES)
def test_split_draws_the_rows_train_test_split_draws(n, kind, vs, seed):
    y = _labels(n, kind)
    data = ArrayData(np.arange(n, dtype=np.float32)[:, None], y)
    train, val = job_data.split(data, vs, seed)
    labels = y if np.issubdtype(y.dtype, np.integer) else None
    ref_tr, ref_va = _sklearn_rows(n, labels, vs, seed)
    np.testing.assert_array_equal(train.x[:, 0].astype(int), ref_tr)
    np.testing.assert_array_equal(val.x[:, 0].astype(int), ref_va)


def test_split_refuses_what_leaves_no_training_rows():
    data = ArrayData(np.zeros((4, 1), np.float32), np.arange(4, dtype=np.int32))
    assert job_data.split(data, 0.0) == (data, None)
    with pytest.raises(ValueError, match="validation_split=1.0 should be in the"):
        job_data.split(data, 1.0)
