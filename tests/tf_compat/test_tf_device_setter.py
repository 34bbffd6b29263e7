"""Port of TensorFlow's tensorflow/python/training/device_setter_test.py onto jaxdist.

TF builds graph ops under ``with tf.device(replica_device_setter(...))`` and reads
``op.device``. jaxdist's device function is called with a ``VariableSpec`` for each op, in the
order TF would create them: ``device=`` is what the enclosing ``tf.device`` scopes set
(innermost field wins) and ``op_type=`` the TF op type (non-variable ops such as ``v + w`` go
to ``worker_device``). TF's inputs and expected device strings are kept;
``assertDeviceEqual`` compares canonical forms, and every string jaxdist returns must already
be in TF's canonical ``DeviceSpec.to_string()`` form. A variable's ``initializer`` is placed
like the variable in TF; jaxdist has no initializer op, so those asserts collapse onto the
variable's.
"""

import re

import pytest

from jaxdist.cluster_resolver import ClusterSpec
from jaxdist.ps import VariableSpec, replica_device_setter

_CLUSTER_SPEC = ClusterSpec({
    "ps": ["ps0:2222", "ps1:2222"],
    "worker": ["worker0:2222", "worker1:2222", "worker2:2222"],
})

_FIELD = re.compile(r"^(job|replica|task):(.+)$")


def _canonical(device: str) -> str:
    """TF's canonical device name (``pydev.canonical_name``), written independently here."""
    fields: dict[str, str] = {}
    for part in filter(None, device.split("/")):
        m = _FIELD.match(part)
        if m:
            fields[m.group(1)] = m.group(2)
            continue
        bits = part.split(":")
        if bits[0].lower() == "device":
            bits = bits[1:]
        fields["device"] = f"{bits[0].upper()}:{bits[1]}"
    out = "".join(f"/{k}:{fields[k]}" for k in ("job", "replica", "task") if k in fields)
    if "device" in fields:
        out += "/device:" + fields["device"]
    return out


def assert_device_equal(expected: str, got: str) -> None:
    """TF's ``assertDeviceEqual``, plus: jaxdist returns the canonical form itself."""
    assert _canonical(got) == _canonical(expected), (expected, got)
    assert got == _canonical(got), f"{got!r} is not in TF's canonical form"


def _var(name, device=""):
    return VariableSpec(name, (2,), "int32", device=device)


def _add(device=""):
    return VariableSpec("add", (2,), "int32", device=device, op_type="AddV2")


def testCPUOverride():
    setter = replica_device_setter(cluster=_CLUSTER_SPEC)
    v = setter(_var("v", device="/cpu:0"))
    w = setter(_var("w"))
    a = setter(_add(device="/cpu:0"))
    assert_device_equal("/job:ps/task:0/cpu:0", v)
    assert_device_equal("/job:ps/task:1", w)
    assert_device_equal("/job:worker/cpu:0", a)


def testResource():
    setter = replica_device_setter(cluster=_CLUSTER_SPEC)
    v = setter(_var("v"))  # a ResourceVariable is a VarHandleOp
    assert_device_equal("/job:ps/task:0", v)


def testPS2TasksWithClusterSpecClass():
    setter = replica_device_setter(cluster=_CLUSTER_SPEC)
    v = setter(_var("v"))
    w = setter(_var("w"))
    a = setter(_add())
    assert_device_equal("/job:ps/task:0", v)
    assert_device_equal("/job:ps/task:1", w)
    assert_device_equal("/job:worker", a)


def testPS2TasksPinVariableToJob():
    setter = replica_device_setter(cluster=_CLUSTER_SPEC)
    v = setter(_var("v"))
    w = setter(_var("w", device="/job:moon"))
    x = setter(_var("x", device="/job:ps"))  # Explicit PS job will get task set.
    a = setter(_add())
    assert_device_equal("/job:ps/task:0", v)
    assert_device_equal("/job:moon", w)
    assert_device_equal("/job:ps/task:1", x)
    assert_device_equal("/job:worker", a)


