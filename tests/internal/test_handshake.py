"""The authenticated bring-up handshake of sync groups (issue 14, item 3): threads in-process,
and one real cluster where a process with the wrong token is refused."""

import socket
import threading
import time

import pytest
from devutil import PRECISE

from jaxdist._src.cluster.errors import ClusterTimeoutError
from jaxdist._src.distributed.handshake import (
    ClusterAuthenticationError,
    join_handshake,
    serve_handshake,
)
from jaxdist._src.distributed.process_group import ProcessGroup
from jaxdist._src.launch.local import pick_free_ports
from jaxdist._src.security.pki import local_pki
from jaxdist.testing.tls import process_pki

TASKS = (("worker", 0), ("worker", 1), ("worker", 2))


def _group(pid, port, tasks=TASKS):
    address = f"127.0.0.1:{port}"
    return ProcessGroup(tasks, *tasks[pid], pid, address, address, pid == 0)


def _run(fn, *args, **kwargs):
    out = {}

    def target():
        try:
            fn(*args, **kwargs)
            out["ok"] = True
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, out


@pytest.mark.parametrize("tls", [False, True])
def test_every_process_with_the_token_joins_and_the_port_is_free_again(tls):
    port = pick_free_ports(1)[0]
    chief_tls = process_pki().identities["task"] if tls else None
    joiner_tls = process_pki().identities["client"] if tls else None
    chief, c_out = _run(serve_handshake, _group(0, port), "s3cret", 10, tls_material=chief_tls)
    joiners = [_run(join_handshake, _group(i, port), "s3cret", 10, tls_material=joiner_tls)
               for i in (1, 2)]
    for t, _ in [(chief, c_out), *joiners]:
        t.join(15)
    assert c_out == {"ok": True} and all(o == {"ok": True} for _, o in joiners), (c_out, joiners)
    with socket.socket() as s:  # the coordination service binds this port next
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("precise", PRECISE)
def test_a_wrong_token_is_refused_with_a_typed_error_and_the_chief_keeps_waiting(caplog, precise):
    port = pick_free_ports(1)[0]
    group = _group(0, port, TASKS[:2])
    chief, c_out = _run(serve_handshake, group, "s3cret", 20, tls_material=None)
    t0 = time.monotonic()
    with pytest.raises(ClusterAuthenticationError, match="worker:1: the cluster handshake with "
                                                         "worker:0 at 127.0.0.1:.*refused") as e:
        join_handshake(_group(1, port, TASKS[:2]), "guess", 10, tls_material=None)
    assert e.value.tasks == ("worker:1",)  # refused, not timed out (10 s)
    assert not precise or time.monotonic() - t0 < 5  # at once (a wall-clock claim)
    assert "s3cret" not in str(e.value) and "guess" not in str(e.value)
    assert chief.is_alive()  # the cluster refused it and waits for the real process
    join_handshake(_group(1, port, TASKS[:2]), "s3cret", 10, tls_material=None)
    chief.join(10)
    assert c_out == {"ok": True}
    assert "wrong cluster token" in caplog.text


def test_an_impostor_chief_cannot_prove_the_token():
    port = pick_free_ports(1)[0]
    _run(serve_handshake, _group(0, port, TASKS[:2]), "not-the-token", 10, tls_material=None)
    with pytest.raises(ClusterAuthenticationError, match="different cluster tokens"):
        join_handshake(_group(1, port, TASKS[:2]), "s3cret", 10, tls_material=None)


def test_a_certificate_from_another_ca_is_refused():
    port = pick_free_ports(1)[0]
    other = local_pki(["client"])
    try:
        _run(serve_handshake, _group(0, port, TASKS[:2]), "s3cret", 10,
             tls_material=process_pki().identities["task"])
        with pytest.raises(ClusterAuthenticationError, match="certificate"):
            join_handshake(_group(1, port, TASKS[:2]), "s3cret", 10,
                           tls_material=other.identities["client"])
    finally:
        other.cleanup()


def test_the_chief_names_the_processes_that_never_proved_the_token():
    port = pick_free_ports(1)[0]
    with pytest.raises(ClusterTimeoutError, match=r"worker:0 could not join the cluster within "
                                                  r"1 s: the tasks \['worker:1', 'worker:2'\] "
                                                  r"must all start and prove the cluster token"):
        serve_handshake(_group(0, port), "s3cret", 1.0, tls_material=None)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_process_with_the_wrong_token_is_refused_by_a_real_cluster():
    from jaxdist._src.launch.local import tf_config
    from jaxdist.testing import LocalCluster, python_command

    cmd = python_command("jaxdist.testing.workloads", "linreg", "--steps", "2", "--timeout",
                         "60")
    with LocalCluster(workers=2, devices_per_process=1) as c:
        c.start_task("worker:0", cmd)
        c.extra_env = {"TF_CONFIG": tf_config(c.cluster, "worker", 1, "wrong-token"),
                       "JAXDIST_CLUSTER_TOKEN": "wrong-token"}
        c.start_task("worker:1", cmd)
        code = c.wait("worker:1", 90)
        out = c.output("worker:1")
        assert code == 2, c.describe()
        assert "ClusterAuthenticationError: worker:1: the cluster handshake with worker:0" in out
        assert "Traceback" not in out and c.tasks["worker:0"].running()
        c.extra_env = {}
        c.start_task("worker:1", cmd)  # the real worker:1 joins the waiting chief
        codes = c.join(timeout=120)
        assert codes == {"worker:0": 0, "worker:1": 0}, c.describe()
        assert "refused a process at 127.0.0.1" in c.output("worker:0")
