"""Port of TensorFlow's
tensorflow/python/distribute/cluster_resolver/slurm_cluster_resolver_test.py.

TF's Slurm variables and expected values, jaxdist's API: ``server_lib.ClusterSpec`` ->
``jaxdist.cluster_resolver.ClusterSpec``; a ``ClusterDef`` proto -> the dict
``as_cluster_def()`` returns. ``mock.patch.dict(os.environ, ...)`` is kept as TF writes it (it
also restores ``CUDA_VISIBLE_DEVICES``, which the resolver sets).
"""

import os
from unittest import mock

import pytest

from jaxdist._src.cluster.slurm import expand_hostlist, expand_tasks_per_node
from jaxdist.cluster_resolver import ClusterSpec, SlurmClusterResolver


@pytest.fixture(autouse=True)
def _no_outer_slurm(monkeypatch):
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)


def verify_cluster_spec_equality(cluster_spec, expected):
    for spec in (cluster_spec, ClusterSpec(cluster_spec),
                 ClusterSpec(cluster_spec.as_cluster_def()), ClusterSpec(cluster_spec.as_dict())):
        assert list(spec.as_cluster_def().items()) == expected


PS_WORKER_PROTO = [("ps", {0: "t02n13:8888"}),
                   ("worker", {0: "t02n41:8888", 1: "t02n43:8888"})]
MULTI_PROTO = [("ps", {0: "t02n13:8888"}),
               ("worker", {0: "t02n13:8889", 1: "t02n41:8888", 2: "t02n41:8889",
                           3: "t02n43:8888"})]


def test_expand_hostlist():
    assert expand_hostlist("n1") == ["n1"]
    assert expand_hostlist("n[1,3]") == ["n1", "n3"]
    assert expand_hostlist("n[1-3]") == ["n1", "n2", "n3"]
    assert expand_hostlist("n[1-2],m5,o[3-4,6,7-9]") == [
        "n1", "n2", "m5", "o3", "o4", "o6", "o7", "o8", "o9"]
    assert expand_hostlist("n[0001-0003],m5,o[009-011]") == [
        "n0001", "n0002", "n0003", "m5", "o009", "o010", "o011"]


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2") == [2]
    assert expand_tasks_per_node("2,1,3") == [2, 1, 3]
    assert expand_tasks_per_node("3(x2),2,1") == [3, 3, 2, 1]
    assert expand_tasks_per_node("3(x2),2,11(x4)") == [3, 3, 2, 11, 11, 11, 11]
    assert expand_tasks_per_node("13(x10)") == [13] * 10


@mock.patch.dict(os.environ, {
    "SLURM_PROCID": "0",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_STEP_TASKS_PER_NODE": "1(x3)",
    "SLURM_STEP_NODELIST": "t02n13,t02n41,t02n43",
    "CUDA_VISIBLE_DEVICES": "0",
})
def testSimpleRetrievalFromEnv():
    slurm_cluster_resolver = SlurmClusterResolver()
    verify_cluster_spec_equality(slurm_cluster_resolver.cluster_spec(), [
        ("worker", {0: "t02n13:8888", 1: "t02n41:8888", 2: "t02n43:8888"})])
    assert slurm_cluster_resolver.master("worker", 0, rpc_layer="grpc") == "grpc://t02n13:8888"
    assert slurm_cluster_resolver.num_accelerators() == {"GPU": 1}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"


@mock.patch.dict(os.environ, {
    "SLURM_PROCID": "0",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_STEP_NODELIST": "t02n13,t02n41,t02n43",
})
def testSimpleSuccessfulRetrieval():
    slurm_cluster_resolver = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 2}, port_base=8888, tasks_per_node=1, gpus_per_node=1,
        gpus_per_task=1, auto_set_gpu=False)
    verify_cluster_spec_equality(slurm_cluster_resolver.cluster_spec(), PS_WORKER_PROTO)


@mock.patch.dict(os.environ, {
    "SLURM_PROCID": "0",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_STEP_NODELIST": "t02n13,t02n41,t02n43",
})
def testSimpleMasterRetrieval():
    slurm_cluster_resolver = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 2}, port_base=8888, tasks_per_node=1, gpus_per_node=1,
        gpus_per_task=1, auto_set_gpu=False)
    slurm_cluster_resolver.task_type = "worker"
    slurm_cluster_resolver.task_id = 1
    assert slurm_cluster_resolver.master() == "grpc://t02n43:8888"

    slurm_cluster_resolver.rpc_layer = "ab"
    assert slurm_cluster_resolver.master("ps", 0) == "ab://t02n13:8888"
    assert slurm_cluster_resolver.master("ps", 0, rpc_layer="test") == "test://t02n13:8888"


@mock.patch.dict(os.environ, {
    "SLURM_PROCID": "0",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_STEP_TASKS_PER_NODE": "1(x3)",
    "SLURM_STEP_NODELIST": "t02n13,t02n41,t02n43",
})
def testTaskPerNodeNotSetRetrieval():
    slurm_cluster_resolver = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 2}, port_base=8888, gpus_per_node=1, gpus_per_task=1,
        auto_set_gpu=False)
    verify_cluster_spec_equality(slurm_cluster_resolver.cluster_spec(), PS_WORKER_PROTO)


@mock.patch.dict(os.environ, {
    "SLURM_PROCID": "1",
    "SLURM_STEP_NUM_TASKS": "5",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
    "SLURM_STEP_NODELIST": "t02n13,t02n41,t02n43",
    "CUDA_VISIBLE_DEVICES": "",
})
def testMultiTaskPerNodeRetrieval():
    slurm_cluster_resolver = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 4}, port_base=8888, gpus_per_node=2, gpus_per_task=1,
        auto_set_gpu=True)
    verify_cluster_spec_equality(slurm_cluster_resolver.cluster_spec(), MULTI_PROTO)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"


@mock.patch.dict(os.environ, {
    "SLURM_PROCID": "1",
    "SLURM_STEP_NUM_TASKS": "5",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
    "SLURM_STEP_NODELIST": "t02n13,t02n41,t02n43",
    "CUDA_VISIBLE_DEVICES": "",
})
def testMultipleGpusPerTaskRetrieval():
    slurm_cluster_resolver = SlurmClusterResolver(
        jobs={"ps": 1, "worker": 4}, port_base=8888, gpus_per_node=4, gpus_per_task=2,
        auto_set_gpu=True)
    verify_cluster_spec_equality(slurm_cluster_resolver.cluster_spec(), MULTI_PROTO)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
