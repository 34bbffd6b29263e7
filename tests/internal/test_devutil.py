"""The suite's own helpers (tests/devutil.py): the XLA flags of the processes tests start, and
how a test's environment is put back."""

import os

import pytest
from devutil import restore_environ, xla_flags


def test_xla_flags_keep_the_suites_level_and_set_the_devices(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                       "--xla_backend_optimization_level=0 --xla_dump_to=/tmp/x")
    assert xla_flags() == "--xla_backend_optimization_level=0"
    assert xla_flags(2) == ("--xla_backend_optimization_level=0 "
                            "--xla_force_host_platform_device_count=2")
    monkeypatch.delenv("XLA_FLAGS")
    assert xla_flags() == "" and xla_flags(1) == "--xla_force_host_platform_device_count=1"


def test_restore_environ_sets_back_only_what_changed(monkeypatch):
    monkeypatch.setenv("JAXDIST_TEST_KEPT", "same")
    monkeypatch.setenv("JAXDIST_TEST_CHANGED", "before")
    monkeypatch.delenv("JAXDIST_TEST_ADDED", raising=False)
    saved = dict(os.environ)
    os.environ["JAXDIST_TEST_ADDED"] = "new"
    os.environ["JAXDIST_TEST_CHANGED"] = "after"
    touched = []
    real_set, real_del = os.environ.__class__.__setitem__, os.environ.__class__.__delitem__
    monkeypatch.setattr(os.environ.__class__, "__setitem__",
                        lambda self, k, v: (touched.append(k), real_set(self, k, v)))
    monkeypatch.setattr(os.environ.__class__, "__delitem__",
                        lambda self, k: (touched.append(k), real_del(self, k)))
    restore_environ(saved)
    monkeypatch.undo()
    assert sorted(touched) == ["JAXDIST_TEST_ADDED", "JAXDIST_TEST_CHANGED"]
    assert os.environ.get("JAXDIST_TEST_ADDED") is None


@pytest.fixture(autouse=True)
def _clean():
    yield
    for key in ("JAXDIST_TEST_KEPT", "JAXDIST_TEST_CHANGED", "JAXDIST_TEST_ADDED"):
        os.environ.pop(key, None)
