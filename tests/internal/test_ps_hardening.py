"""A parameter server that no request can hurt: size limits before allocating, typed
INVALID_ARGUMENT for malformed requests, Save/Restore confined to the checkpoint root,
per-client call caps and deadlines, and a token that never leaks."""

import json
import logging
import os
import struct
import threading
import time

import grpc
import numpy as np
import pytest

from jaxdist._src.ps import protocol
from jaxdist._src.ps.client import PSClient
from jaxdist._src.ps.errors import PSError, PSInvalidArgumentError
from jaxdist._src.ps.server import ParameterServer
from jaxdist._src.ps.service import ParameterService
from jaxdist._src.transport import wire
from jaxdist._src.transport.grpc_util import TOKEN_METADATA_KEY, method_path
from jaxdist._src.transport.limits import ServerLimits, default_max_request_bytes
from jaxdist._src.transport.memory import RECEIVE_POOL

TOKEN = "hardening-Secret-7f3a9c"
MiB = 1 << 20


# Hand-made frames over plaintext loopback, which must be asked for.
pytestmark = pytest.mark.usefixtures("plaintext_on_loopback")


def _serve(checkpoint_dir=None, **limits):
    svc = ParameterService("ps:0", checkpoint_dir=checkpoint_dir)
    kwargs = {"limits": ServerLimits.from_env(**limits)} if limits else {}
    return ParameterServer(svc, "127.0.0.1:0", token=TOKEN, **kwargs).start()


@pytest.fixture
def served(tmp_path):
    server = _serve(str(tmp_path / "root"))
    client = PSClient([server.address], TOKEN, timeout=10)
    client.call(0, "Create", {"specs": {"w": {}}}, {"w": np.zeros(4, np.float32)})
    yield server, client
    client.close()
    server.stop(0)


def _raw_call(address, method, frame, timeout=10.0, token=TOKEN):
    """Sends one hand-made frame; returns (status code, details)."""
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_stream(method_path(protocol.SERVICE_NAME, method, unary=True))
        try:
            list(call(frame, timeout=timeout, metadata=[(TOKEN_METADATA_KEY, token)]))
        except grpc.RpcError as e:
            return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def _frame(meta, specs, payload=b""):
    header = json.dumps({"meta": meta, "arrays": specs}).encode()
    return struct.pack("<4sQQ", wire.MAGIC, len(header), len(payload)) + header + payload


# ---------------------------------------------------------------------- request size
def test_a_header_declaring_20_gib_is_refused_before_allocating(served, monkeypatch):
    server, _ = served
    taken = []
    real = RECEIVE_POOL.take
    monkeypatch.setattr(RECEIVE_POOL, "take", lambda n: (taken.append(n), real(n))[1])
    header = json.dumps({"meta": {"versions": {"w": 0}}, "arrays": []}).encode()
    frame = struct.pack("<4sQQ", wire.MAGIC, len(header), 20 << 30) + header
    code, details = _raw_call(server.address, "Push", frame)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert "21474836480 payload bytes" in details and "max_request_bytes" in details
    assert all(n < MiB for n in taken), taken


