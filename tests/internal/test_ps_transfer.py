"""The bulk-transfer path: single-copy chunking, recycled receive buffers, in-place updates, and
large pulls/pushes through a real in-process gRPC server (bit-exact, token checked)."""

import gc

import ml_dtypes
import numpy as np
import pytest
from devutil import cpu_devices

from jaxdist._src.ps.client import PSClient
from jaxdist._src.ps.errors import PSAuthenticationError, PSInvalidArgumentError
from jaxdist._src.ps.server import ParameterServer
from jaxdist._src.ps.service import ParameterService
from jaxdist._src.transport import wire
from jaxdist._src.transport.memory import BufferPool
from jaxdist.testing.tls import process_pki

MiB = 1 << 20


@pytest.mark.parametrize("chunk", [1, 100, 4096, MiB])
def test_chunks_never_exceed_the_limit_and_round_trip(chunk):
    rng = np.random.default_rng(0)
    # three full chunks and a partial one at least (1-byte chunks of 3 MiB would be 3 million
    # Python objects: seconds of CPU for nothing the smaller array misses)
    big = 3 * max(chunk, 64 << 10) + 17
    arrays = {
        "big": rng.integers(0, 256, big, dtype=np.uint8),
        "small": np.arange(5, dtype=ml_dtypes.bfloat16),
        "empty": np.zeros((0, 3), np.float32),
        "f": rng.normal(size=(300, 7)),
    }
    chunks = list(wire.encode({"a": 1}, arrays, chunk_bytes=chunk))
    header = len(chunks[0]) if chunk < 1000 else 0  # a header longer than a chunk goes alone
    assert all(len(c) <= max(chunk, header) for c in chunks)
    assert all(isinstance(c, bytes) for c in chunks)
    meta, out = wire.decode(chunks)
    assert meta == {"a": 1}
    for k, x in arrays.items():
        assert out[k].dtype == x.dtype and out[k].shape == x.shape
        assert out[k].tobytes() == x.tobytes()


def test_large_array_chunks_are_full_size():
    x = np.arange(4 * MiB, dtype=np.uint8)
    chunks = list(wire.encode({}, {"x": x}, chunk_bytes=MiB))
    assert [len(c) for c in chunks[:-1]] == [MiB] * (len(chunks) - 1)


def test_pool_never_hands_out_a_buffer_in_use():
    pool = BufferPool(min_bytes=16)
    a = pool.take(1024)
    view = a[8:24].view(np.float32)
    a_addr = a.ctypes.data
    del a
    b = pool.take(1024)
    assert b.ctypes.data != a_addr  # ``view`` still uses a
    b_addr = b.ctypes.data
    del b
    assert pool.take(1024).ctypes.data == b_addr  # b is free again: recycled
    del view
    gc.collect()
    assert pool.take(1024).ctypes.data == a_addr


def test_decoded_arrays_are_aligned_for_zero_copy_jax():
    import jax

    arrays = {"a": np.arange(3, dtype=np.int8), "b": np.arange(1000, dtype=np.float32),
              "c": np.ones((7, 5), np.float64), "d": np.arange(5, dtype=np.float16)}
    for pool in (None, BufferPool(min_bytes=16)):
        _, out = wire.decode(list(wire.encode({}, arrays, chunk_bytes=256)), pool)
        for k, x in arrays.items():
            assert out[k].ctypes.data % 64 == 0, k
            np.testing.assert_array_equal(out[k], x)
    on_cpu = jax.device_put(out["b"], cpu_devices(1)[0])  # zero copy is a host-CPU property
    assert on_cpu.unsafe_buffer_pointer() == out["b"].ctypes.data  # no copy


def test_pool_decoded_arrays_keep_their_buffer():
    pool = BufferPool(min_bytes=16)
    x = np.arange(1000, dtype=np.float32)
    _, first = wire.decode(wire.encode({}, {"x": x}), pool)
    _, second = wire.decode(wire.encode({}, {"x": x + 1}), pool)
    np.testing.assert_array_equal(first["x"], x)
    np.testing.assert_array_equal(second["x"], x + 1)
    assert first["x"].flags.writeable


def test_pool_small_buffers_are_not_tracked_and_free_bytes_are_bounded():
    pool = BufferPool(min_bytes=1024, max_free_bytes=4096, max_buffers=4)
    assert pool.take(10).nbytes == 10 and not pool._bufs
    for n in (2048, 2048 + 1, 2048 + 2, 2048 + 3, 2048 + 4):
        pool.take(n)
    assert len(pool._bufs) <= 4
    assert sum(b.nbytes for b in pool._bufs) <= 4096 + 2048 + 4


@pytest.mark.parametrize("spec", [None, "sgd", "adam"])
def test_updates_run_in_place_but_never_under_a_pull_in_flight(spec):
    """Updates donate the old value (same buffer) unless a pull still holds it."""
    from jaxdist._src.ps import optimizers as O

    opt = {None: None, "sgd": O.sgd(1.0), "adam": O.adam(0.1)}[spec]
    svc = ParameterService("ps:0")
    svc.create({"w": np.ones(4096, np.float32)},
               {"w": {"optimizer": opt.to_json() if opt else None}})
    g = np.full(4096, 2.0, np.float32)
    svc.push({"w": g}, {"w": 0})                       # the value becomes a jax array
    (held, _), = svc.pull(["w"]).values()              # a pull in flight
    before = held.copy()
    for v in (1, 2):
        svc.push({"w": g}, {"w": v})
    np.testing.assert_array_equal(held, before)        # never written under the pull
    del held
    (now, version), = svc.pull(["w"]).values()
    addr = now.ctypes.data
    del now
    svc.push({"w": g}, {"w": 3})
    (after, version2), = svc.pull(["w"]).values()
    assert version2 == version + 1 == 4
    assert after.ctypes.data == addr                   # nothing held: updated in place
    if spec is None:
        np.testing.assert_array_equal(after, np.full(4096, 9.0, np.float32))


