"""Placement (replica_device_setter, greedy) and partitioners with TF's semantics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist
from jaxdist.ps import (
    FixedShardsPartitioner,
    GreedyLoadBalancingStrategy,
    Layout,
    MaxSizePartitioner,
    MinSizePartitioner,
    VariableSpec,
    byte_size_load_fn,
    replica_device_setter,
    split_rows,
)


def test_round_robin_tf_docstring_example():
    cluster = {"ps": ["ps0:2222", "ps1:2222"], "worker": ["worker0:2222", "worker1:2222"]}
    setter = jaxdist.replica_device_setter(cluster=cluster)
    assert [setter(n) for n in ("v1", "v2", "v3")] == [
        "/job:ps/task:0", "/job:ps/task:1", "/job:ps/task:0"]
    setter3 = replica_device_setter(ps_tasks=3)
    assert [setter3.task_of(VariableSpec(f"v{i}", (2,))) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_greedy_by_byte_size():
    greedy = GreedyLoadBalancingStrategy(2, byte_size_load_fn)
    setter = replica_device_setter(ps_tasks=2, ps_strategy=greedy)
    specs = [VariableSpec("big", (1000,), "float32"), VariableSpec("s1", (10,), "float32"),
             VariableSpec("s2", (10,), "float64"), VariableSpec("mid", (300,), "float32"),
             VariableSpec("bf", (4,), "bfloat16")]
    tasks = [setter.task_of(s) for s in specs]
    assert tasks == [0, 1, 1, 1, 1]
    assert greedy.loads == (4000.0, 40 + 80 + 1200 + 8)
    assert byte_size_load_fn(VariableSpec("w", (10, 10), "float32")) == 400


def test_placement_errors():
    with pytest.raises(ValueError, match="ps_tasks >= 1"):
        replica_device_setter(ps_tasks=0)
    setter = replica_device_setter(ps_tasks=2, ps_strategy=lambda op: 5)
    with pytest.raises(ValueError, match="returned task 5"):
        setter("v")


def test_split_rows_tf_division():
    assert [b - a for a, b in split_rows(13, 5)] == [3, 3, 3, 2, 2]
    assert split_rows(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_fixed_shards():
    p = FixedShardsPartitioner(num_shards=5)
    assert p((13, 4), np.float32) == [5, 1]
    assert p((3, 4), np.float32) == [3, 1]
    assert p((13,), np.float32) == [5]
    with pytest.raises(ValueError, match="num_shards must be >= 1"):
        FixedShardsPartitioner(0)


def test_min_size():
    # 10 x 8 float32 = 320 bytes; min 64 bytes per shard -> ceil(5) shards, max 3
    assert MinSizePartitioner(min_shard_bytes=64, max_shards=3)((10, 8), np.float32) == [3, 1]
    assert MinSizePartitioner(min_shard_bytes=64, max_shards=10)((10, 8), np.float32) == [5, 1]
    assert MinSizePartitioner(min_shard_bytes=1 << 20, max_shards=4)((10, 8), np.float32) == [1, 1]
    assert MinSizePartitioner(min_shard_bytes=4, max_shards=100)((6, 1), np.float32) == [6, 1]


def test_max_size():
    # row = 8 float32 = 32 bytes; 100 bytes per shard -> 3 rows/shard -> ceil(10/3) = 4 shards
    assert MaxSizePartitioner(max_shard_bytes=100)((10, 8), np.float32) == [4, 1]
    assert MaxSizePartitioner(max_shard_bytes=100, max_shards=2)((10, 8), np.float32) == [2, 1]
    assert MaxSizePartitioner(max_shard_bytes=1)((10, 8), np.float32) == [10, 1]
    assert MaxSizePartitioner(max_shard_bytes=1 << 20)((10, 8), np.float32) == [1, 1]


def test_layout_splits_rank0_and_colocated_leaves_whole():
    tree = {"scalar": jnp.zeros(()), "table": jnp.zeros((13, 2)), "vec": jnp.zeros((4,))}
    abstract = jax.eval_shape(lambda: tree)
    layout = Layout("m", abstract, replica_device_setter(ps_tasks=2), FixedShardsPartitioner(5))
    by_name = {leaf.name: leaf for leaf in layout.leaves}
    assert len(by_name["m/scalar"].shards) == 1
    assert [s.stop - s.start for s in by_name["m/table"].shards] == [3, 3, 3, 2, 2]
    assert [s.task for s in by_name["m/table"].shards] == [1, 0, 1, 0, 1]  # round-robin goes on
    assert len(by_name["m/vec"].shards) == 4
    colocated = Layout("c", abstract, replica_device_setter(ps_tasks=2),
                       FixedShardsPartitioner(5), colocate_task=1)
    assert all(len(leaf.shards) == 1 and leaf.shards[0].task == 1 for leaf in colocated.leaves)
    parts = layout.split({"scalar": np.float32(1), "table": np.arange(26.).reshape(13, 2),
                          "vec": np.arange(4.)})
    assert parts[0]["m/table/part_1"].tolist() == [[6, 7], [8, 9], [10, 11]]


def test_partitioner_in_strategy_local_and_colocation():
    strategy = jaxdist.ParameterServerStrategy(
        variable_partitioner=FixedShardsPartitioner(3), compute_devices=jax.devices()[:1])
    with strategy.scope():
        a = strategy.create_variables({"w": np.ones((7, 2), np.float32)}, name="a")
        with strategy.extended.colocate_vars_with(a):
            b = strategy.create_variables({"w": np.ones((7, 2), np.float32)}, name="b")
    assert [s.stop - s.start for s in a.layout.leaves[0].shards] == [3, 2, 2]
    assert len(b.layout.leaves[0].shards) == 1
    np.testing.assert_array_equal(a.pull()["w"], np.ones((7, 2)))
