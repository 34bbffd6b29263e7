"""Smaller holes a token holder or a local user could use (issue 27, point 5), each attacked:
checkpoint links below the task directory, unbounded integers on the wire, paths deep enough
to exhaust recursion, and one task listed twice in TF_CONFIG under two spellings."""

import json
import os
import shutil
import struct

import grpc
import numpy as np
import pytest

from jaxdist._src.cluster.errors import TFConfigError
from jaxdist._src.cluster.tf_config import TFConfigClusterResolver, canonical_address
from jaxdist._src.ps import protocol
from jaxdist._src.ps.client import PSClient
from jaxdist._src.ps.errors import PSInvalidArgumentError, PSNotFoundError
from jaxdist._src.ps.server import ParameterServer
from jaxdist._src.ps.service import ParameterService
from jaxdist._src.transport import wire
from jaxdist._src.transport.grpc_util import TOKEN_METADATA_KEY, method_path

TOKEN = "small-holes-Secret-41c2"


# Hand-made frames over plaintext loopback, which must be asked for.
pytestmark = pytest.mark.usefixtures("plaintext_on_loopback")


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    server = ParameterServer(ParameterService("ps:0", checkpoint_dir=str(root)), "127.0.0.1:0",
                             token=TOKEN).start()
    client = PSClient([server.address], TOKEN, timeout=10)
    client.call(0, "Create", {"specs": {"w": {}}}, {"w": np.zeros(4, np.float32)})
    yield server, client, root
    client.close()
    server.stop(0)


def _raw_call(address, method, frame, timeout=10.0):
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_stream(method_path(protocol.SERVICE_NAME, method, unary=True))
        try:
            list(call(frame, timeout=timeout, metadata=[(TOKEN_METADATA_KEY, TOKEN)]))
        except grpc.RpcError as e:
            return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def _frame(header_text: str, payload: bytes = b"") -> bytes:
    header = header_text.encode()
    return struct.pack("<4sQQ", wire.MAGIC, len(header), len(payload)) + header + payload


def _version(client) -> int:
    return client.call(0, "Pull", {"keys": ["w"]})[0]["versions"]["w"]


# ---------------------------------------------------------------------- checkpoint links
def _outside_checkpoint(client, root, tmp_path, step=1):
    """A genuine checkpoint copied outside the root (what a planted link would point to)."""
    client.call(0, "Push", {"versions": {"w": 0}}, {"w": np.full(4, 7.0, np.float32)})
    client.call(0, "Save", {"directory": None, "step": step})
    outside = tmp_path / "outside"
    shutil.copytree(root / "ps-0" / f"ckpt-{step}", outside)
    return outside


def test_restore_refuses_a_ckpt_link_out_of_the_root(served, tmp_path):
    _, client, root = served
    outside = _outside_checkpoint(client, root, tmp_path)
    os.symlink(outside, root / "ps-0" / "ckpt-7")
    with pytest.raises(PSInvalidArgumentError, match=r"ckpt-7'.*is a symbolic link"):
        client.call(0, "Restore", {"directory": None, "step": 7})
    assert client.call(0, "Status")[0]["restored_step"] is None


def test_restore_refuses_a_link_inside_the_root_too(served, tmp_path):
    """Links below the task directory are refused even when they stay under the root."""
    _, client, root = served
    _outside_checkpoint(client, root, tmp_path)
    os.symlink(root / "ps-0" / "ckpt-1", root / "ps-0" / "ckpt-8")
    os.mkdir(root / "ps-0" / "ckpt-9")
    os.symlink(root / "ps-0" / "ckpt-1" / "state.jdw", root / "ps-0" / "ckpt-9" / "state.jdw")
    for step, what in ((8, "ckpt-8"), (9, "state.jdw")):
        with pytest.raises(PSInvalidArgumentError, match=rf"{what}'.*is a symbolic link"):
            client.call(0, "Restore", {"directory": None, "step": step})
    assert client.call(0, "Restore", {"directory": None, "step": 1})[0]["step"] == 1


def test_restore_refuses_a_fifo_instead_of_waiting_on_it(served):
    _, client, root = served
    os.makedirs(root / "ps-0" / "ckpt-3")
    os.mkfifo(root / "ps-0" / "ckpt-3" / "state.jdw")
    with pytest.raises(PSInvalidArgumentError, match="not a regular file"):
        client.call(0, "Restore", {"directory": None, "step": 3})  # client timeout: 10 s


def test_a_link_as_latest_pointer_is_not_followed(served, tmp_path):
    _, client, root = served
    _outside_checkpoint(client, root, tmp_path, step=2)
    (tmp_path / "fake-latest").write_text(json.dumps({"step": 2}))
    os.unlink(root / "ps-0" / "latest")
    os.symlink(tmp_path / "fake-latest", root / "ps-0" / "latest")
    with pytest.raises(PSNotFoundError, match="no checkpoint under") as e:
        client.call(0, "Restore", {"directory": None})
    assert "fake-latest" not in str(e.value)


