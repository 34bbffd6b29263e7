"""from_tensor_slices(...).batch(n) slices rows: the same batches as stacking them one by one."""

import numpy as np
import pytest

import jaxdist


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_sliced_batches_equal_stacked_rows(drop_remainder):
    x = np.arange(30, dtype=np.float32).reshape(10, 3)
    data = {"x": x, "y": np.arange(10, dtype=np.int64)}
    fast = jaxdist.Dataset.from_tensor_slices(data).batch(4, drop_remainder=drop_remainder)
    # map() hides the arrays, so this one stacks rows one by one.
    slow = jaxdist.Dataset.from_tensor_slices(data).map(lambda e: e).batch(
        4, drop_remainder=drop_remainder)
    a, b = list(fast), list(slow)
    assert len(a) == len(b) == fast.cardinality() == (2 if drop_remainder else 3)
    for p, q in zip(a, b):
        for k in ("x", "y"):
            assert p[k].dtype == q[k].dtype
            np.testing.assert_array_equal(p[k], q[k])
    a[0]["x"][0, 0] = -1.0  # a batch is a copy: the source arrays are untouched
    assert x[0, 0] == 0.0
    sizes = [4, 4] if drop_remainder else [4, 4, 2]
    assert [e["x"].shape[0] for e in fast.repeat(2)] == sizes * 2
