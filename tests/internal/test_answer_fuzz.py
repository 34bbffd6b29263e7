"""Nothing a worker sends can crash the chief (issue 34, point 1).

A hostile ``worker:0`` runs in this process: a real ``WorkerServer`` (mutual TLS, the
worker's real answer key) whose service answers every closure with a mutated answer, so each
answer carries a valid MAC. The chief runs in a child process (``answer_fuzz_chief.py``) and
decodes every answer with the coordinator's own functions; a crash (the segfault the old
restricted unpickler allowed) is the child's exit signal.

The answers: valid values and exceptions in ``answer_codec``'s format, mutated (bytes flipped,
set, inserted, deleted, cut, lengths set to extremes, two answers spliced), plus answers that
carry a forbidden construct (marked ``fuzz_hostile``): the original attack (a pickle that
builds a numpy array of dtype object over a fake pointer) under every key, arrays, scalars,
masked arrays and dtypes of object, void, structured and sub-array dtypes, nesting past the
limit, counts and lengths past the end, integers past the limit, code points past U+10FFFF,
and a result that is not data. Every answer must either decode to data or be refused with
``UntrustedPickleError`` naming the worker; every hostile one must be refused.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys

import numpy as np
import pytest
from coordinator_util import in_process_worker

from jaxdist._src.coordinator import answer_codec
from jaxdist._src.coordinator.worker_service import to_bytes_array
from jaxdist.testing.tls import process_pki

HERE = os.path.dirname(os.path.abspath(__file__))
ANSWERS = 10_240  # 160 calls of 64 answers
BATCH = 64


class _Pointer:
    """The original attack: unpickled, a numpy array of dtype object over 8 bytes."""

    def __reduce__(self):
        return np.ndarray, ((1,), np.dtype(object), bytearray(b"A" * 8))


def _corpus() -> list[bytes]:
    values = [None, True, 7, -2**70, 1.5, 2j, "loss", "é\udc80", b"\0\1", bytearray(b"x"),
              [1, 2.5, "a"], (1, (2, (3,))), {"loss": np.float32(0.5), 3: [None]},
              {1, 2}, frozenset({"a"}), range(2, 9, 3), slice(1, None, 2),
              np.arange(12, dtype=np.float32).reshape(3, 4), np.array([True, False]),
              np.array(["ab", "c"]), np.array([b"xy"]), np.datetime64("2020-01-02"),
              np.int8(-3), np.float16(2.5), np.dtype("int32"),
              np.ma.masked_array([1.0, 2.0], mask=[0, 1]), np.zeros((0, 5)),
              {"nested": {"deep": [np.arange(3), {"x": (np.uint64(2**63),)}]}}]
    out = [answer_codec.encode(v) for v in values]
    import ml_dtypes
    out.append(answer_codec.encode(np.ones(4, ml_dtypes.bfloat16)))
    for e in (KeyError("k"), ValueError("bad", 3), FileNotFoundError(2, "gone", "/f"),
              RuntimeError({"a": [1]})):
        out.append(answer_codec.encode(e))
    return out


def _array(name: bytes, shape: tuple[int, ...], raw: bytes, tag: bytes = b"a") -> bytes:
    dims = b"".join(struct.pack("<Q", d) for d in shape)
    return tag + bytes([len(name)]) + name + bytes([len(shape)]) + dims + raw


_FORBIDDEN_DTYPES = [b"O", b"|O", b"object", b"V8", b"|V8", b"i4,O", b"[('a','O')]",
                     b"(2,)i4", b"O8", b"<U", b"|S0", b"void", b"bytes", b"str"]


def _hostile(rng: random.Random) -> tuple[str, dict, bytes]:
    """``(key, meta, payload)`` of one answer carrying a forbidden construct."""
    magic = answer_codec.MAGIC
    kind = rng.randrange(11)
    dt = rng.choice(_FORBIDDEN_DTYPES)
    if kind == 0:  # the original attack, under every key
        key = rng.choice(["data", "value", "pickle", "error", "error_pickle"])
        import pickle
        return key, {}, pickle.dumps(_Pointer())
    if kind == 1:
        return "data", {}, magic + _array(dt, (1,), b"A" * 8)
    if kind == 2:
        return "data", {}, magic + b"g" + bytes([len(dt)]) + dt + b"A" * 8
    if kind == 3:
        return "data", {}, magic + b"y" + bytes([len(dt)]) + dt
    if kind == 4:
        return "data", {}, magic + b"m" + _array(b"float64", (1,), b"\0" * 8) + _array(
            dt, (1,), b"A" * 8) + b"N"
    if kind == 5:  # nesting past the limit
        depth = rng.choice([answer_codec.MAX_DEPTH + 1, 1000, 100_000])
        return "data", {}, magic + rng.choice([b"l", b"t", b"S"]) + b"\x01\0\0\0" + (
            b"l\x01\0\0\0" * depth) + b"N"
    if kind == 6:  # counts and lengths past the end
        tag = rng.choice([b"l", b"t", b"S", b"d", b"s", b"b", b"B", b"I"])
        n = rng.choice([0xFFFFFFFF, 0x7FFFFFFF, 1 << 20])
        return "data", {}, magic + tag + struct.pack("<I", n) + b"N" * 16
    if kind == 7:  # shapes that need more bytes than there are, or overflow
        shape = rng.choice([(1 << 62,), (1 << 32, 1 << 32), (0, 1 << 63), (3,) * 64 + (2,),
                            (2,) * 65])
        return "data", {}, magic + _array(b"float32", shape, b"\0" * 64)
    if kind == 8:  # an integer past the limit
        n = answer_codec.MAX_INT_BYTES + rng.randrange(1, 1000)
        return "data", {}, magic + b"I" + struct.pack("<I", n) + b"\x01" * n
    if kind == 9:  # code points past U+10FFFF
        return "data", {}, magic + _array(b"<U1", (2,), b"a\0\0\0" + b"\xff" * 4)
    # A result that is not data: refused unless every worker is trusted.
    return "data", {}, answer_codec.encode_opaque(object(), "the result")


def _mutate(rng: random.Random, corpus: list[bytes]) -> bytes:
    data = bytearray(rng.choice(corpus))
    for _ in range(1 if rng.random() < 0.6 else rng.randrange(2, 4)):
        op = rng.randrange(7)
        pos = rng.randrange(len(data) + 1)
        if op == 0 and data:
            data[min(pos, len(data) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and data:
            data[min(pos, len(data) - 1)] = rng.randrange(256)
        elif op == 2:
            data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        elif op == 3:
            del data[pos:pos + rng.randrange(1, 9)]
        elif op == 4:
            del data[pos:]
        elif op == 5:
            width = rng.choice([4, 8])
            extreme = rng.choice([0, 1, 0xFF, 0x7FFFFFFF, 0xFFFFFFFF, 1 << 63, (1 << 64) - 1])
            data[pos:pos + width] = (extreme % (1 << (8 * width))).to_bytes(width, "little")
        else:
            other = rng.choice(corpus)
            cut = rng.randrange(len(other) + 1)
            data[pos:] = other[cut:]
    return bytes(data)


def _answers(seed: int):
    """An endless stream of ``(meta, arrays)`` answers: 1 in 4 hostile, the rest mutated."""
    rng = random.Random(seed)
    corpus = _corpus()
    error_meta = {"ok": False, "kind": "user", "type": "ValueError", "message": "m",
                  "traceback": "", "task": "worker:0"}
    while True:
        if rng.random() < 0.25:
            key, _, payload = _hostile(rng)
            is_error = key.startswith("error")
            meta = {**(error_meta if is_error else {"ok": True}), "fuzz_hostile": True}
            yield meta, {key: to_bytes_array(payload)}
            continue
        payload = _mutate(rng, corpus)
        if rng.random() < 0.3:
            yield dict(error_meta), {"error": to_bytes_array(payload)}
        else:
            yield {"ok": True}, {"data": to_bytes_array(payload)}


@pytest.fixture()
def hostile_worker():
    server, token = in_process_worker(index=0, direct_transport=False)
    stream = _answers(seed=34)

    def run_closures(items, active=None, session=None, seq=None):
        for _ in items:
            yield next(stream)

    server.service.run_closures = run_closures
    yield server, token
    server.stop(0)


def test_ten_thousand_mutated_answers_with_a_valid_mac_never_crash_the_chief(
        hostile_worker, monkeypatch):
    server, token = hostile_worker
    env = {**os.environ, **process_pki().identities["client"].env(),
           "FUZZ_ADDRESS": server.address, "FUZZ_CALLS": str(ANSWERS // BATCH),
           "JAXDIST_COORDINATOR_TOKEN": token, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    env.pop(answer_codec.TRUST_ENV, None)
    env.pop("TF_CONFIG", None)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "answer_fuzz_chief.py")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"the chief exited with {proc.returncode} (negative: killed by that signal)\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["answers"] >= 10_000, counts
    assert counts["other"] == 0, counts
    assert counts["hostile"] >= 2000 and counts["hostile_decoded"] == 0, counts
    assert counts["refused"] >= counts["hostile"], counts
    assert counts["decoded"] + counts["refused"] == counts["answers"], counts
