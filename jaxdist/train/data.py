"""``jaxdist.train.data``: the job configs' datasets (scikit-learn's digits, a synthetic set,
your own ``.npz`` arrays) as ``ArrayData``.

Example:
    >>> from jaxdist.train.data import load_digits
    >>> train, val = load_digits(validation_split=0.2)
    >>> train.x.shape, train.y.shape
    ((1437, 8, 8, 1), (1437,))
"""

from jaxdist._src.job.data import load_digits, load_npz, make_synthetic
from jaxdist._src.train.data import ArrayData, DataError

__all__ = ["ArrayData", "DataError", "load_digits", "load_npz", "make_synthetic"]