def test_the_request_limit_is_configurable_and_counts_every_byte(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDIST_PS_MAX_REQUEST_BYTES", str(2 * MiB))
    server = _serve(max_call_seconds=30.0)
    assert server.limits.max_request_bytes == 2 * MiB
    client = PSClient([server.address], TOKEN, timeout=10)
    try:
        client.call(0, "Create", {"specs": {"w": {}}}, {"w": np.zeros(MiB // 4, np.float32)})
        with pytest.raises(PSError, match=r"RESOURCE_EXHAUSTED.*more than the 2097152"):
            client.call(0, "Create", {"specs": {"x": {}}},
                        {"x": np.zeros(3 * MiB // 4, np.float32)})
        assert "x" not in client.call(0, "Status")[0]["variables"]
    finally:
        client.close()
        server.stop(0)


def test_default_request_limit_allows_the_benchmarks_256_mib_tensors(monkeypatch):
    monkeypatch.delenv("JAXDIST_PS_MAX_REQUEST_BYTES", raising=False)
    assert 288 * MiB <= ServerLimits.from_env().max_request_bytes <= 1 << 30
    assert default_max_request_bytes() >= 256 * MiB + 64
    monkeypatch.setenv("JAXDIST_PS_MAX_REQUEST_BYTES", "lots")
    with pytest.raises(ValueError, match="JAXDIST_PS_MAX_REQUEST_BYTES='lots': expected a "
                                         "positive int"):
        ServerLimits.from_env()


# ---------------------------------------------------------------------- malformed requests
def test_a_push_of_another_dtype_is_invalid_argument(served):
    _, client = served
    with pytest.raises(PSInvalidArgumentError, match="'w' has dtype complex64, the variable "
                                                     "has float32"):
        client.call(0, "Push", {"versions": {"w": 0}},
                    {"w": np.array([1j, 2j, 3j, 4j], np.complex64)})
    assert client.call(0, "Pull", {"keys": ["w"]})[1]["w"].tolist() == [0.0] * 4


def test_negative_and_inconsistent_shapes_are_invalid_argument(served):
    server, _ = served
    payload = np.ones(4, np.float32).tobytes()
    code, details = _raw_call(server.address, "Push", _frame(
        {"versions": {"w": 0}}, [["w", "float32", [-1], 0, 16]], payload))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "bad shape [-1]" in details and "non-negative" in details
    code, details = _raw_call(server.address, "Push", _frame(
        {"versions": {"w": 0}}, [["w", "float32", [8], 0, 16]], payload))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "shape [8] of float32 needs 32 bytes, the header says 16" in details


@pytest.mark.parametrize("chunk", ["abc", -5, 0, 1.5, True, [1]])
def test_bad_chunk_bytes_is_invalid_argument_naming_the_value(served, chunk):
    server, _ = served
    code, details = _raw_call(server.address, "Pull", _frame({"keys": ["w"],
                                                              "chunk_bytes": chunk}, []))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert f"chunk_bytes={chunk!r}: expected a positive integer" in details
    assert "Traceback" not in details


@pytest.mark.parametrize("meta", [{"keys": "w"}, {"keys": [1]}, {}])
def test_malformed_meta_is_invalid_argument(served, meta):
    server, _ = served
    code, details = _raw_call(server.address, "Pull", _frame(meta, []))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "'keys'" in details and "expected a list of variable names" in details


# ---------------------------------------------------------------------- checkpoint root
def test_save_and_restore_are_confined_to_the_checkpoint_root(served, tmp_path):
    _, client = served
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    (root / "escape").parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside, root / "escape")
    for directory in [str(outside), str(root / ".." / "outside"), "../outside",
                      str(root / "escape"), str(tmp_path)]:
        with pytest.raises(PSInvalidArgumentError, match="outside the server's checkpoint "
                                                         "root"):
            client.call(0, "Save", {"directory": directory, "step": 1})
        with pytest.raises(PSInvalidArgumentError, match="outside the server's checkpoint "
                                                         "root"):
            client.call(0, "Restore", {"directory": directory, "step": 1})
    assert os.listdir(outside) == []
    path = client.call(0, "Save", {"directory": str(root / "run1"), "step": 3})[0]["path"]
    assert path == os.path.join(os.path.realpath(root), "run1", "ps-0", "ckpt-3")
    assert client.call(0, "Save", {"directory": None, "step": 4})[0]["path"].startswith(
        os.path.realpath(root))
    assert client.call(0, "Restore", {"directory": "run1", "step": 3})[0]["step"] == 3


def test_a_link_planted_as_the_task_directory_is_refused(served, tmp_path):
    _, client = served
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (tmp_path / "root").mkdir()
    os.symlink(outside, tmp_path / "root" / "ps-0")
    with pytest.raises(PSInvalidArgumentError, match="is a link out of the checkpoint root"):
        client.call(0, "Save", {"directory": None, "step": 1, "keep": 1})
    assert os.listdir(outside) == []


def test_a_server_without_checkpoint_root_refuses_save(tmp_path):
    server = _serve(max_call_seconds=30.0)
    client = PSClient([server.address], TOKEN, timeout=10)
    try:
        with pytest.raises(PSInvalidArgumentError, match="no checkpoint root; start it with "
                                                         "--checkpoint_root or --checkpoint_dir"):
            client.call(0, "Save", {"directory": str(tmp_path), "step": 1})
        assert os.listdir(tmp_path) == []
    finally:
        client.close()
        server.stop(0)


# ---------------------------------------------------------------------- stalled streams
def test_stalled_streams_from_one_client_cannot_starve_another():
    server = _serve(max_call_seconds=3.0)  # 16 handler threads, 8 calls per client
    release = threading.Event()
    calls = []
    try:
        header = json.dumps({"meta": {"versions": {}}, "arrays": []}).encode()
        first = struct.pack("<4sQQ", wire.MAGIC, len(header), 1 << 20) + header

        def stalled():
            yield first
            release.wait(30)  # never sends the rest of the declared megabyte

        attacker = grpc.insecure_channel(server.address)
        push = attacker.stream_stream(method_path(protocol.SERVICE_NAME, "Push"))
        md = [(TOKEN_METADATA_KEY, TOKEN)]
        calls = [push(stalled(), timeout=60, metadata=md) for _ in range(20)]
        # 12 of the 20 streams are refused at once (8 calls per client): then the other 8 hold
        # their handler threads until max_call_seconds.
        deadline = time.monotonic() + 30
        while sum(c.done() for c in calls) < 12 and time.monotonic() < deadline:
            time.sleep(0.05)
        other = PSClient([server.address], TOKEN, timeout=30.0)
        t0 = time.monotonic()
        assert other.call(0, "Ping")[0]["task"] == "ps:0"
        assert other.call(0, "Status")[0]["task"] == "ps:0"
        held = sum(not c.done() for c in calls)  # the stalled streams still holding threads
        codes = []
        for c in calls:
            try:
                list(c)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
        waited = time.monotonic() - t0
        other.close()
    finally:
        release.set()
        for c in calls:
            c.cancel()
        server.stop(0)
    # The other client was served while the attacker's 8 streams still held their threads, not
    # after max_call_seconds freed them.
    assert held == 8, f"another client was served only once {8 - held} stalled streams ended"
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 12, codes
    assert codes.count(grpc.StatusCode.CANCELLED) == 8, codes  # past max_call_seconds
    assert waited < 25, waited  # max_call_seconds (3 s) ended them, not the senders' 30 s


# ---------------------------------------------------------------------- the token
def test_the_token_never_appears_in_errors_logs_or_files(served, tmp_path, caplog, capfd):
    server, client = served
    caplog.set_level(logging.DEBUG)
    messages = []
    for call in [
        lambda: client.call(0, "Push", {"versions": {"w": 0}}, {"w": np.ones(4, np.int32)}),
        lambda: client.call(0, "Pull", {"keys": ["nope"]}),
        lambda: client.call(0, "Save", {"directory": str(tmp_path / "out"), "step": 1}),
        lambda: client.call(0, "Restore", {"directory": None, "step": 99}),
        lambda: PSClient([server.address], TOKEN + "x", timeout=5).call(0, "Ping"),
    ]:
        with pytest.raises(PSError) as e:
            call()
        messages.append(str(e.value))
    for frame in [b"JDW1" + b"\xff" * 16, _frame({"keys": ["w"], "chunk_bytes": "x"}, [])]:
        messages.append(str(_raw_call(server.address, "Pull", frame)))
    client.call(0, "Save", {"directory": None, "step": 2})
    out, err = capfd.readouterr()
    texts = messages + [out, err, caplog.text]
    for dirpath, _, files in os.walk(tmp_path):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                texts.append(f.read().decode("latin-1"))
    assert len(texts) > len(messages) + 3
    for text in texts:
        assert TOKEN not in text


# ---------------------------------------------------------------------- configuration
def test_server_flags_and_arguments_set_the_limits(monkeypatch, capsys):
    from jaxdist.server import Server, main

    cluster = {"ps": ["127.0.0.1:0"], "worker": ["127.0.0.1:1"]}
    server = Server(cluster, job_name="ps", task_index=0, token=TOKEN,
                    limits=ServerLimits(max_request_bytes=3 * MiB, max_call_seconds=7.0,
                                        max_calls_per_client=2))
    try:
        assert server._server.limits == ServerLimits(3 * MiB, 7.0, 2)
    finally:
        server.stop()
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "token": TOKEN,
                                                "task": {"type": "ps", "index": 0}}))
    root = Server(cluster, job_name="ps", task_index=0, token=TOKEN, start=False,
                  checkpoint_root="/some/root")
    assert root.service.checkpoint_root == "/some/root" and root.service.checkpoint_dir is None
    assert main(["--max_calls_per_client", "0"]) == 2
    assert "max_calls_per_client=0: expected a positive number" in capsys.readouterr().err


def test_clock_requests_are_bounded(served):
    server, client = served
    code, details = _raw_call(server.address, "Clock", _frame(
        {"worker": 0, "clock": 1, "num_workers": 10**9, "wait_s": 0.0}, []))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "'num_workers' is '1000000000': expected an integer in [1, 65536]" in details
    code, details = _raw_call(server.address, "Clock", _frame(
        {"worker": 0, "clock": 1, "num_workers": 2, "wait_s": float("nan")}, []))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "'wait_s'" in details, details
    server.service.max_wait_seconds = 0.5  # as ServerLimits(max_call_seconds=0.5) sets it
    t0 = time.monotonic()
    meta, _ = client.call(0, "Clock", {"worker": 0, "clock": 5, "num_workers": 2,
                                       "max_staleness": 0, "wait_s": 60.0})
    assert meta["ok"] is False and time.monotonic() - t0 < 30  # max_wait_seconds, not 60 s