def testPS2TasksUseCpuForPS():
    setter = replica_device_setter(ps_tasks=1, ps_device="/cpu:0")
    v = setter(_var("v"))
    w = setter(_var("w", device="/job:moon"))
    a = setter(_add())
    assert_device_equal("/cpu:0", v)
    assert_device_equal("/job:moon/cpu:0", w)
    assert_device_equal("/job:worker", a)


def testPS2TasksNoMerging():
    setter = replica_device_setter(cluster=_CLUSTER_SPEC, merge_devices=False)
    v = setter(_var("v"))
    w = setter(_var("w", device="/job:ps"))  # Won't assign task when merge_devices=False.
    a = setter(_add())
    assert_device_equal("/job:ps/task:0", v)
    assert_device_equal("/job:ps", w)
    assert_device_equal("/job:worker", a)


def testPS2TasksWithClusterSpecDict():
    setter = replica_device_setter(cluster=_CLUSTER_SPEC.as_dict())
    v = setter(_var("v"))
    w = setter(_var("w"))
    a = setter(_add())
    assert_device_equal("/job:ps/task:0", v)
    assert_device_equal("/job:ps/task:1", w)
    assert_device_equal("/job:worker", a)


def testPS2TasksWithClusterDef():
    setter = replica_device_setter(cluster=_CLUSTER_SPEC.as_cluster_def())
    v = setter(_var("v"))
    w = setter(_var("w"))
    a = setter(_add())
    assert_device_equal("/job:ps/task:0", v)
    assert_device_equal("/job:ps/task:1", w)
    assert_device_equal("/job:worker", a)


def testPS2TasksWithDevice():
    cluster_spec = ClusterSpec({
        "sun": ["sun0:2222", "sun1:2222", "sun2:2222"],
        "moon": ["moon0:2222", "moon1:2222"],
    })
    setter = replica_device_setter(ps_device="/job:moon", worker_device="/job:sun",
                                   cluster=cluster_spec.as_cluster_def())
    v = setter(_var("v"))
    w = setter(_var("w"))
    a = setter(_add())
    assert_device_equal("/job:moon/task:0", v)
    assert_device_equal("/job:moon/task:1", w)
    assert_device_equal("/job:sun", a)


def testPS2TasksWithCPUConstraint():
    cluster_spec = ClusterSpec({
        "sun": ["sun0:2222", "sun1:2222", "sun2:2222"],
        "moon": ["moon0:2222", "moon1:2222"],
    })
    setter = replica_device_setter(ps_device="/job:moon/cpu:0", worker_device="/job:sun",
                                   cluster=cluster_spec.as_cluster_def())
    v = setter(_var("v"))
    w = setter(_var("w"))
    a = setter(_add())
    assert_device_equal("/job:moon/task:0/cpu:0", v)
    assert_device_equal("/job:moon/task:1/cpu:0", w)
    assert_device_equal("/job:sun", a)


# jaxdist-only checks of the same semantics (not in TF's file).


def test_ps_tasks_follow_the_ps_job_size():
    """ps_tasks is the size of the job ps_device names: 2 moon tasks -> round robin over 2."""
    cluster_spec = ClusterSpec({"sun": ["s:1", "s:2", "s:3"], "moon": ["m:1", "m:2"]})
    setter = replica_device_setter(ps_device="/job:moon", cluster=cluster_spec)
    assert [setter(_var(f"v{i}")) for i in range(3)] == [
        "/job:moon/task:0", "/job:moon/task:1", "/job:moon/task:0"]


def test_ps_job_missing_from_cluster_is_an_error():
    """TF returns None (no device function); jaxdist says which job is missing."""
    with pytest.raises(ValueError, match="'moon'"):
        replica_device_setter(ps_device="/job:moon", cluster=_CLUSTER_SPEC)


def test_malformed_device_is_an_error():
    setter = replica_device_setter(ps_tasks=1)
    with pytest.raises(ValueError, match="cannot parse device"):
        setter(_var("v", device="/job:ps/task:x"))
