"""Cluster specs, TF_CONFIG validation and the other resolvers (pure unit tests)."""

import json
import os

import pytest

from jaxdist._src.cluster.cluster_spec import ClusterSpec
from jaxdist._src.cluster.errors import ClusterConfigError, ClusterMergeError
from jaxdist._src.cluster.resolver import SimpleClusterResolver, UnionResolver
from jaxdist._src.cluster.slurm import SlurmClusterResolver, expand_hostlist, expand_tasks_per_node
from jaxdist._src.cluster.tf_config import TFConfigClusterResolver
from jaxdist._src.cluster.tpu_cluster_resolver import TPUClusterResolver
from jaxdist._src.distributed.process_group import process_group
from jaxdist._src.launch.local import local_cluster, task_env, task_list, tf_config


def resolver(config, **kw):
    return TFConfigClusterResolver(tf_config=json.dumps(config), **kw)


CLUSTER = {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"], "ps": ["h3:2222"]}


# ---------------------------------------------------------------------- ClusterSpec
def test_cluster_spec_dense_and_sparse():
    spec = ClusterSpec({"worker": ["a:1", "b:2"], "ps": {"1": "c:3", 3: "d:4"}})
    assert spec.jobs == ["worker", "ps"]
    assert spec.num_tasks("worker") == 2 and spec.num_tasks("ps") == 2
    assert spec.task_indices("ps") == [1, 3]
    assert spec.task_address("ps", 3) == "d:4"
    assert spec.job_tasks("ps") == [None, "c:3", None, "d:4"]
    assert spec.as_dict() == {"worker": ["a:1", "b:2"], "ps": {1: "c:3", 3: "d:4"}}
    assert ClusterSpec(spec) == spec and spec == spec.as_dict()
    assert ClusterSpec({}).as_dict() == {} and not ClusterSpec({})
    with pytest.raises(ValueError, match="No such job"):
        spec.num_tasks("chief")
    with pytest.raises(ValueError, match="No task with index 2"):
        spec.task_address("ps", 2)


@pytest.mark.parametrize("bad, match", [
    ({"worker": "a:1"}, "job 'worker' is 'a:1'.*list"),
    ({"worker": [1]}, "address 1"),
    ({"worker": {"x": "a:1"}}, "task index 'x'"),
    ([("worker", ["a:1"])], "expected a dict"),
])
def test_cluster_spec_rejects_malformed(bad, match):
    with pytest.raises(ClusterConfigError, match=match):
        ClusterSpec(bad)


# ---------------------------------------------------------------------- TF_CONFIG
def test_tf_config_resolver_reads_everything(monkeypatch):
    cfg = {"cluster": CLUSTER, "task": {"type": "worker", "index": 1}, "rpc_layer": "grpc",
           "environment": "cloud", "token": "s3cret"}
    monkeypatch.setenv("TF_CONFIG", json.dumps(cfg))
    monkeypatch.delenv("JAXDIST_CLUSTER_TOKEN", raising=False)
    r = TFConfigClusterResolver()
    assert r.cluster_spec().as_dict() == CLUSTER
    assert (r.task_type, r.task_id, r.rpc_layer, r.environment) == ("worker", 1, "grpc", "cloud")
    assert r.master() == "grpc://h2:2222"
    assert r.master("ps", 0, rpc_layer="") in ("grpc://h3:2222", "h3:2222")
    assert r.cluster_token == "s3cret"
    r2 = TFConfigClusterResolver(task_type="chief", task_id=0, rpc_layer="")
    assert r2.master() == "h0:2222"


def test_token_from_env_when_tf_config_has_none(monkeypatch):
    monkeypatch.setenv("JAXDIST_CLUSTER_TOKEN", "from-env")
    assert resolver({"cluster": {"worker": ["a:1"]}}).cluster_token == "from-env"
    monkeypatch.delenv("JAXDIST_CLUSTER_TOKEN")
    assert resolver({"cluster": {"worker": ["a:1"]}}).cluster_token is None


def test_no_tf_config_is_an_empty_cluster(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    r = TFConfigClusterResolver()
    assert not r.cluster_spec() and r.task_type is None and r.master() == ""
    g = process_group(r)
    assert g.num_processes == 1 and not g.multi_process and g.is_chief


def test_sparse_worker_form():
    r = resolver({"cluster": {"worker": {"1": "h1:1"}, "chief": ["h0:1"]},
                  "task": {"type": "worker", "index": 1}})
    assert r.cluster_spec().task_indices("worker") == [1]
    g = process_group(r)
    assert g.tasks == (("chief", 0), ("worker", 1)) and g.process_id == 1


@pytest.mark.parametrize("config, match", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"cluster": ["a:1"]}, "\"cluster\" is \\[\"a:1\"\\]"),
    ({"cluster": {"master": ["a:1"]}, "task": {"type": "master", "index": 0}},
     "Disallowed task type found in cluster spec: 'master'.*chief, worker, ps, evaluator"),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "driver", "index": 0}},
     "\"task\" is \\{\"type\": \"driver\", \"index\": 0\\}: Unrecognized task_type"),
    ({"cluster": {"chief": ["a:1", "b:1"], "worker": ["c:1"]}},
     "\\{\"chief\": \\[\"a:1\", \"b:1\"\\]\\}: There must be at most one 'chief' job"),
    ({"cluster": {"worker": ["a:1"], "evaluator": ["b:1", "c:1"]}},
     "at most one 'evaluator'"),
    ({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 2}},
     "has no task 2 \\(indices: \\[0, 1\\]\\)"),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "ps", "index": 0}},
     "`task_type` 'ps' not found in cluster_spec"),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": -1}},
     "\"index\" is -1: expected a task index in 0..2147483647"),
    ({"cluster": {"worker": ["a:1"]}, "task": {"index": 0}}, "has no \"type\""),
    ({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "idx": 0}},
     "unknown key\\(s\\) \\[\"idx\"\\]"),
    ({"cluster": {"worker": ["localhost"]}, "task": {"type": "worker", "index": 0}},
     "\"worker\"\\[0\\] is \"localhost\": expected \"host:port\""),
    ({"cluster": {"worker": ["a:99999"]}}, "port \"99999\" is not a port number 1..65535"),
    ({"cluster": {"worker": ["a:1"]}, "rpc_layer": 5}, "\"rpc_layer\" is 5 of type int"),
])
def test_tf_config_validation_quotes_the_bad_part(config, match):
    raw = config if isinstance(config, str) else json.dumps(config)
    with pytest.raises(ClusterConfigError, match=match):
        r = TFConfigClusterResolver(tf_config=raw)
        r.cluster_spec()
        process_group(r)


