"""Port of TensorFlow's tensorflow/python/distribute/multi_worker_util_test.py.

TF's inputs, expected values and error regexes, jaxdist's API: ``multi_worker_util.X`` ->
``jaxdist._src.cluster.validation.X``; ``server_lib.ClusterSpec`` -> ``ClusterSpec``; a
``cluster_pb2.ClusterDef`` proto -> the job -> {task index: address} dict jaxdist uses for it.
"""

import pytest

from jaxdist._src.cluster import validation as multi_worker_util
from jaxdist.cluster_resolver import ClusterSpec

CLUSTER = {
    "chief": ["127.0.0.1:1234"],
    "worker": ["127.0.0.1:8964", "127.0.0.1:2333"],
    "ps": ["127.0.0.1:1926", "127.0.0.1:3141"]
}


# ---------------------------------------------------------------------- NormalizeClusterSpecTest
def assert_same_cluster(lhs, rhs):
    assert ClusterSpec(lhs).as_dict() == ClusterSpec(rhs).as_dict()


def testDictAsInput():
    cluster_spec = dict(CLUSTER)
    assert_same_cluster(cluster_spec, multi_worker_util.normalize_cluster_spec(cluster_spec))


def testClusterDefAsInput():
    cluster_def = {
        "chief": {0: "127.0.0.1:1234"},
        "worker": {0: "127.0.0.1:8964", 1: "127.0.0.1:2333"},
        "ps": {0: "127.0.0.1:1926", 1: "127.0.0.1:3141"},
    }
    assert_same_cluster(cluster_def, multi_worker_util.normalize_cluster_spec(cluster_def))


def testClusterSpecAsInput():
    cluster_spec = ClusterSpec(CLUSTER)
    assert_same_cluster(cluster_spec, multi_worker_util.normalize_cluster_spec(cluster_spec))


def testUnexpectedInput():
    cluster_spec = ["127.0.0.1:8964", "127.0.0.1:2333"]
    with pytest.raises(
            ValueError,
            match="`cluster_spec' should be dict or a `tf.train.ClusterSpec` or a "
                  "`tf.train.ClusterDef` object"):
        multi_worker_util.normalize_cluster_spec(cluster_spec)


# ---------------------------------------------------------------------- IsChiefTest
def testClusterWithChief():
    assert multi_worker_util.is_chief(CLUSTER, "chief", 0)
    assert not multi_worker_util.is_chief(CLUSTER, "worker", 0)


def testClusterWithoutChief():
    cluster_spec = {"worker": ["127.0.0.1:8964", "127.0.0.1:2333"]}
    assert multi_worker_util.is_chief(cluster_spec, "worker", 0)
    assert not multi_worker_util.is_chief(cluster_spec, "worker", 1)

    with pytest.raises(ValueError, match="`task_type` 'chief' not found in cluster_spec."):
        multi_worker_util.is_chief(cluster_spec, "chief", 0)

    with pytest.raises(ValueError, match="The `task_id` 2 exceeds the maximum id of worker."):
        multi_worker_util.is_chief(cluster_spec, "worker", 2)


def testEvaluatorIsChief():
    cluster_spec = {
        "chief": ["127.0.0.1:1234"],
        "worker": ["127.0.0.1:8964", "127.0.0.1:2333"],
        "evaluator": ["127.0.0.1:2019"]
    }
    assert multi_worker_util.is_chief(cluster_spec, "evaluator", 0)


# ---------------------------------------------------------------------- NumWorkersTest
def testCountWorker():
    assert multi_worker_util.worker_count(CLUSTER, task_type="chief") == 3
    assert multi_worker_util.worker_count(CLUSTER, task_type="worker") == 3


def testCountEvaluator():
    cluster_spec = {
        "chief": ["127.0.0.1:1234"],
        "worker": ["127.0.0.1:8964", "127.0.0.1:2333"],
        "evaluator": ["127.0.0.1:7566"]
    }
    assert multi_worker_util.worker_count(cluster_spec, task_type="evaluator") == 1


