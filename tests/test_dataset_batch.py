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
    with pytest.raises(ValueError, match="read-only"):
        a[0]["x"][0, 0] = -1.0  # a batch is a view of the dataset's snapshot: not writeable
    assert x[0, 0] == 0.0
    sizes = [4, 4] if drop_remainder else [4, 4, 2]
    assert [e["x"].shape[0] for e in fast.repeat(2)] == sizes * 2


def test_from_tensor_slices_takes_the_values_when_called():
    """TF copies the arrays into the dataset: later writes to them change nothing."""
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    ds = jaxdist.Dataset.from_tensor_slices(x)
    batched = jaxdist.Dataset.from_tensor_slices({"x": x}).batch(4)
    x[:] = -1.0
    rows = list(ds)
    assert rows[0].tolist() == [0.0, 1.0] and rows[5].tolist() == [10.0, 11.0]
    assert next(iter(batched))["x"][3].tolist() == [6.0, 7.0]
    with pytest.raises(ValueError, match="read-only"):
        rows[0][0] = 5.0
    # A 1-D array's rows are numpy scalars.
    assert [float(v) for v in jaxdist.Dataset.from_tensor_slices(np.arange(3.0))] == [0, 1, 2]


def test_read_only_arrays_are_not_copied():
    frozen = np.arange(8.0)
    frozen.flags.writeable = False
    view_of_writeable = np.arange(8.0)[:]
    view_of_writeable.flags.writeable = False  # its base can still be written
    ds = jaxdist.Dataset.from_tensor_slices((frozen, view_of_writeable)).batch(8)
    a, b = next(iter(ds))
    assert np.shares_memory(a, frozen)
    assert not np.shares_memory(b, view_of_writeable)
    assert not a.flags.writeable and not b.flags.writeable


def test_unpickled_dataset_still_yields_read_only_batches():
    """A per-worker copy (create_per_worker_dataset pickles the dataset) unpickles writeable
    arrays: its batches are still read-only views, so writing to one cannot change the data
    of the next epoch."""
    import cloudpickle

    ds = cloudpickle.loads(cloudpickle.dumps(
        jaxdist.Dataset.from_tensor_slices(np.ones((4, 2), np.float32)).batch(2).repeat(2)))
    batches = list(ds)
    assert len(batches) == 4
    for b in batches:
        assert not b.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        batches[0][0, 0] = 0.0
