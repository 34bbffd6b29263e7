"""A request that names a variable twice is refused before anything is applied (issue 34),
on both transports: two arrays of one name, one key twice in a header object, one
variable twice in a pull's ``keys``. Each request is built by hand (a real client never sends
one) and sent to a real ps server."""

import json
import struct
import time

import grpc
import numpy as np
import pytest

from jaxdist._src.ps import protocol
from jaxdist._src.ps.client import PSClient
from jaxdist._src.ps.errors import PSInvalidArgumentError
from jaxdist._src.ps.server import ParameterServer
from jaxdist._src.ps.service import ParameterService
from jaxdist._src.transport import direct, wire
from jaxdist._src.transport.grpc_util import TOKEN_METADATA_KEY, method_path

TOKEN = "duplicate-names-Secret-7d1e"


# Hand-made frames over plaintext loopback, which must be asked for.
pytestmark = pytest.mark.usefixtures("plaintext_on_loopback")


@pytest.fixture
def served():
    server = ParameterServer(ParameterService("ps:0"), "127.0.0.1:0", token=TOKEN).start()
    client = PSClient([server.address], TOKEN, timeout=10)
    client.call(0, "Create", {"specs": {"w": {}, "v": {}}},
                {"w": np.zeros(4, np.float32), "v": np.zeros(4, np.float32)})
    yield server, client
    client.close()
    server.stop(0)


ONE, TWO = np.ones(4, np.float32).tobytes(), np.full(4, 2.0, np.float32).tobytes()
# Two gradients for "w": at offsets 0 and 64 (arrays start 64-byte aligned).
TWO_ARRAYS = ('[["w", "float32", [4], 0, 16], ["v", "float32", [4], 64, 16], '
              '["w", "float32", [4], 128, 16]]', ONE + bytes(48) + ONE + bytes(48) + TWO)
ONE_ARRAY = ('[["w", "float32", [4], 0, 16]]', ONE)


def _requests():
    """(method, meta text, (arrays text, payload), the name the refusal must give)."""
    return [
        ("Push", '{"versions": {"w": 0, "v": 0}}', TWO_ARRAYS, "array 'w' appears twice"),
        ("Push", '{"versions": {"w": 0, "w": 5}}', ONE_ARRAY, "key 'w' appears twice"),
        ("Assign", '{}', TWO_ARRAYS, "array 'w' appears twice"),
        ("Pull", '{"keys": ["v", "w", "w"]}', ("[]", b""), "variable 'w' twice"),
    ]


def _grpc_frame(meta: str, arrays: str, payload: bytes) -> bytes:
    header = f'{{"meta": {meta}, "arrays": {arrays}}}'.encode()
    return struct.pack("<4sQQ", wire.MAGIC, len(header), len(payload)) + header + payload


def _grpc_call(address, method, frame):
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_stream(method_path(protocol.SERVICE_NAME, method, unary=True))
        try:
            list(call(frame, timeout=10, metadata=[(TOKEN_METADATA_KEY, TOKEN)]))
        except grpc.RpcError as e:
            return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def _direct_call(client, method, meta, arrays, payload):
    """One hand-built frame over an authenticated direct connection of ``client``."""
    pool = client._direct
    deadline = time.monotonic() + 10
    conn = pool._open(0, {}, deadline)
    try:
        head = f'{{"method": "{method}", "meta": {meta}, "arrays": {arrays}}}'.encode()
        conn.sock.sendall(direct.PREFIX.pack(direct.REQUEST, len(head), len(payload)) + head
                          + payload)
        header, _ = direct.recv_frame(conn.sock, direct.RESPONSE, direct.MAX_HEADER_BYTES,
                                      None, deadline)
    finally:
        conn.close()
    return header.get("code"), header.get("details", "")


def _state(client):
    meta, arrays = client.call(0, "Pull", {"keys": ["w", "v"]})
    return meta["versions"], arrays["w"].tolist(), arrays["v"].tolist()


UNCHANGED = ({"w": 0, "v": 0}, [0.0] * 4, [0.0] * 4)


@pytest.mark.parametrize("index", range(4), ids=[r[0] + "-" + r[3].split()[0]
                                                 for r in _requests()])
def test_grpc_refuses_a_request_naming_a_variable_twice(served, index):
    server, client = served
    method, meta, (arrays, payload), named = _requests()[index]
    code, details = _grpc_call(server.address, method, _grpc_frame(meta, arrays, payload))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert named in details, details
    assert _state(client) == UNCHANGED  # neither update applied, nor the other variable's


@pytest.mark.parametrize("index", range(4), ids=[r[0] + "-" + r[3].split()[0]
                                                 for r in _requests()])
def test_the_direct_port_refuses_a_request_naming_a_variable_twice(served, index):
    _, client = served
    client.call(0, "Status")  # over the direct port: it is there
    assert client.direct_calls >= 1
    method, meta, (arrays, payload), named = _requests()[index]
    code, details = _direct_call(client, method, meta, arrays, payload)
    assert code == "INVALID_ARGUMENT", (code, details)
    assert named in details, details
    assert _state(client) == UNCHANGED


def test_the_client_gets_a_typed_error_naming_the_variable(served):
    _, client = served
    with pytest.raises(PSInvalidArgumentError, match="names variable 'w' twice"):
        client.call(0, "Pull", {"keys": ["w", "w"]})


def test_the_same_frames_with_each_name_once_are_applied(served):
    """The hand-built frames are right apart from the duplicate: the tests above can fail."""
    server, client = served
    arrays = '[["w", "float32", [4], 0, 16], ["v", "float32", [4], 64, 16]]'
    frame = _grpc_frame('{"versions": {"w": 0, "v": 0}}', arrays, ONE + bytes(48) + TWO)
    assert _grpc_call(server.address, "Push", frame) == (grpc.StatusCode.OK, "")
    code, _ = _direct_call(client, "Push", '{"versions": {"w": 1, "v": 1}}', arrays,
                           ONE + bytes(48) + TWO)
    assert code == "OK"
    assert _state(client) == ({"w": 2, "v": 2}, [2.0] * 4, [4.0] * 4)


def test_a_header_key_given_twice_is_a_wire_error():
    with pytest.raises(wire.WireError, match="key 'a' appears twice"):
        wire.loads_header(b'{"meta": {"x": {"a": 1, "b": 2, "a": 3}}}')
    assert wire.loads_header(json.dumps({"a": {"a": 1}}).encode()) == {"a": {"a": 1}}
