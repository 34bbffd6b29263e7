"""MultiWorkerMirroredStrategy in one process: options, roles, packing, auto-sharding."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist
from jaxdist._src.cluster.errors import ClusterConfigError
from jaxdist._src.cluster.tf_config import TFConfigClusterResolver
from jaxdist._src.input.autoshard import (
    FileListDataset,
    auto_shard,
    shard_files,
    with_auto_shard_policy,
)
from jaxdist._src.strategies.multi_worker import PackedAllReduce, pack_by_bytes
from jaxdist.testing.workloads import global_batches, make_train_step


def _train(strategy, steps=4, global_batch=16):
    tx, step = make_train_step(global_batch)
    with strategy.scope():
        params = {"w": jnp.zeros((4,)), "b": jnp.zeros(())}
        opt_state = tx.init(params)
    for x, y in strategy.experimental_distribute_dataset(global_batches(steps, global_batch)):
        params, opt_state, _ = strategy.run(step, args=(params, opt_state, x, y))
    return jax.device_get(params)


def test_communication_options_validation():
    o = jaxdist.CommunicationOptions(implementation="ring", timeout_seconds=5)
    assert o.implementation is jaxdist.CommunicationImplementation.RING
    with pytest.raises(ValueError, match="implementation='mpi'"):
        jaxdist.CommunicationOptions(implementation="mpi")
    with pytest.raises(ValueError, match="bytes_per_pack=-1"):
        jaxdist.CommunicationOptions(bytes_per_pack=-1)
    with pytest.raises(ValueError, match="timeout_seconds=0"):
        jaxdist.CommunicationOptions(timeout_seconds=0)


def test_single_process_without_tf_config_matches_mirrored(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    s = jaxdist.MultiWorkerMirroredStrategy()
    assert s.num_replicas_in_sync == len(jax.devices())
    ext = s.extended
    assert ext.is_chief and ext.should_checkpoint and ext.should_save_summary
    assert ext.task_type is None and ext.task_id is None
    ref = _train(jaxdist.MirroredStrategy())
    got = _train(s)
    np.testing.assert_allclose(got["w"], ref["w"], rtol=1e-6)


def test_nccl_on_cpu_is_an_error(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    opts = jaxdist.CommunicationOptions(implementation="NCCL")
    with pytest.raises(ValueError, match="NCCL needs GPUs.*cpu"):
        jaxdist.MultiWorkerMirroredStrategy(communication_options=opts)


@pytest.mark.devices(2)  # one replica has nothing to reduce
def test_bytes_per_pack_packs_into_buckets(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    xs = [jnp.ones((10,)), jnp.ones((30,)), jnp.ones((5,)), jnp.ones((3,), jnp.int32)]
    packs, unpack = pack_by_bytes(xs, 160)  # 40 float32 per bucket
    assert [p.shape[0] for p in packs] == [40, 5, 3]
    assert [y.shape for y in unpack(packs)] == [x.shape for x in xs]
    opts = jaxdist.CommunicationOptions(bytes_per_pack=16)
    s = jaxdist.MultiWorkerMirroredStrategy(communication_options=opts)
    assert isinstance(s.extended.cross_device_ops, PackedAllReduce)
    ref = _train(jaxdist.MirroredStrategy())
    got = _train(s)
    # grads: w (16 B) fills a 16-byte bucket, b gets another
    assert 2 in s.extended.cross_device_ops.pack_counts
    np.testing.assert_allclose(got["w"], ref["w"], rtol=1e-6)


def test_evaluator_task_runs_locally_and_is_not_chief():
    cfg = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"], "evaluator": ["127.0.0.1:3"]},
           "task": {"type": "evaluator", "index": 0}}
    s = jaxdist.MultiWorkerMirroredStrategy(TFConfigClusterResolver(tf_config=json.dumps(cfg)))
    ext = s.extended
    assert s.num_replicas_in_sync == len(jax.local_devices())
    assert (ext.task_type, ext.task_id, ext.is_chief, ext.should_checkpoint) == (
        "evaluator", 0, False, False)


def test_ps_task_is_refused():
    cfg = {"cluster": {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:3"]},
           "task": {"type": "ps", "index": 0}}
    with pytest.raises(ClusterConfigError, match="this process is ps:0"):
        jaxdist.MultiWorkerMirroredStrategy(TFConfigClusterResolver(tf_config=json.dumps(cfg)))


def test_join_after_jax_started_is_a_clear_error():
    cfg = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
           "task": {"type": "worker", "index": 1}}
    jax.devices()  # the pytest process already runs JAX
    with pytest.raises(ClusterConfigError, match="worker:1: JAX already initialized"):
        jaxdist.MultiWorkerMirroredStrategy(TFConfigClusterResolver(tf_config=json.dumps(cfg)))


# ---------------------------------------------------------------------- AutoShardPolicy
def _batches(n=3, b=8):
    return [np.arange(i * b, (i + 1) * b).reshape(b, 1) for i in range(n)]


def test_auto_shard_data_splits_rows_of_each_global_batch():
    parts = [list(auto_shard(_batches(), 2, i)) for i in range(2)]
    assert parts[0][0].ravel().tolist() == [0, 1, 2, 3]
    assert parts[1][0].ravel().tolist() == [4, 5, 6, 7]
    assert len(parts[1]) == 3
    with pytest.raises(ValueError, match="8 rows does not split across 3"):
        list(auto_shard(_batches(), 3, 0, "DATA"))


def test_auto_shard_file_and_auto_and_off():
    files = [f"f{i}" for i in range(5)]
    ds = FileListDataset(files, lambda f: [np.array([[int(f[1:])]])])
    assert auto_shard(ds, 2, 1, "FILE").files == ["f1", "f3"]
    assert auto_shard(ds, 2, 0).files == ["f0", "f2", "f4"]          # AUTO -> FILE
    assert isinstance(auto_shard(FileListDataset(files[:1], ds.read_fn), 2, 0),
                      type(auto_shard(_batches(), 2, 0)))            # AUTO -> DATA (1 file)
    assert auto_shard(ds, 2, 1, "OFF") is ds
    tagged = with_auto_shard_policy(_batches(), jaxdist.AutoShardPolicy.OFF)
    assert len(list(auto_shard(tagged, 2, 1))[0]) == 8
    with pytest.raises(ValueError, match="FILE needs a file-based dataset.*list"):
        auto_shard(_batches(), 2, 0, "FILE")
    with pytest.raises(ValueError, match="5 file\\(s\\).*across 8 processes"):
        auto_shard(ds, 8, 0, "FILE")
    ctx = jaxdist.InputContext(num_input_pipelines=2, input_pipeline_id=1,
                               num_replicas_in_sync=4)
    assert shard_files(files, ctx) == ["f1", "f3"]
