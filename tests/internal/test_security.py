"""Transport security and least privilege of the cluster RPC (issue 14, items 1 and 2).

In-process servers on 127.0.0.1: mutual TLS is required, plaintext only when asked for and only
on loopback, and the right to run code on a worker is a separate credential from the ps token.
"""

import os
import stat

import grpc
import numpy as np
import pytest
from coordinator_util import in_process_worker

from jaxdist._src.cluster.errors import ClusterConfigError
from jaxdist._src.cluster.task_info import TaskInfo
from jaxdist._src.coordinator.errors import WorkerAuthenticationError
from jaxdist._src.coordinator.signing import AUTH_METADATA_KEY
from jaxdist._src.coordinator.worker_client import WorkerClient
from jaxdist._src.coordinator.worker_runtime import WorkerRuntime
from jaxdist._src.coordinator.worker_service import SERVICE_NAME as WORKER_SERVICE
from jaxdist._src.coordinator.worker_service import WorkerServer, answer_value, to_bytes_array
from jaxdist._src.ps.client import PSClient
from jaxdist._src.ps.errors import PSUnavailableError
from jaxdist._src.ps.protocol import SERVICE_NAME as PS_SERVICE
from jaxdist._src.ps.server import ParameterServer
from jaxdist._src.ps.service import ParameterService
from jaxdist._src.security.credentials import (
    CoordinatorKeys,
    WorkerCredential,
    new_coordinator_token,
    token_digest,
    worker_credential,
)
from jaxdist._src.security.pki import apply_task_security, local_pki
from jaxdist._src.security.tls import TLSConfigError, resolve_tls
from jaxdist._src.transport import wire
from jaxdist._src.transport.grpc_util import TOKEN_METADATA_KEY
from jaxdist.testing.tls import process_pki

_NO_ENV = {"JAXDIST_INSECURE": "", "JAXDIST_TLS_CA": "", "JAXDIST_TLS_CERT": "",
           "JAXDIST_TLS_KEY": "", "TF_CONFIG": ""}


@pytest.fixture()
def bare_env(monkeypatch):
    for key in _NO_ENV:
        monkeypatch.delenv(key, raising=False)


@pytest.fixture()
def ps_server():
    pki = process_pki()
    server = ParameterServer(ParameterService("ps:0"), "127.0.0.1:0", token="t0k",
                             tls=pki.identities["task"]).start()
    yield server
    server.stop(0)


def _ping(channel, metadata=()):
    call = channel.unary_stream(f"/{PS_SERVICE}.Unary/Ping")(
        next(wire.encode({})), timeout=5, metadata=metadata)
    return list(call)