def test_save_replaces_a_planted_ckpt_link_without_touching_its_target(served, tmp_path):
    _, client, root = served
    outside = tmp_path / "victim"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    os.makedirs(root / "ps-0", exist_ok=True)
    os.symlink(outside, root / "ps-0" / "ckpt-5")
    client.call(0, "Save", {"directory": None, "step": 5})
    assert not os.path.islink(root / "ps-0" / "ckpt-5")
    assert os.listdir(outside) == ["keep.txt"]
    assert client.call(0, "Restore", {"directory": None, "step": 5})[0]["step"] == 5


# ---------------------------------------------------------------------- integers on the wire
@pytest.mark.parametrize("version", ["1" + "0" * 4000, str(2**63), str(-(2**63) - 1)])
def test_a_push_with_an_integer_past_64_bits_is_invalid_argument(served, version):
    server, client, _ = served
    payload = np.ones(4, np.float32).tobytes()
    code, details = _raw_call(server.address, "Push", _frame(
        f'{{"meta": {{"versions": {{"w": {version}}}}}, '
        f'"arrays": [["w", "float32", [4], 0, 16]]}}', payload))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "does not fit a signed 64-bit integer" in details
    assert len(details) < 400, details
    assert _version(client) == 0


def test_the_direct_transport_bounds_integers_too(served):
    _, client, _ = served
    with pytest.raises(PSInvalidArgumentError, match="does not fit a signed 64-bit integer"):
        client.call(0, "Push", {"versions": {"w": 10**4000}}, {"w": np.ones(4, np.float32)})
    assert _version(client) == 0


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_are_invalid_argument(served, number):
    server, client, _ = served
    code, details = _raw_call(server.address, "LearningRate", _frame(
        f'{{"meta": {{"value": {number}}}, "arrays": []}}'))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "'value'" in details and "expected a number in [0, 1e+06]" in details


def test_int64_bounds_themselves_still_pass():
    header = {"meta": {"a": 2**63 - 1, "b": -(2**63), "c": 1.5}, "arrays": []}
    assert wire.loads_header(json.dumps(header).encode()) == header


# ---------------------------------------------------------------------- deep paths
@pytest.mark.parametrize("method", ["Save", "Restore"])
def test_a_path_deep_enough_to_exhaust_recursion_is_invalid_argument(served, method):
    _, client, root = served
    with pytest.raises(PSInvalidArgumentError, match=r"it has 6000 characters, more than 1024"):
        client.call(0, method, {"directory": "a/" * 3000, "step": 1})
    with pytest.raises(PSInvalidArgumentError, match=r"it has 300 path components, more than "
                                                     r"64"):
        client.call(0, method, {"directory": "a/" * 300, "step": 1})
    with pytest.raises(PSInvalidArgumentError, match="NUL byte"):
        client.call(0, method, {"directory": "a\0b", "step": 1})
    assert os.listdir(root) in ([], ["ps-0"])


# ---------------------------------------------------------------------- TF_CONFIG spellings
@pytest.mark.parametrize("first,second", [
    ("localhost:2222", "127.0.0.1:2222"),
    ("[::1]:2222", "[0:0:0:0:0:0:0:1]:2222"),
    ("127.0.0.1:2222", "127.1:2222"),
    ("127.0.0.1:2222", "[::ffff:127.0.0.1]:2222"),
    ("Host.example:2222", "host.example.:2222"),
    ("[FE80::1]:2222", "[fe80:0::1]:2222"),
])
def test_one_task_under_two_spellings_is_refused(first, second):
    raw = json.dumps({"cluster": {"chief": [first], "worker": [second]},
                      "task": {"type": "chief", "index": 0}})
    with pytest.raises(TFConfigError) as e:
        TFConfigClusterResolver(tf_config=raw).cluster_spec()
    assert e.value.key == '"cluster"."worker"[0]'
    assert 'the same address as "cluster"."chief"[0]' in str(e.value)
    assert canonical_address(first) == canonical_address(second)


@pytest.mark.parametrize("first,second", [
    ("127.0.0.1:2222", "[::1]:2222"),  # two address families: two sockets
    ("127.0.0.1:2222", "127.0.0.2:2222"),
    ("localhost:2222", "localhost:2223"),
    ("cafe:2222", "0xcafe:2222"),
])
def test_different_sockets_are_still_accepted(first, second):
    raw = json.dumps({"cluster": {"chief": [first], "worker": [second]},
                      "task": {"type": "chief", "index": 0}})
    spec = TFConfigClusterResolver(tf_config=raw).cluster_spec()
    assert spec.job_tasks("worker") == [second]
