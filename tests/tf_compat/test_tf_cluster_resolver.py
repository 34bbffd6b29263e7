"""Port of TensorFlow's tensorflow/python/distribute/cluster_resolver/cluster_resolver_test.py.

TF's inputs and expected values, jaxdist's API: ``server_lib.ClusterSpec`` ->
``jaxdist.cluster_resolver.ClusterSpec``; ``UnionClusterResolver`` -> ``UnionResolver`` (the name TF
exports it under); a ``ClusterDef`` proto -> the dict
``as_cluster_def()`` returns (job -> {task index: address}, jobs sorted by name, as TF's proto).
TF lists devices through a mocked session; jaxdist counts ``jax.local_devices()``, which the
ported accelerator tests replace the same way.
"""

from unittest import mock

import jax
import pytest

from jaxdist import ClusterMergeError
from jaxdist.cluster_resolver import (
    ClusterResolver,
    ClusterSpec,
    SimpleClusterResolver,
    UnionResolver,
)


def _proto(jobs):
    """The expected ``ClusterDef``: (job name, {task index: address}) in TF's order."""
    return [(name, dict(tasks)) for name, tasks in jobs]


def verify_cluster_spec_equality(cluster_spec, expected):
    for spec in (cluster_spec, ClusterSpec(cluster_spec),
                 ClusterSpec(cluster_spec.as_cluster_def()), ClusterSpec(cluster_spec.as_dict())):
        assert list(spec.as_cluster_def().items()) == _proto(expected)


class MockBaseClusterResolver(ClusterResolver):

    def cluster_spec(self):
        return None

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        return ""

    def environment(self):
        return ""


class _FakeDevice:
    def __init__(self, platform):
        self.platform = platform


def _devices(*kinds):
    return [_FakeDevice(k) for k in kinds]


# ---------------------------------------------------------------------- BaseClusterResolverTest
def testNumAcceleratorsSuccess():
    with mock.patch.object(jax, "local_devices", return_value=_devices(*["gpu"] * 4)):
        resolver = MockBaseClusterResolver()
        assert resolver.num_accelerators() == {"GPU": 4}


def testNumAcceleratorsMultiDeviceSuccess():
    with mock.patch.object(jax, "local_devices",
                           return_value=_devices(*["tpu"] * 4, *["gpu"] * 4)):
        resolver = MockBaseClusterResolver()
        assert resolver.num_accelerators() == {"TPU": 4, "GPU": 4}


@pytest.mark.skip(reason="TF lists the devices of remote tasks (/job:worker2/task:3) through a "
                         "session; a JAX process sees only its own devices, so num_accelerators "
                         "cannot filter another task's devices")
def testNumAcceleratorsFilterTasks():
    pass


# ---------------------------------------------------------------------- UnionClusterResolverTest
PS_WORKER = {"ps": ["ps0:2222", "ps1:2222"],
             "worker": ["worker0:2222", "worker1:2222", "worker2:2222"]}
PS_WORKER_PROTO = [("ps", {0: "ps0:2222", 1: "ps1:2222"}),
                   ("worker", {0: "worker0:2222", 1: "worker1:2222", 2: "worker2:2222"})]


def testSingleClusterResolver():
    base_cluster_spec = ClusterSpec(PS_WORKER)
    simple_resolver = SimpleClusterResolver(base_cluster_spec)
    union_resolver = UnionResolver(simple_resolver)
    verify_cluster_spec_equality(union_resolver.cluster_spec(), PS_WORKER_PROTO)


def testInitSimpleClusterResolver():
    simple_resolver = SimpleClusterResolver(ClusterSpec(PS_WORKER), task_type="ps", task_id=1,
                                            environment="cloud", num_accelerators={"GPU": 8},
                                            rpc_layer="grpc")
    assert simple_resolver.task_type == "ps"
    assert simple_resolver.task_id == 1
    assert simple_resolver.environment == "cloud"
    assert simple_resolver.num_accelerators() == {"GPU": 8}
    assert simple_resolver.rpc_layer == "grpc"


def testOverrideSimpleClusterResolver():
    simple_resolver = SimpleClusterResolver(ClusterSpec(PS_WORKER), task_type="ps", task_id=1,
                                            environment="cloud", num_accelerators={"GPU": 8},
                                            rpc_layer="grpc")
    simple_resolver.task_type = "worker"
    simple_resolver.task_id = 2
    simple_resolver.rpc_layer = "http"
    assert simple_resolver.task_type == "worker"
    assert simple_resolver.task_id == 2
    assert simple_resolver.rpc_layer == "http"


def testSimpleOverrideMasterWithTaskIndexZero():
    simple_resolver = SimpleClusterResolver(ClusterSpec(PS_WORKER))
    assert simple_resolver.master("worker", 0, rpc_layer="grpc") == "grpc://worker0:2222"


def testSimpleOverrideMasterWithRpcLayer():
    simple_resolver = SimpleClusterResolver(ClusterSpec(PS_WORKER))
    assert simple_resolver.master("worker", 2, rpc_layer="grpc") == "grpc://worker2:2222"


