"""Fuzzing the ps wire decoder (hypothesis, bounded): any bytes either decode or raise
``WireError``, and the decoder never allocates more than the receiver's limit allows."""

import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxdist._src.transport import wire

MAX_BYTES = 1 << 16
FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
DTYPES = ["float32", "int8", "complex64", "bfloat16", "bool", "int4", "float64", "uint16"]


@pytest.fixture
def allocations(monkeypatch):
    """Records the byte count of every payload buffer the decoder allocates."""
    sizes = []
    real = wire.aligned_empty

    def recording(nbytes):
        sizes.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr(wire, "aligned_empty", recording)
    return sizes


def _decode_or_wire_error(chunks):
    try:
        meta, arrays = wire.decode(chunks, max_bytes=MAX_BYTES)
    except wire.WireError:
        return None
    assert isinstance(meta, dict)
    for a in arrays.values():
        assert isinstance(a, np.ndarray) and a.dtype.kind not in "OUS"
        assert a.dtype.fields is None and a.dtype.subdtype is None
        assert all(d >= 0 for d in a.shape)
    return meta, arrays


@st.composite
def messages(draw):
    n = draw(st.integers(0, 3))
    arrays = {}
    for i in range(n):
        dt = np.dtype(wire.dtype_from_name(draw(st.sampled_from(DTYPES))))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        raw = draw(st.binary(min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
        arrays[f"a{i}"] = np.frombuffer(raw, np.uint8).astype(dt).reshape(shape)
    # Valid messages carry integers of the wire's range: signed 64-bit (larger ones are
    # refused, tests/test_security_small_holes.py).
    meta = draw(st.dictionaries(st.text(max_size=5),
                                st.integers(-2**63, 2**63 - 1) | st.text(max_size=5),
                                max_size=3))
    chunk = draw(st.integers(1, 64))
    return meta, arrays, list(wire.encode(meta, arrays, chunk_bytes=chunk))


@FUZZ
@given(st.lists(st.binary(max_size=200), min_size=0, max_size=4))
def test_arbitrary_bytes_decode_or_raise_wire_error(chunks):
    _decode_or_wire_error(chunks)


@FUZZ
@given(st.binary(max_size=120), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_any_declared_sizes_never_allocate_past_the_limit(body, hlen, total):
    sizes = []
    real = wire.aligned_empty
    wire.aligned_empty = lambda n: (sizes.append(n), real(n))[1]
    try:
        _decode_or_wire_error([struct.pack("<4sQQ", wire.MAGIC, hlen, total) + body])
    finally:
        wire.aligned_empty = real
    assert all(n <= MAX_BYTES for n in sizes), sizes


@FUZZ
@given(messages())
def test_valid_messages_round_trip(msg):
    meta, arrays, chunks = msg
    got_meta, got = wire.decode(chunks, max_bytes=MAX_BYTES)
    assert got_meta == meta
    assert set(got) == set(arrays)
    for k, v in arrays.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        assert got[k].tobytes() == v.tobytes()


@FUZZ
@given(messages(), st.data())
def test_mutated_frames_decode_or_raise_wire_error(msg, data):
    _, _, chunks = msg
    blob = bytearray(b"".join(chunks))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = data.draw(st.integers(0, max(0, len(blob) - 1)))
        if op == "flip" and blob:
            blob[pos] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del blob[pos:pos + data.draw(st.integers(1, 16))]
        else:
            blob[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
    cut = data.draw(st.integers(0, len(blob)))
    _decode_or_wire_error([bytes(blob[:cut]), bytes(blob[cut:])])


@st.composite
def hostile_specs(draw):
    big = st.integers(-(2**70), 2**70)
    return [
        draw(st.text(max_size=4) | st.integers()),
        draw(st.sampled_from(DTYPES + ["O", "<U3", "V4", "i4,i4", "(2,)f4", "nope", "__class__"])),
        draw(st.lists(st.integers(-3, 5) | big, max_size=4) | big | st.text(max_size=3)),
        draw(st.integers(-8, 80) | big | st.floats() | st.booleans()),
        draw(st.integers(-8, 80) | big | st.none()),
    ]


@FUZZ
@given(st.lists(hostile_specs(), max_size=3), st.integers(0, 96), st.data())
def test_hostile_headers_decode_or_raise_wire_error(specs, total, data):
    header = json.dumps({"meta": {}, "arrays": specs}).encode()
    payload = data.draw(st.binary(min_size=total, max_size=total))
    frame = struct.pack("<4sQQ", wire.MAGIC, len(header), total) + header + payload
    out = _decode_or_wire_error([frame])
    if out is not None:  # whatever decodes is consistent with its own header
        _, arrays = out
        for a in arrays.values():
            assert a.nbytes <= total


def test_a_header_declaring_20_gib_is_refused_before_allocating(allocations):
    frame = struct.pack("<4sQQ", wire.MAGIC, 2, 20 << 30) + b"{}"
    with pytest.raises(wire.MessageTooLargeError, match=r"21474836480 payload bytes, more "
                                                        r"than the 1048576"):
        wire.decode([frame], max_bytes=1 << 20)
    assert allocations == []


def test_negative_and_inconsistent_shapes_are_wire_errors():
    x = np.ones((2, 3), np.float32)
    frame = b"".join(wire.encode({}, {"x": x}))
    hlen = struct.unpack_from("<Q", frame, 4)[0]
    header = json.loads(frame[20:20 + hlen])
    payload = frame[20 + hlen:]

    def with_spec(spec):
        h = json.dumps({"meta": {}, "arrays": [spec]}).encode()
        return [struct.pack("<4sQQ", wire.MAGIC, len(h), len(payload)) + h + payload]

    name, dname, shape, off, nbytes = header["arrays"][0]
    with pytest.raises(wire.WireError, match=r"bad shape \[-1, 6\]"):
        wire.decode(with_spec([name, dname, [-1, 6], off, nbytes]))
    with pytest.raises(wire.WireError, match=r"shape \[3, 3\] of float32 needs 36 bytes, the "
                                             r"header says 24"):
        wire.decode(with_spec([name, dname, [3, 3], off, nbytes]))
    with pytest.raises(wire.WireError, match="outside the 24-byte payload"):
        wire.decode(with_spec([name, dname, [2, 3], 8, nbytes]))
    with pytest.raises(wire.WireError, match="no raw-bytes wire form"):
        wire.decode(with_spec([name, "O", [3], off, nbytes]))