# ------------------------------------------------------------------------- item 1: TLS
def test_a_plaintext_client_is_refused_by_a_tls_server(ps_server):
    with grpc.insecure_channel(ps_server.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            _ping(channel, ((TOKEN_METADATA_KEY, "t0k"),))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_client_without_a_certificate_is_refused(ps_server):
    ca = open(process_pki().ca, "rb").read()
    creds = grpc.ssl_channel_credentials(root_certificates=ca)  # verifies the server only
    with grpc.secure_channel(ps_server.address, creds) as channel:
        with pytest.raises(grpc.RpcError) as err:
            _ping(channel, ((TOKEN_METADATA_KEY, "t0k"),))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_client_certificate_from_another_ca_is_refused(ps_server):
    other = local_pki(["client"])
    try:
        client = PSClient([ps_server.address], "t0k", timeout=2.0,
                          tls=other.identities["client"])
        with pytest.raises(PSUnavailableError, match="ps:0"):
            client.call(0, "Ping")
        client.close()
    finally:
        other.cleanup()


def test_the_right_certificate_and_token_work(ps_server):
    client = PSClient([ps_server.address], "t0k", timeout=10,
                      tls=process_pki().identities["client"])
    client.call(0, "Create", {"specs": {"w": {}}}, {"w": np.arange(4, dtype=np.float32)})
    assert client.call(0, "Pull", {"keys": ["w"]})[1]["w"].tolist() == [0, 1, 2, 3]
    client.close()


def test_a_server_without_tls_material_refuses_to_start_and_says_how_to_fix(bare_env):
    with pytest.raises(TLSConfigError, match=r"ps:7 has no TLS certificate.*JAXDIST_TLS_CA.*"
                                             r"JAXDIST_INSECURE=1"):
        ParameterServer(ParameterService("ps:7"), "127.0.0.1:0", token="t0k")
    with pytest.raises(TLSConfigError, match="has no TLS certificate"):
        PSClient(["127.0.0.1:1"], "t0k")


def test_plaintext_only_when_asked_and_only_on_loopback(bare_env, monkeypatch):
    monkeypatch.setenv("JAXDIST_INSECURE", "1")
    assert resolve_tls() is None
    with pytest.raises(TLSConfigError, match="'0.0.0.0:0' is not a loopback address"):
        ParameterServer(ParameterService("ps:0"), "0.0.0.0:0", token="t0k")
    with pytest.raises(TLSConfigError, match="not a loopback address"):
        PSClient(["10.1.2.3:2222"], "t0k")
    server = ParameterServer(ParameterService("ps:0"), "127.0.0.1:0", token="t0k").start()
    try:
        client = PSClient([server.address], "t0k", timeout=10)
        assert client.call(0, "Ping")[0] is not None
        client.close()
    finally:
        server.stop(0)


def test_tls_paths_from_tf_config_and_half_configured_env(bare_env, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {}, "tls": {"ca": "/a", "cert": "/b", '
                                    '"key": "/c"}}')
    tls = resolve_tls()
    assert (tls.ca, tls.cert, tls.key) == ("/a", "/b", "/c")
    with pytest.raises(TLSConfigError, match=r"cannot read the TLS CA certificate '/a'"):
        tls.server_credentials()
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {}, "tls": {"ca": "/a"}}')
    with pytest.raises(TLSConfigError, match="string paths"):
        resolve_tls()
    monkeypatch.delenv("TF_CONFIG")
    monkeypatch.setenv("JAXDIST_TLS_CA", "/a")
    with pytest.raises(TLSConfigError, match="half configured"):
        resolve_tls()


def test_local_pki_is_private_and_keys_are_owner_only():
    pki = local_pki(["worker:0", "ps:0"])
    try:
        assert stat.S_IMODE(os.stat(pki.directory).st_mode) == 0o700
        ident = pki.identities["ps:0"]
        assert stat.S_IMODE(os.stat(ident.key).st_mode) == 0o600
        assert not [f for f in os.listdir(pki.directory) if "ca" in f and f.endswith(".key")]
        env = apply_task_security({"JAXDIST_INSECURE": "1"}, "ps", 0, pki, "c0")
        assert env == ident.env()  # no insecure flag, no coordinator credential on a ps
    finally:
        pki.cleanup()
    assert not os.path.exists(pki.directory)


# ---------------------------------------------------------------- item 2: least privilege
@pytest.fixture()
def worker_server():
    server, token = in_process_worker()
    yield server, token
    server.stop(0)


def _run_closure_raw(address, metadata):
    """What a ps client (ps token only) would send to run code on a worker."""
    import cloudpickle

    creds = process_pki().identities["client"].channel_credentials()
    payload = {"fn": to_bytes_array(cloudpickle.dumps(os.getpid)),
               "args": to_bytes_array(cloudpickle.dumps(((), {})))}
    with grpc.secure_channel(address, creds) as channel:
        call = channel.stream_stream(f"/{WORKER_SERVICE}/RunClosure")(
            iter(list(wire.encode({"closure_id": 0}, payload))), timeout=10, metadata=metadata)
        return list(call)


def test_the_ps_token_cannot_run_code_on_a_worker(worker_server):
    server, token = worker_server
    with pytest.raises(grpc.RpcError) as err:
        _run_closure_raw(server.address, ((TOKEN_METADATA_KEY, "t0k"),))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "needs a request signed by the chief" in err.value.details()
    assert server.service.functions_run == 0
    # Neither does a garbled signature, nor the coordinator token itself (it is never sent,
    # and a worker does not accept it in place of a signature).
    for auth in ("t0k", token, '{"s": "x", "t": 1, "n": 1, "i": "", "sig": "00"}'):
        with pytest.raises(grpc.RpcError) as err:
            _run_closure_raw(server.address, ((AUTH_METADATA_KEY, auth),))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "no well-formed coordinator signature" in err.value.details()
    assert server.service.functions_run == 0


def test_the_chiefs_signature_runs_code_and_results_are_authenticated(worker_server):
    import cloudpickle

    server, token = worker_server
    client = WorkerClient([server.address], token, tls=process_pki().identities["client"])
    meta, arrays = client.call(0, "RunClosure", {"closure_id": 1},
                               {"fn": to_bytes_array(cloudpickle.dumps(lambda: 41 + 1)),
                                "args": to_bytes_array(cloudpickle.dumps(((), {})))})
    assert meta["ok"] and answer_value(arrays) == 42
    assert "mac" not in meta
    client.close()
    bad = WorkerClient([server.address], "wrong", tls=process_pki().identities["client"])
    with pytest.raises(WorkerAuthenticationError, match="signature does not match"):
        bad.call(0, "Ping", timeout=5.0)
    bad.close()


def test_the_coordinator_refuses_an_answer_without_the_workers_mac():
    # A peer that accepts the chief's requests (it has the public key) but answers with
    # another answer key (say worker:1's, taking over worker:0's dead port): its bytes are
    # never unpickled.
    token = new_coordinator_token()
    keys = CoordinatorKeys(token)
    info = TaskInfo({"worker": ["127.0.0.1:0"]}, "worker", 0, "t0k")
    impostor = WorkerServer(WorkerRuntime(info), "127.0.0.1:0",
                            WorkerCredential(keys.public_key, keys.answer_key("worker:1").hex()),
                            tls=process_pki().identities["task"]).start()
    try:
        client = WorkerClient([impostor.address], token, tls=process_pki().identities["client"])
        with pytest.raises(WorkerAuthenticationError, match="refusing to unpickle"):
            client.call(0, "Ping", timeout=5.0)
        client.close()
    finally:
        impostor.stop(0)


def test_a_worker_refuses_to_start_without_the_coordinator_credential(bare_env, monkeypatch):
    for key in ("JAXDIST_COORDINATOR_TOKEN", "JAXDIST_COORDINATOR_TOKEN_SHA256",
                "JAXDIST_COORDINATOR_PUBLIC_KEY", "JAXDIST_COORDINATOR_ANSWER_KEY"):
        monkeypatch.delenv(key, raising=False)
    info = TaskInfo({"worker": ["127.0.0.1:0"]}, "worker", 0, "t0k")
    with pytest.raises(ValueError, match="worker:0: needs the coordinator's public key"):
        WorkerServer(WorkerRuntime(info), "127.0.0.1:0", tls="insecure")
    with pytest.raises(ValueError, match="needs the coordinator token"):
        WorkerClient(["127.0.0.1:1"], tls="insecure")


def test_workers_get_the_public_key_and_their_own_answer_key_only():
    keys = CoordinatorKeys("c0ffee")
    env0 = apply_task_security({}, "worker", 0, None, "c0ffee")
    env1 = apply_task_security({}, "worker", 1, None, "c0ffee")
    for env in (env0, env1):
        assert not any("c0ffee" in v or token_digest("c0ffee") in v for v in env.values())
        assert env["JAXDIST_COORDINATOR_PUBLIC_KEY"] == keys.public_key
    assert env0["JAXDIST_COORDINATOR_ANSWER_KEY"] == keys.answer_key("worker:0").hex() != \
        env1["JAXDIST_COORDINATOR_ANSWER_KEY"]
    assert apply_task_security({}, "chief", 0, None, "c0ffee")["JAXDIST_COORDINATOR_TOKEN"] == \
        "c0ffee"
    for job in ("ps", "evaluator"):
        assert not any(k.startswith("JAXDIST_COORDINATOR")
                       for k in apply_task_security({}, job, 0, None, "c0ffee"))
    cred = worker_credential("worker:0", environ=env0)
    assert cred.verify(keys.sign(b"m"), b"m") and cred.answer_key == keys.answer_key("worker:0")


def test_a_worker_configured_with_the_token_digest_only_is_told_what_to_set():
    with pytest.raises(ClusterConfigError, match="coordinator_public_key"):
        worker_credential("worker:0", environ={"JAXDIST_COORDINATOR_TOKEN_SHA256":
                                               token_digest("c0ffee")})
    with pytest.raises(ClusterConfigError, match="'coordinator_answer_key'.* is missing"):
        worker_credential("worker:0", environ={"JAXDIST_COORDINATOR_PUBLIC_KEY": "00" * 32})
    with pytest.raises(ClusterConfigError, match="public key is not 64 hex digits"):
        worker_credential("worker:0", environ={"JAXDIST_COORDINATOR_PUBLIC_KEY": "zz",
                                               "JAXDIST_COORDINATOR_ANSWER_KEY": "00" * 32})
