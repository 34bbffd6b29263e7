"""A checkpoint that cannot be written leaves nothing behind (issue 34): a full
disk, a read-only one, an I/O error. For a ps Save: the partial checkpoint is removed, the
earlier ones and the service stay, the error says how many bytes were needed and free, and
``keep`` (and leftovers of interrupted saves) make room before a save on a short disk, never
by deleting the newest complete checkpoint. The Trainer's orbax checkpoints do the same; the
small files written through a temporary file (the run record, a dataset cache, the
pointers) leave no temporary file.

The full disk is real where this process may mount a small tmpfs (root); the other failures
are injected at the write (``os.fsync`` / ``os.makedirs`` raising the ``OSError``).
"""

import errno
import json
import os
import pickle
import re
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist._src.ps import checkpoints
from jaxdist._src.ps.client import PSClient
from jaxdist._src.ps.errors import PSCheckpointWriteError
from jaxdist._src.ps.server import ParameterServer
from jaxdist._src.ps.service import ParameterService
from jaxdist._src.train.checkpoint import Checkpointer, CheckpointWriteError
from jaxdist._src.train.run_record import RunRecord, read_record

TOKEN = "checkpoint-space-Secret-5a0c"
MIB = 1 << 20


# Hand-made frames over plaintext loopback, which must be asked for.
pytestmark = pytest.mark.usefixtures("plaintext_on_loopback")


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs: a real filesystem that fills up (skipped where it cannot be mounted)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a full filesystem needs a small tmpfs, and mounting one needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a 4 MiB tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _serve(root, **client_kwargs):
    server = ParameterServer(ParameterService("ps:0", checkpoint_dir=str(root)), "127.0.0.1:0",
                             token=TOKEN).start()
    return server, PSClient([server.address], TOKEN, timeout=20, **client_kwargs)


def _create(client, floats: int):
    client.call(0, "Create", {"specs": {"w": {}}}, {"w": np.zeros(floats, np.float32)})


def _push(client, value: float):
    version = client.call(0, "Pull", {"keys": ["w"]})[0]["versions"]["w"]
    n = client.call(0, "Pull", {"keys": ["w"]})[1]["w"].size
    client.call(0, "Push", {"versions": {"w": version}}, {"w": np.full(n, value, np.float32)})


def _save(client, step, keep=None):
    return client.call(0, "Save", {"directory": None, "step": step, "keep": keep})[0]["path"]


def _listing(root):
    return sorted(os.listdir(root / "ps-0"))