def test_evaluator_may_be_missing_from_cluster_and_stays_out():
    r = resolver({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "evaluator",
                                                                  "index": 0}})
    g = process_group(r)
    # TF's is_chief calls the evaluator its own chief; the group's chief never is the evaluator
    # (it must not write the training checkpoints).
    assert not g.in_training_group and g.num_processes == 2 and not g.is_chief
    r = resolver({"cluster": {"worker": ["a:1"], "evaluator": ["e:1"], "ps": ["p:1"]},
                  "task": {"type": "evaluator", "index": 0}})
    assert process_group(r).tasks == (("worker", 0),)


def test_process_order_chief_first_then_workers_ps_excluded():
    for task, pid, chief in [(("chief", 0), 0, True), (("worker", 0), 1, False),
                             (("worker", 1), 2, False)]:
        g = process_group(resolver({"cluster": CLUSTER,
                                    "task": {"type": task[0], "index": task[1]}}))
        assert g.tasks == (("chief", 0), ("worker", 0), ("worker", 1))
        assert (g.process_id, g.is_chief) == (pid, chief)
        assert g.coordination_address == "h0:2222"
        assert g.coordination_bind_address == "h0:2222"  # only the interface named
        assert g.task_name(2) == "worker:1"
    g = process_group(resolver({"cluster": CLUSTER, "task": {"type": "ps", "index": 0}}))
    assert g.process_id is None and not g.in_training_group


def test_worker0_is_chief_without_chief_and_loopback_binds_loopback():
    g = process_group(resolver({"cluster": {"worker": ["localhost:5000", "localhost:5001"]},
                                "task": {"type": "worker", "index": 0}}))
    assert g.is_chief and g.process_id == 0
    assert g.coordination_address == "127.0.0.1:5000"
    assert g.coordination_bind_address == "127.0.0.1:5000"


def test_multi_task_cluster_without_task_is_an_error():
    with pytest.raises(ClusterConfigError, match="no \"task\" says which one"):
        process_group(resolver({"cluster": {"worker": ["a:1", "b:1"]}}))


# ---------------------------------------------------------------------- other resolvers
def test_simple_and_union_resolvers(monkeypatch):
    monkeypatch.delenv("JAXDIST_CLUSTER_TOKEN", raising=False)
    w = SimpleClusterResolver({"worker": ["a:1", "b:1"]}, task_type="worker", task_id=1,
                              rpc_layer="grpc", num_accelerators={"GPU": 2}, cluster_token="t")
    p = SimpleClusterResolver(ClusterSpec({"ps": ["c:1"]}))
    assert w.master() == "grpc://b:1" and w.num_accelerators() == {"GPU": 2}
    u = UnionResolver(w, p)
    assert u.cluster_spec().as_dict() == {"worker": ["a:1", "b:1"], "ps": ["c:1"]}
    assert (u.task_type, u.task_id, u.cluster_token) == ("worker", 1, "t")
    assert u.master("ps", 0) == "grpc://c:1"
    # TF merges a job that two resolvers define: lists concatenate, sparse indices must differ.
    assert UnionResolver(w, w).cluster_spec().as_dict() == {"worker": ["a:1", "b:1"] * 2}
    s1 = SimpleClusterResolver({"worker": {7: "a:1"}})
    with pytest.raises(ClusterMergeError, match="job \"worker\" has task\\(s\\) \\[7\\]"):
        UnionResolver(s1, s1).cluster_spec()