def testSimpleOverrideMaster():
    simple_resolver = SimpleClusterResolver(ClusterSpec(PS_WORKER))
    assert simple_resolver.master("worker", 2) == "worker2:2222"


def testUnionClusterResolverGetProperties():
    resolver1 = SimpleClusterResolver(ClusterSpec(PS_WORKER), task_type="ps", task_id=1,
                                      environment="cloud", num_accelerators={"GPU": 8},
                                      rpc_layer="grpc")
    cluster_spec_2 = ClusterSpec({"ps": ["ps2:2222", "ps3:2222"],
                                  "worker": ["worker3:2222", "worker4:2222", "worker5:2222"]})
    resolver2 = SimpleClusterResolver(cluster_spec_2, task_type="worker", task_id=2,
                                      environment="local", num_accelerators={"GPU": 16},
                                      rpc_layer="http")
    union_resolver = UnionResolver(resolver1, resolver2)
    assert union_resolver.task_type == "ps"
    assert union_resolver.task_id == 1
    assert union_resolver.environment == "cloud"
    assert union_resolver.num_accelerators() == {"GPU": 8}
    assert union_resolver.rpc_layer == "grpc"

    union_resolver.task_type = "worker"
    union_resolver.task_id = 2
    union_resolver.rpc_layer = "http"
    assert union_resolver.task_type == "worker"
    assert union_resolver.task_id == 2
    assert union_resolver.rpc_layer == "http"


def _two(spec1, spec2):
    return UnionResolver(SimpleClusterResolver(ClusterSpec(spec1)),
                                SimpleClusterResolver(ClusterSpec(spec2)))


def testTwoNonOverlappingJobMergedClusterResolver():
    union_cluster = _two({"ps": ["ps0:2222", "ps1:2222"]},
                         {"worker": ["worker0:2222", "worker1:2222", "worker2:2222"]})
    verify_cluster_spec_equality(union_cluster.cluster_spec(), PS_WORKER_PROTO)


def testMergedClusterResolverMaster():
    union_cluster = _two({"ps": ["ps0:2222", "ps1:2222"]},
                         {"worker": ["worker0:2222", "worker1:2222", "worker2:2222"]})
    assert union_cluster.master() == ""
    assert union_cluster.master("worker", 1) == "worker1:2222"
    assert union_cluster.master("worker", 1, rpc_layer="grpc") == "grpc://worker1:2222"


def testOverlappingJobMergedClusterResolver():
    union_cluster = _two({"worker": ["worker4:2222", "worker5:2222"]},
                         {"worker": ["worker0:2222", "worker1:2222", "worker2:2222"]})
    verify_cluster_spec_equality(union_cluster.cluster_spec(), [
        ("worker", {0: "worker4:2222", 1: "worker5:2222", 2: "worker0:2222",
                    3: "worker1:2222", 4: "worker2:2222"})])


def testOverlappingSparseJobMergedClusterResolverThrowError():
    union_cluster = _two({"worker": {7: "worker4:2222", 9: "worker5:2222"}},
                         {"worker": {3: "worker0:2222", 6: "worker1:2222", 7: "worker2:2222"}})
    with pytest.raises(KeyError):
        union_cluster.cluster_spec()
    with pytest.raises(ClusterMergeError, match=r"\[7\]"):  # jaxdist: also a ValueError
        union_cluster.cluster_spec()


def testOverlappingDictAndListThrowError():
    union_cluster = _two({"worker": ["worker4:2222", "worker5:2222"]},
                         {"worker": {1: "worker0:2222", 2: "worker1:2222", 3: "worker2:2222"}})
    with pytest.raises(KeyError):
        union_cluster.cluster_spec()


def testOverlappingJobNonOverlappingKey():
    union_cluster = _two({"worker": {5: "worker4:2222", 9: "worker5:2222"}},
                         {"worker": {3: "worker0:2222", 6: "worker1:2222", 7: "worker2:2222"}})
    verify_cluster_spec_equality(union_cluster.cluster_spec(), [
        ("worker", {3: "worker0:2222", 5: "worker4:2222", 6: "worker1:2222",
                    7: "worker2:2222", 9: "worker5:2222"})])


def testMixedModeNonOverlappingKey():
    union_cluster = _two({"worker": ["worker4:2222", "worker5:2222"]},
                         {"worker": {3: "worker0:2222", 6: "worker1:2222", 7: "worker2:2222"}})
    verify_cluster_spec_equality(union_cluster.cluster_spec(), [
        ("worker", {0: "worker4:2222", 1: "worker5:2222", 3: "worker0:2222",
                    6: "worker1:2222", 7: "worker2:2222"})])


def testRetainSparseJobWithNoMerging():
    base_cluster_spec = ClusterSpec({"worker": {1: "worker0:2222", 3: "worker1:2222",
                                                5: "worker2:2222"}})
    union_cluster = UnionResolver(SimpleClusterResolver(base_cluster_spec))
    verify_cluster_spec_equality(union_cluster.cluster_spec(), [
        ("worker", {1: "worker0:2222", 3: "worker1:2222", 5: "worker2:2222"})])