def testTaskTypeNotFound():
    cluster_spec = {}
    with pytest.raises(ValueError, match="`task_type` 'worker' not found in cluster_spec."):
        multi_worker_util.worker_count(cluster_spec, task_type="worker")


def testCountPs():
    cluster_spec = {"chief": ["127.0.0.1:1234"], "ps": ["127.0.0.1:1926", "127.0.0.1:3141"]}
    # A "ps" job shouldn't call this method.
    with pytest.raises(ValueError, match="Unexpected `task_type` 'ps'"):
        multi_worker_util.worker_count(cluster_spec, task_type="ps")


# ---------------------------------------------------------------------- IdInClusterTest
def testChiefId():
    assert multi_worker_util.id_in_cluster(CLUSTER, "chief", 0) == 0


def testWorkerId():
    assert multi_worker_util.id_in_cluster(CLUSTER, "worker", 1) == 2
    cluster_spec = {
        "worker": ["127.0.0.1:8964", "127.0.0.1:2333"],
        "ps": ["127.0.0.1:1926", "127.0.0.1:3141"]
    }
    assert multi_worker_util.id_in_cluster(cluster_spec, "worker", 1) == 1


def testEvaluatorId():
    cluster_spec = {
        "chief": ["127.0.0.1:1234"],
        "worker": ["127.0.0.1:8964", "127.0.0.1:2333"],
        "evaluator": ["127.0.0.1:7566"]
    }
    assert multi_worker_util.id_in_cluster(cluster_spec, "evaluator", 0) == 0


def testPsId():
    cluster_spec = {"chief": ["127.0.0.1:1234"], "ps": ["127.0.0.1:7566"]}
    with pytest.raises(ValueError, match="There is no id for task_type 'ps'"):
        multi_worker_util.id_in_cluster(cluster_spec, "ps", 0)


def testMultipleChiefs():
    cluster_spec = {"chief": ["127.0.0.1:8258", "127.0.0.1:7566"]}
    with pytest.raises(ValueError, match="There must be at most one 'chief' job."):
        multi_worker_util.id_in_cluster(cluster_spec, "chief", 0)


# ---------------------------------------------------------------------- CollectiveLeaderTest
def testChiefAsLeader():
    assert (multi_worker_util.collective_leader(CLUSTER, "worker", 0)
            == "/job:chief/replica:0/task:0")


def testWorkerAsLeader():
    cluster_spec = {
        "worker": ["127.0.0.1:8964", "127.0.0.1:2333"],
        "ps": ["127.0.0.1:1926", "127.0.0.1:3141"]
    }
    assert (multi_worker_util.collective_leader(cluster_spec, "worker", 1)
            == "/job:worker/replica:0/task:0")


def testLeaderForEvaluator():
    cluster_spec = dict(CLUSTER, evaluator=["127.0.0.1:2019"])
    assert multi_worker_util.collective_leader(cluster_spec, "evaluator", 0) == ""


def testLocalLeader():
    cluster_spec = {}
    assert multi_worker_util.collective_leader(cluster_spec, None, 0) == ""


# ---------------------------------------------------------------------- ClusterSpecValidationTest
def testEvaluatorNotInCluster():
    multi_worker_util._validate_cluster_spec(CLUSTER, "chief", 0)
    multi_worker_util._validate_cluster_spec(CLUSTER, "worker", 0)
    multi_worker_util._validate_cluster_spec(CLUSTER, "ps", 0)
    multi_worker_util._validate_cluster_spec(CLUSTER, "evaluator", 0)


def testWorkerNotInCluster():
    cluster_spec = {"chief": ["127.0.0.1:1234"], "ps": ["127.0.0.1:1926", "127.0.0.1:3141"]}
    multi_worker_util._validate_cluster_spec(cluster_spec, "evaluator", 0)
    with pytest.raises(ValueError, match="`task_type` 'worker' not found in cluster_spec."):
        multi_worker_util._validate_cluster_spec(cluster_spec, "worker", 0)