def test_slurm_resolver(monkeypatch):
    assert expand_hostlist("n[01-03,07],gpu1") == ["n01", "n02", "n03", "n07", "gpu1"]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[1-2]")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x2)")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    r = SlurmClusterResolver(jobs={"ps": 1, "worker": 3}, port_base=9000, auto_set_gpu=False)
    assert r.cluster_spec().as_dict() == {
        "ps": ["node1:9000"], "worker": ["node1:9001", "node2:9000", "node2:9001"]}
    assert (r.task_type, r.task_id) == ("worker", 2)
    assert r.master() == "grpc://node2:9001"
    with pytest.raises(ClusterConfigError, match="ask for 3 tasks, but the Slurm step has 4"):
        SlurmClusterResolver(jobs={"worker": 3})
    monkeypatch.delenv("SLURM_PROCID")
    with pytest.raises(ClusterConfigError, match="SLURM_PROCID is not set"):
        SlurmClusterResolver()


def test_tpu_pod_slice_resolver(monkeypatch):
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t0,t1,t2,t3")
    monkeypatch.setenv("TPU_WORKER_ID", "2")
    r = TPUClusterResolver(tpu="my-pod")
    assert r.is_pod_slice and r.task_id == 2
    assert r.cluster_spec().as_dict() == {"worker": [f"t{i}:8470" for i in range(4)]}
    assert r.master() == "grpc://t2:8470"
    g = process_group(r)
    assert g.process_id == 2 and g.coordination_address == "t0:8476"
    monkeypatch.setenv("TPU_WORKER_ID", "7")
    with pytest.raises(ClusterConfigError, match="worker id 7"):
        TPUClusterResolver()
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES")
    monkeypatch.delenv("TPU_WORKER_ID")
    local = TPUClusterResolver(tpu="local")
    assert not local.is_pod_slice and local.master() == ""


# ---------------------------------------------------------------------- local clusters
def test_local_cluster_and_task_env():
    cluster = local_cluster(workers=2, ps=1, chief=True, evaluator=True)
    assert [len(cluster[j]) for j in ("chief", "worker", "ps", "evaluator")] == [1, 2, 1, 1]
    ports = [a.rsplit(":", 1)[1] for addrs in cluster.values() for a in addrs]
    assert len(set(ports)) == 5
    assert task_list(cluster)[:3] == [("chief", 0), ("worker", 0), ("worker", 1)]
    env = task_env(cluster, "worker", 1, "tok", devices_per_process=2, base={})
    cfg = json.loads(env["TF_CONFIG"])
    assert cfg["task"] == {"type": "worker", "index": 1} and cfg["token"] == "tok"
    assert env["JAXDIST_CLUSTER_TOKEN"] == "tok" and env["JAX_NUM_CPU_DEVICES"] == "2"
    r = TFConfigClusterResolver(tf_config=tf_config(cluster, "worker", 1, "tok"))
    assert process_group(r).process_id == 2


def test_any_job_name_in_resolvers_and_tfs_master_rules():
    r = SimpleClusterResolver({"sun": ["a:1"], "moon": ["b:1", "c:1"]}, task_type="moon",
                              task_id=1)
    assert r.master() == "c:1" and r.master("sun", 0, rpc_layer="grpc") == "grpc://a:1"
    with pytest.raises(ValueError, match="No task with index 5"):
        r.master("moon", 5)  # TF: a task named explicitly must exist
    with pytest.raises(ClusterConfigError, match="Disallowed task type"):
        process_group(r)  # the strategies keep TF's multi-worker rules


def test_slurm_sorts_jobs_and_hosts_and_leaves_cpu_nodes_alone(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "3")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "b2,a1,c3")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "1(x3)")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    r = SlurmClusterResolver(jobs={"worker": 2, "chief": 1})
    assert r.cluster_spec().as_dict() == {"chief": ["a1:8888"], "worker": ["b2:8888", "c3:8888"]}
    assert (r.task_type, r.task_id) == ("chief", 0)
    assert r.num_accelerators() == {} and os.environ["CUDA_VISIBLE_DEVICES"] == ""
    with pytest.raises(ClusterConfigError, match="need more than the gpus_per_node=1"):
        SlurmClusterResolver(gpus_per_node=1, gpus_per_task=2)


def test_slurm_bound_gpus_are_not_split_again(monkeypatch):
    # srun --ntasks-per-node=2 --gpus-per-task=1: Slurm gave this task its GPU ("0" in its
    # view); TF's rule would count 1 GPU on the node, give each task 0 and leave it unused.
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "g[1-2]")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x2)")
    monkeypatch.setenv("SLURM_GPUS_PER_TASK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    r = SlurmClusterResolver()
    assert r.num_accelerators() == {"GPU": 1}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"          # as Slurm set it
    assert r.cluster_spec().as_dict() == {"worker": ["g1:8888", "g1:8889", "g2:8888",
                                                     "g2:8889"]}
    # Either GPU argument given: TF's rule, as in TF's own tests.
    r = SlurmClusterResolver(gpus_per_node=2, gpus_per_task=1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.delenv("SLURM_GPUS_PER_TASK")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert SlurmClusterResolver().num_accelerators() == {}   # TF: 1 GPU // 2 tasks
