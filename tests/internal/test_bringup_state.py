"""Bring-up state is one ``ClusterState`` object (issue 36, point 2): its methods record lost
peers and a broken cluster and build the typed errors. A fresh object here, not the process's
``cluster_state``, so nothing leaks into other tests; the multi-process behaviour (a killed
peer named, status 1) is in tests/test_multi_worker_failures.py. CPU only."""

import pytest

from jaxdist._src.cluster.errors import PeerLostError
from jaxdist._src.distributed import bringup
from jaxdist._src.distributed.process_group import process_group
from jaxdist.cluster_resolver import SimpleClusterResolver


def test_a_fresh_state_is_healthy_with_the_default_timeout():
    state = bringup.ClusterState()
    assert state.group is None and not state.multi_process
    assert state.lost is None and not state.is_broken
    assert state.timeout == bringup.DEFAULT_TIMEOUT_SECONDS
    assert state.heartbeat_seconds(7.0) == 7.0


def test_the_first_report_of_lost_peers_wins_and_breaks_the_cluster():
    state = bringup.ClusterState()
    assert state.mark_lost(["worker:1"]) == ("worker:1",)
    assert state.mark_lost(["worker:2"]) == ("worker:1",)
    assert state.is_broken


def test_mark_broken_alone_breaks_the_cluster():
    state = bringup.ClusterState()
    state.mark_broken()
    assert state.is_broken and state.lost is None


def test_raise_lost_names_the_tasks_the_step_and_the_cause():
    state = bringup.ClusterState()
    state.mark_lost(("worker:0",))
    cause = RuntimeError("gloo: connection closed\nmore")
    with pytest.raises(PeerLostError) as info:
        state.raise_if_lost(cause, "an epoch")
    assert info.value.tasks == ("worker:0",)
    assert info.value.__cause__ is cause
    assert str(info.value).startswith("this task: lost peer task(s) worker:0 during an epoch")
    assert "(error: gloo: connection closed)" in str(info.value)


def test_joined_records_the_group_and_starts_healthy():
    state = bringup.ClusterState()
    state.mark_lost(("worker:1",))
    group = process_group(SimpleClusterResolver(
        {"worker": ["127.0.0.1:1234", "127.0.0.1:1235"]}, task_type="worker", task_id=1))
    state.joined(group, 30.0, 15)
    assert state.group is group and state.multi_process
    assert state.lost is None and not state.is_broken
    assert state.timeout == 30.0 and state.heartbeat_seconds(99.0) == 15.0
    assert state.peer_lost_error(("worker:0",)).args[0].startswith(f"{group.name}: lost peer")


def test_the_module_functions_read_the_one_instance():
    assert bringup.current_group() is bringup.cluster_state.group
    assert bringup.cluster_broken() is bringup.cluster_state.is_broken
