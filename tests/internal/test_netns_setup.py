"""``jaxdist.testing.netns`` without creating namespaces: the address plan, the reasons it
cannot run (so tests skip with them) and which leftovers a sweep may delete. The namespaces
themselves run in tests/test_netns_cluster.py (root). CPU only."""

import os

import pytest

from jaxdist._src.launch import netns


def test_the_address_plan_is_one_private_address_per_host():
    assert netns.address_plan(3) == ["10.213.0.1", "10.213.0.2", "10.213.0.3"]
    with pytest.raises(ValueError, match=r"hosts must be in \[1, 250\], got 0"):
        netns.address_plan(0)


def test_without_root_or_ip_it_says_why_and_creates_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(netns, "_ip", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netns.unavailable_reason() == ("network namespaces need root (ip netns add): not "
                                          "running as root")
    with pytest.raises(netns.NetnsUnavailable, match="not running as root"):
        netns.NetworkNamespaces(3)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    assert "iproute2's `ip` command, which is not on PATH" in netns.unavailable_reason()
    assert calls == []


def test_a_sweep_deletes_only_namespaces_of_dead_processes(monkeypatch):
    dead = 2 ** 22 + 12345  # above Linux's pid_max: no such process
    listing = (f"jaxdist-{dead}-abc123-h0 (id: 3)\njaxdist-{dead}-abc123-br\n"
               f"jaxdist-{os.getpid()}-def456-h1\nsomeone-elses-ns\njaxdist-x-h0\n")
    calls = []

    class Done:
        def __init__(self, stdout=""):
            self.stdout, self.returncode = stdout, 0

    def ip(*args, check=True):
        calls.append(args)
        return Done(listing if args[:2] == ("netns", "list") else "")

    monkeypatch.setattr(netns, "_ip", ip)
    assert netns.sweep_stale() == [f"jaxdist-{dead}-abc123-h0", f"jaxdist-{dead}-abc123-br"]
    assert [a for a in calls if a[:2] == ("netns", "del")] == [
        ("netns", "del", f"jaxdist-{dead}-abc123-h0"),
        ("netns", "del", f"jaxdist-{dead}-abc123-br")]
