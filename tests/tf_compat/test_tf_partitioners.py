"""Port of the ``PartitionerTest`` cases of TensorFlow's
tensorflow/python/distribute/sharded_variable_test.py onto jaxdist.

TF calls a partitioner with a ``TensorShape`` and a ``tf.DType``; jaxdist takes a shape tuple
and a dtype name. The other test classes of that file (``ShardedVariableTest``: assign,
scatter ops, checkpoints, SavedModel, ``tf.Module`` tracking) test ``tf.Variable`` objects
that do not exist on JAX (jaxdist's sharded leaves are covered by tests/test_ps_placement.py).
"""

import pytest

from jaxdist.ps import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    split_rows,
)


def test_fixed_shards_partitioner():
    partitioner = FixedShardsPartitioner(num_shards=2)
    got = partitioner((10, 3), "float32")
    assert got == [2, 1]


def test_min_size_partitioner():
    partitioner = MinSizePartitioner(min_shard_bytes=4, max_shards=2)
    got = partitioner((6, 1), "float32")
    assert got == [2, 1]

    partitioner = MinSizePartitioner(min_shard_bytes=4, max_shards=10)
    got = partitioner((6, 1), "float32")
    assert got == [6, 1]


def test_max_size_partitioner():
    partitioner = MaxSizePartitioner(max_shard_bytes=4)
    got = partitioner((6, 1), "float32")
    assert got == [6, 1]

    partitioner = MaxSizePartitioner(max_shard_bytes=4, max_shards=2)
    got = partitioner((6, 1), "float32")
    assert got == [2, 1]

    partitioner = MaxSizePartitioner(max_shard_bytes=1024)
    got = partitioner((6, 1), "float32")
    assert got == [1, 1]


# jaxdist-only checks of the same TF semantics (not in TF's file).


@pytest.mark.parametrize("make", [
    lambda: MinSizePartitioner(min_shard_bytes=0),
    lambda: MaxSizePartitioner(max_shard_bytes=0),
    lambda: MaxSizePartitioner(max_shard_bytes=4, bytes_per_string=0),
])
def test_non_positive_sizes_raise(make):
    """TF raises ValueError for a non-positive min/max shard size or bytes per string."""
    with pytest.raises(ValueError, match="must be >= 1"):
        make()


def test_string_variables_use_bytes_per_string():
    """TF sizes string elements with ``bytes_per_string`` (default 16)."""
    assert MaxSizePartitioner(max_shard_bytes=16)((6, 1), "string") == [6, 1]
    assert MaxSizePartitioner(max_shard_bytes=32)((6, 1), "string") == [3, 1]
    assert MinSizePartitioner(min_shard_bytes=32, max_shards=10)((6, 1), "string") == [3, 1]


def test_shards_split_rows_as_tf():
    """TF's ParameterServerStrategyV2 gives the first ``rows % n`` shards one more row."""
    n, rest = FixedShardsPartitioner(3)((10, 2), "float32")   # TF: [num_shards, 1]
    assert rest == 1
    assert n == 3
    assert [b - a for a, b in split_rows(10, n)] == [4, 3, 3]