def test_a_push_of_another_dtype_is_rejected_never_cast():
    svc = ParameterService("ps:0")
    svc.create({"h": np.ones(8, np.float16), "r": np.ones(2, np.float32)}, {})
    with pytest.raises(PSInvalidArgumentError, match="'h' has dtype float32, the variable "
                                                     "has float16; cast it to float16"):
        svc.push({"h": np.full(8, 0.5, np.float32)}, {"h": 0})
    with pytest.raises(PSInvalidArgumentError, match="'r' has dtype complex64"):
        svc.push({"r": np.array([1 + 2j, 3j], np.complex64)}, {"r": 0})
    svc.push({"h": np.full(8, 0.5, np.float16)}, {"h": 0})
    (h, version), = svc.pull(["h"]).values()
    assert h.dtype == np.float16 and h.tolist() == [1.5] * 8 and version == 1


@pytest.fixture()
def served():
    pki = process_pki()
    server = ParameterServer(ParameterService("ps:0"), "127.0.0.1:0", token="t0k",
                             tls=pki.identities["task"]).start()
    client = PSClient([server.address], "t0k", timeout=30, tls=pki.identities["client"])
    yield server, client
    client.close()
    server.stop(0)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # NaN bit patterns
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int8, np.complex64])
def test_large_pull_and_push_are_bit_exact(served, dtype):
    _, client = served
    rng = np.random.default_rng(3)
    n = (5 * MiB + 3) // np.dtype(dtype).itemsize
    x = rng.integers(0, 256, n * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)
    client.call(0, "Create", {"specs": {"x": {}}}, {"x": x})
    for _ in range(3):  # recycled buffers must not mix up successive pulls
        _, got = client.call(0, "Pull", {"keys": ["x"]})
        assert got["x"].dtype == x.dtype and got["x"].tobytes() == x.tobytes()
    if np.dtype(dtype).kind == "f":
        g = np.ones(n, dtype)
        kept = client.call(0, "Pull", {"keys": ["x"]})[1]["x"]
        client.call(0, "Push", {"versions": {"x": 0}}, {"x": g})
        _, got = client.call(0, "Pull", {"keys": ["x"]})
        with np.errstate(all="ignore"):  # random bit patterns include NaN and inf
            assert got["x"].tobytes() == (x + g).tobytes()
        assert kept.tobytes() == x.tobytes()  # an earlier pull's array is not overwritten


def test_large_calls_still_check_the_token(served):
    server, _ = served
    bad = PSClient([server.address], "wrong", timeout=10, tls=process_pki().identities["client"])
    try:
        with pytest.raises(PSAuthenticationError, match="ps:0"):
            bad.call(0, "Push", {"versions": {}}, {"x": np.ones(2 * MiB, np.uint8)})
    finally:
        bad.close()


def test_servers_refuse_to_start_without_a_token():
    from jaxdist._src.ps.server import ParameterServer
    from jaxdist._src.ps.service import ParameterService
    from jaxdist._src.transport.grpc_util import require_token

    with pytest.raises(ValueError, match="ps:3: needs the cluster token"):
        ParameterServer(ParameterService("ps:3"), "127.0.0.1:0", token=None)
    with pytest.raises(ValueError, match="not host:port"):
        ParameterServer(ParameterService("ps:3"), "localhost", token="t", tls="insecure")
    assert require_token("t", "ps:0", "x") == b"t"


def test_one_chunk_requests_go_unary_and_longer_ones_stream(served):
    server, _ = served
    client = PSClient([server.address], "t0k", timeout=30, chunk_bytes=1 << 16,
                      tls=process_pki().identities["client"], direct_transport=False)
    try:
        x = np.arange(100_000, dtype=np.float32)  # 400 kB: 7 chunks of 64 KiB
        client.call(0, "Create", {"specs": {"x": {}}}, {"x": x})
        _, got = client.call(0, "Pull", {"keys": ["x"]})
        assert got["x"].tobytes() == x.tobytes()
        paths = {(method, unary) for _, method, unary in client._stubs._stubs}
        assert paths == {("Create", False), ("Pull", True)}
    finally:
        client.close()


@pytest.mark.parametrize("path", ["/jaxdist.ps.ParameterService/Ping",
                                  "/jaxdist.ps.ParameterService.Unary/Ping"])
def test_both_request_paths_refuse_calls_without_the_token(served, path):
    import grpc

    server, _ = served
    client_tls = process_pki().identities["client"]
    with grpc.secure_channel(server.address, client_tls.channel_credentials()) as channel:
        request = next(wire.encode({}))
        if path.endswith(".Unary/Ping"):
            call = channel.unary_stream(path)(request, timeout=10)
        else:
            call = channel.stream_stream(path)(iter([request]), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "no cluster token" in err.value.details()