def _free(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _needed_and_free(message: str) -> tuple[int, int]:
    m = re.search(r"the checkpoint needs (\d+) bytes, (\d+) are free", message)
    assert m, message
    return int(m.group(1)), int(m.group(2))


# ---------------------------------------------------------------------- a real full disk
def test_a_save_that_fills_the_disk_leaves_nothing_and_the_ps_serves_on(small_disk):
    server, client = _serve(small_disk)
    try:
        _create(client, 300_000)  # 1.2 MB a checkpoint: three fit in 4 MiB, a fourth not
        for step in (1, 2, 3):
            _push(client, 1.0)
            _save(client, step)
        free_before = _free(small_disk)
        _push(client, 1.0)
        with pytest.raises(PSCheckpointWriteError) as e:
            _save(client, 4)
        message = str(e.value)
        assert "No space left on device (ENOSPC)" in message, message
        needed, free = _needed_and_free(message)
        assert 1_200_000 < needed < 1_210_000 and free < needed
        assert abs(free - free_before) <= 64 << 10, (free, free_before)  # nothing left over
        assert "the partial checkpoint was removed and ckpt-3 is still its newest" in message
        assert _listing(small_disk) == ["ckpt-1", "ckpt-2", "ckpt-3", "latest"]
        assert abs(_free(small_disk) - free_before) <= 64 << 10
        # The ps serves on: pulls, pushes, and the checkpoint it kept restores.
        _push(client, 1.0)
        assert client.call(0, "Pull", {"keys": ["w"]})[1]["w"][0] == 5.0
        assert client.call(0, "Restore", {"directory": None, "step": 3})[0]["step"] == 3
        assert client.call(0, "Pull", {"keys": ["w"]})[1]["w"][0] == 3.0
        # With keep=2 the retry makes room first (ckpt-1 goes before the write, ckpt-2
        # after it): it succeeds on the same disk.
        _push(client, 1.0)
        assert _save(client, 4, keep=2).endswith("ps-0/ckpt-4")
        assert _listing(small_disk) == ["ckpt-3", "ckpt-4", "latest"]
        assert client.call(0, "Restore", {"directory": None})[0]["step"] == 4
        assert client.call(0, "Pull", {"keys": ["w"]})[1]["w"][0] == 4.0
    finally:
        client.close()
        server.stop(0)


def test_keep_never_deletes_the_newest_complete_checkpoint_to_make_room(small_disk):
    server, client = _serve(small_disk)
    try:
        _create(client, 625_000)  # 2.5 MB: one fits in 4 MiB, two do not
        _push(client, 1.0)
        _save(client, 1)
        _push(client, 1.0)
        with pytest.raises(PSCheckpointWriteError, match="ckpt-1 is still its newest") as e:
            _save(client, 2, keep=1)  # keep=1 would prune ckpt-1, but only after ckpt-2
        needed, free = _needed_and_free(str(e.value))
        assert needed > free
        assert _listing(small_disk) == ["ckpt-1", "latest"]
        assert client.call(0, "Restore", {"directory": None})[0]["step"] == 1
        assert client.call(0, "Pull", {"keys": ["w"]})[1]["w"][0] == 1.0
    finally:
        client.close()
        server.stop(0)


def test_leftovers_of_an_interrupted_save_make_room_first(small_disk):
    """A ``ckpt-<step>.tmp-*`` a killed save left behind holds the space a save needs: it
    goes before the write (with or without keep)."""
    os.makedirs(small_disk / "ps-0" / "ckpt-9.tmp-0badf00d")
    (small_disk / "ps-0" / "ckpt-9.tmp-0badf00d" / "state.jdw").write_bytes(
        bytes(3 * MIB + MIB // 4))
    server, client = _serve(small_disk)
    try:
        _create(client, 300_000)
        _push(client, 2.0)
        _save(client, 10)
        assert _listing(small_disk) == ["ckpt-10", "latest"]
        assert client.call(0, "Restore", {"directory": None})[0]["step"] == 10
    finally:
        client.close()
        server.stop(0)


# ---------------------------------------------------------------------- injected failures
def _failing(monkeypatch, name: str, code: int, call: int = 1):
    """``os.<name>`` raises ``OSError(code)`` on its ``call``-th use (from now on)."""
    real = getattr(os, name)
    calls = []

    def fail(*args, **kwargs):
        calls.append(args)
        if len(calls) == call:
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, name, fail)
    return calls


CODES = [errno.ENOSPC, errno.EROFS, errno.EIO]
# (os function, which call fails): the temp directory, the data file, the ``latest`` file.
WHERE = [("makedirs", 2), ("fsync", 1), ("fsync", 2)]


@pytest.mark.parametrize("code", CODES, ids=[errno.errorcode[c] for c in CODES])
@pytest.mark.parametrize("where", WHERE, ids=["tmp-dir", "data", "latest"])
def test_a_failed_write_removes_its_files_and_keeps_the_previous_checkpoint(
        tmp_path, monkeypatch, code, where):
    svc = ParameterService("ps:0", checkpoint_dir=str(tmp_path))
    svc.create({"w": np.ones(1000, np.float32)}, {})
    svc.save(None, 1)
    svc.push({"w": np.ones(1000, np.float32)}, {"w": 1})
    calls = _failing(monkeypatch, *where[:1], code, call=where[1])
    with pytest.raises(PSCheckpointWriteError) as e:
        svc.save(None, 2, keep=1)
    monkeypatch.undo()
    assert len(calls) == where[1]  # the failure was injected where the test says
    err = e.value
    assert err.errno == code and err.needed > 4000 and isinstance(err.free, int)
    assert f"({errno.errorcode[code]})" in str(err)
    assert f"the checkpoint needs {err.needed} bytes, {err.free} are free" in str(err)
    assert "ckpt-1 is still its newest complete checkpoint" in str(err)
    assert _listing(tmp_path) == ["ckpt-1", "latest"]  # no temp directory, no ckpt-2
    assert checkpoints.latest_step(str(tmp_path), "ps:0") == 1
    assert svc.restore() == 1 and svc.pull(["w"])["w"][0][0] == 1.0
    svc.push({"w": np.ones(1000, np.float32)}, {"w": 1})
    svc.save(None, 2, keep=1)  # the retry succeeds once the disk is back
    assert _listing(tmp_path) == ["ckpt-2", "latest"]


@pytest.mark.parametrize("direct_transport", [False, True], ids=["grpc", "direct"])
def test_the_client_gets_the_typed_error_on_both_transports(tmp_path, monkeypatch,
                                                            direct_transport):
    server, client = _serve(tmp_path, direct_transport=direct_transport)
    try:
        _create(client, 1000)
        _failing(monkeypatch, "fsync", errno.ENOSPC)
        with pytest.raises(PSCheckpointWriteError, match=r"ps:0 could not write checkpoint 1 "
                           r".*No space left on device.*the checkpoint needs \d+ bytes"):
            _save(client, 1)
        monkeypatch.undo()
        assert client.direct_calls > 0 if direct_transport else client.direct_calls == 0
        assert _listing(tmp_path) == []
        assert _save(client, 1).endswith("ckpt-1")
    finally:
        client.close()
        server.stop(0)


def test_any_other_failure_mid_write_removes_the_temp_directory_too(tmp_path, monkeypatch):
    svc = ParameterService("ps:0", checkpoint_dir=str(tmp_path))
    svc.create({"w": np.ones(10, np.float32)}, {})
    real = checkpoints.wire.encode

    def broken(meta, arrays):
        yield next(iter(real(meta, arrays)))
        raise MemoryError("out of memory while encoding")

    monkeypatch.setattr(checkpoints.wire, "encode", broken)
    with pytest.raises(MemoryError):
        svc.save(None, 1)
    assert _listing(tmp_path) == []


def test_the_pointer_and_latest_files_leave_no_temp_file(tmp_path, monkeypatch):
    _failing(monkeypatch, "fsync", errno.ENOSPC)
    with pytest.raises(OSError):
        checkpoints.write_checkpoint_pointer(str(tmp_path), 3)
    assert os.listdir(tmp_path) == []


def test_make_room_deletes_only_what_pruning_would(tmp_path, monkeypatch):
    task_dir = tmp_path / "ps-0"
    for name in ("ckpt-1", "ckpt-2", "ckpt-3", "ckpt-4", "ckpt-5.tmp-00aa11bb"):
        os.makedirs(task_dir / name)
    checkpoints.write_checkpoint_pointer(str(tmp_path), 2)  # the chief's: kept whatever
    monkeypatch.setattr(checkpoints, "free_bytes", lambda path: 0)  # never enough room
    deleted = checkpoints.make_room(str(tmp_path), "ps:0", keep=2, step=6, needed=1)
    # After saving 6 with keep=2, pruning keeps 6 and 4 (and the pointer's 2): 1 and 3 go.
    assert [os.path.basename(p) for p in deleted] == ["ckpt-5.tmp-00aa11bb", "ckpt-1",
                                                      "ckpt-3"]
    assert _listing(tmp_path) == ["ckpt-2", "ckpt-4"]
    # keep=1: 4 would be pruned after the save, but it is the newest complete one.
    assert checkpoints.make_room(str(tmp_path), "ps:0", keep=1, step=7, needed=1) == []
    monkeypatch.setattr(checkpoints, "free_bytes", lambda path: 10 << 20)  # room enough
    os.makedirs(task_dir / "ckpt-8.tmp-00aa11bb")
    assert checkpoints.make_room(str(tmp_path), "ps:0", keep=1, step=9, needed=1) == []


# ---------------------------------------------------------------------- the Trainer's (orbax)
def _random(floats: int):
    """Arrays orbax cannot compress (it would make zeros take no room)."""
    return {"w": jnp.asarray(np.random.default_rng(floats).integers(
        0, 2**32, floats, dtype=np.uint32))}


def test_a_trainer_checkpoint_that_fills_the_disk_is_removed(small_disk):
    directory = small_disk / "ckpt"
    ckpt = Checkpointer(directory, keep=1)
    ckpt.save(1, _random(250_000), {"epoch": 0})  # 1 MB
    free_before = _free(small_disk)
    with pytest.raises(CheckpointWriteError, match="No space left on device") as e:
        ckpt.save(2, _random(900_000), {"epoch": 1})  # 3.6 MB: does not fit next to step 1
    assert e.value.needed == 3_600_000
    assert f"it holds 3600000 bytes of arrays, {e.value.free} bytes are free" in str(e.value)
    assert "step 1 is still the newest" in str(e.value)
    assert sorted(os.listdir(directory)) == ["1"]  # orbax's temporary directory is gone
    assert abs(_free(small_disk) - free_before) <= 64 << 10
    state, meta = ckpt.restore(1, like=_random(250_000))
    assert meta == {"epoch": 0} and np.array_equal(state["w"], _random(250_000)["w"])
    ckpt.save(2, _random(250_000), {"epoch": 1})  # the next save fits
    assert ckpt.all_steps() == [2]


def test_trainer_checkpoints_beyond_keep_make_room_first(small_disk):
    ckpt = Checkpointer(small_disk / "ckpt", keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, _random(250_000), {})
    assert ckpt.all_steps() == [2, 3]
    # 2.8 MB: fits only once step 2 (which keep=2 drops after this save) has gone first.
    assert _free(small_disk) < 2_800_000
    ckpt.save(4, _random(700_000), {})
    assert ckpt.all_steps() == [3, 4]


def test_a_failed_trainer_save_removes_orbax_temp_dir_on_any_error(tmp_path, monkeypatch):
    import tensorstore

    ckpt = Checkpointer(tmp_path / "ckpt", keep=2)
    ckpt.save(1, _random(1000), {})
    real = tensorstore.open

    def broken(*args, **kwargs):  # the array store fails as a failing disk would
        raise ValueError("DATA_LOSS: Error writing local file: Input/output error "
                         "[os_error_code='5']")

    monkeypatch.setattr(tensorstore, "open", broken)
    with pytest.raises(CheckpointWriteError, match="Input/output error"):
        ckpt.save(2, _random(1000), {})
    monkeypatch.setattr(tensorstore, "open", real)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1"]
    ckpt.save(2, _random(1000), {})
    assert ckpt.all_steps() == [1, 2]


def test_a_failed_save_waits_for_orbax_writers_still_running_before_removing(tmp_path,
                                                                           monkeypatch):
    """One orbax writer fails while another is still writing: the partial checkpoint is
    removed only after that one ends, so nothing of it comes back after the removal."""
    import threading
    import time

    import tensorstore

    ckpt = Checkpointer(tmp_path / "ckpt", keep=2)
    ckpt.save(1, _random(1000), {})
    real = tensorstore.open
    late = []

    def one_fails_one_is_slow(*args, **kwargs):
        if threading.current_thread().name == "array_type_handler":
            time.sleep(0.5)  # still writing when the other writer's error reaches save()
            late.append(time.monotonic())
            return real(*args, **kwargs)
        raise ValueError("DATA_LOSS: Error writing local file: Input/output error "
                         "[os_error_code='5']")

    monkeypatch.setattr(tensorstore, "open", one_fails_one_is_slow)
    with pytest.raises(CheckpointWriteError, match="Input/output error"):
        ckpt.save(2, _random(1000), {})
    raised = time.monotonic()
    monkeypatch.setattr(tensorstore, "open", real)
    assert late and late[0] < raised  # the slow writer did run, and before save() returned
    time.sleep(0.5)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1"]


# ---------------------------------------------------------------------- small files
def test_the_run_record_leaves_no_temp_file_and_keeps_the_old_record(tmp_path, monkeypatch):
    record = RunRecord(tmp_path, {"seed": 0})
    record.saved(10, 1, 0)
    before = read_record(tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(json, "dump", full)
    with pytest.raises(OSError, match="No space left"):
        record.saved(20, 2, 0)
    monkeypatch.undo()
    assert [n for n in os.listdir(tmp_path) if ".tmp" in n] == []
    assert read_record(tmp_path) == before


def test_a_dataset_cache_file_is_not_left_half_written(tmp_path, monkeypatch):
    import jaxdist

    path = str(tmp_path / "rows")
    ds = jaxdist.Dataset.range(4).cache(path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pickle, "dump", full)
    with pytest.raises(OSError, match="No space left"):
        list(ds)
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    assert [int(v) for v in jaxdist.Dataset.range(4).cache(path)] == [0, 1, 2, 3]
    assert [n for n in os.listdir(tmp_path) if ".tmp" in n] == []
    assert [int(v) for v in jaxdist.Dataset.range(9).cache(path)] == [0, 1, 2, 3]  # cached
