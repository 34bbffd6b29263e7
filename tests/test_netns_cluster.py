"""Real networks (issue 33, point 5): a cluster of three hosts, each a Linux network namespace
with its own address (10.213.0.1-3) on a private bridge, mutual TLS with certificates for those
addresses, one task per host (``jaxdist.testing.netns``). A host's link is taken down mid-run
(``ip link set eth0 down``): every process on both sides of the cut ends with one typed line
naming the other side, within the configured timeouts, never XLA's heartbeat abort (SIGABRT);
with the link back and the tasks run again in their namespaces, the job resumes from its
checkpoint and finishes.

Needs root and iproute2 (``ip netns``); skips with the reason elsewhere. CPU only: no
accelerator needed (one forced CPU device per process)."""

import time

import pytest
from devutil import PRECISE

from jaxdist.testing import python_command
from jaxdist.testing.netns import (
    NetnsCluster,
    NetnsUnavailable,
    NetworkNamespaces,
    sweep_stale,
    unavailable_reason,
)

pytestmark = pytest.mark.slow

TIMEOUT = 6  # strategy.timeout_seconds; the heartbeat timeout is half of it (3 s)
HEARTBEAT = TIMEOUT // 2
ABORTS = ("Check failure", "detected fatal errors", "terminate called", "*** ", "Traceback")

MW_CONFIG = """\
seed: 0
strategy: {{name: multi_worker, timeout_seconds: {timeout}}}
data: {{name: digits, validation_split: 0.2}}
model: {{name: mlp, hidden_sizes: [32]}}
optimizer: {{name: adamw, learning_rate: 0.003}}
train: {{global_batch_size: 48, epochs: 4}}
checkpoint: {{dir: {dir}/ckpt, every_steps: 20, keep: 2}}
logging: {{dir: {dir}/logs, every_steps: 10}}
"""
MW_STEPS = 4 * 29  # 4 epochs of 1437 training examples in global batches of 48


@pytest.fixture
def net():
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    sweep_stale()  # namespaces a killed run left behind (never another live run's)
    try:
        hosts = NetworkNamespaces(3)
    except NetnsUnavailable as e:
        pytest.skip(f"cannot create network namespaces here: {e}")
    try:
        yield hosts
    finally:
        hosts.close()


def _assert_tls_for_the_hosts(c):
    """Every task speaks mutual TLS with a certificate valid for the hosts' addresses alone."""
    from cryptography import x509

    for name in c.task_names:
        with open(c.env_for(name)["JAXDIST_TLS_CERT"], "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == c.net.addresses
        assert san.get_values_for_type(x509.DNSName) == []


def _exits(c, names, timeout):
    """Waits for ``names`` to exit; returns ``{name: (code, seconds from now)}``."""
    start, out = time.monotonic(), {}
    while len(out) < len(names) and time.monotonic() - start < timeout:
        for n in names:
            if n not in out and c.tasks[n].returncode is not None:
                out[n] = (c.tasks[n].returncode, time.monotonic() - start)
        time.sleep(0.05)
    assert len(out) == len(names), f"still running after {timeout} s:\n{c.describe()}"
    return out


def _typed_lines(out, prefix):
    lines = [ln for ln in out.splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1, out
    for abort in ABORTS:
        assert abort not in out, out
    return lines[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precise", PRECISE)
def test_multi_worker_train_across_namespaces_survives_a_cut_link_and_resumes(net, tmp_path,
                                                                              precise):
    """``python -m jaxdist.train`` (MultiWorkerMirrored, configs like multi_worker.yaml) on 3
    hosts; worker:2's link goes down after the step-40 checkpoint."""
    config = tmp_path / "netns_mw.yaml"
    config.write_text(MW_CONFIG.format(timeout=TIMEOUT, dir=tmp_path))
    with NetnsCluster(net, workers=3, cwd=str(tmp_path)) as c:
        assert c.cluster == {"worker": [f"10.213.0.{i}:23001" for i in (1, 2, 3)]}
        _assert_tls_for_the_hosts(c)
        c.start(python_command("jaxdist.train", "--config", str(config)))
        c.wait_for_output("worker:0", r"^\[train\] step 40 ", 120)
        net.set_link(c.host_of["worker:2"], up=False)
        exits = _exits(c, c.task_names, 3 * TIMEOUT + 10)
        # The cut-off side: it loses the coordination service (on worker:0's host).
        code, took = exits["worker:2"]
        line = _typed_lines(c.output("worker:2"), "jaxdist.PeerLostError: worker:2: ")
        assert code == 1, c.describe()  # not -6 (XLA's SIGABRT)
        assert line.startswith("jaxdist.PeerLostError: worker:2: lost the coordination service "
                               "(worker:0 at 10.213.0.1:23001)"), line
        assert "cut off from peer task(s) worker:0, worker:1" in line
        # before XLA's abort (a wall-clock claim; the exit status above is the event)
        assert not precise or took <= HEARTBEAT, f"worker:2 took {took:.1f} s"
        # The survivors: worker:2's heartbeat stops; their blocked step ends within the
        # configured timeout (the heartbeat timeout + 1 s; 1 s for the exit to be seen).
        for survivor in ("worker:0", "worker:1"):
            code, took = exits[survivor]
            line = _typed_lines(c.output(survivor), "jaxdist.PeerLostError: ")
            assert code == 1, c.describe()
            assert line.startswith(f"jaxdist.PeerLostError: {survivor}: lost peer task(s) "
                                   f"worker:2: no heartbeat for "), line
            assert not precise or took <= TIMEOUT + 1, f"{survivor} took {took:.1f} s"
        # The link back, the tasks run again on their hosts: the job resumes and finishes.
        net.set_link(c.host_of["worker:2"], up=True)
        net.kill_all()  # what outlived its task (worker:0's coordination service)
        for name in c.task_names:
            c.restart(name)
        codes = c.join(150)
        chief = c.output("worker:0")
    assert codes == {"worker:0": 0, "worker:1": 0, "worker:2": 0}, chief
    steps = [int(ln.split()[2]) for ln in chief.splitlines() if ln.startswith("[train] step")]
    assert steps[0] > 20, chief  # resumed from a checkpoint of step 20 or 40, not step 0
    assert f"[end] step {MW_STEPS} " in chief, chief


@pytest.mark.timeout(180)
@pytest.mark.parametrize("precise", PRECISE)
def test_losing_the_host_of_the_coordination_service_is_typed_on_both_sides(net, precise):
    """worker:0's host (process 0, with the coordination service) loses its link: the two
    workers that cannot reach the service name it; worker:0 names the two it lost."""
    with NetnsCluster(net, workers=3) as c:
        c.start(python_command("jaxdist.testing.workloads", "linreg", "--steps", "100000",
                               "--sleep", "0.05", "--global-batch", "12",
                               "--timeout", str(TIMEOUT)))
        for name in c.task_names:
            c.wait_for_output(name, r"^step 3 ", 120)
        net.set_link(c.host_of["worker:0"], up=False)
        exits = _exits(c, c.task_names, 3 * TIMEOUT + 10)
        for cut_off in ("worker:1", "worker:2"):
            code, took = exits[cut_off]
            line = _typed_lines(c.output(cut_off), "jaxdist.PeerLostError: ")
            assert code == 1, c.describe()  # not -6 (XLA's SIGABRT)
            assert line.startswith(f"jaxdist.PeerLostError: {cut_off}: lost the coordination "
                                   f"service (worker:0 at 10.213.0.1:23001)"), line
            assert not precise or took <= HEARTBEAT, f"{cut_off} took {took:.1f} s"
        code, took = exits["worker:0"]
        line = _typed_lines(c.output("worker:0"), "jaxdist.PeerLostError: ")
        assert code == 1, c.describe()
        assert line.startswith("jaxdist.PeerLostError: worker:0: lost peer task(s) worker:1, "
                               "worker:2: no heartbeat for "), line
        assert not precise or took <= TIMEOUT + 1, f"worker:0 took {took:.1f} s"


PS_CONFIG = """\
seed: 0
strategy: {{name: parameter_server_coordinator, timeout: {timeout}, heartbeat_interval: 0.5,
           heartbeat_timeout: 3.0, join_timeout: 30}}
data: {{name: digits, validation_split: 0.2}}
model: {{name: mlp, hidden_sizes: [32]}}
optimizer: {{name: adam, learning_rate: 0.003}}
train: {{global_batch_size: 32, epochs: 3, steps_per_execution: 4}}
checkpoint: {{dir: {dir}/ckpt, every_steps: 20, keep: 2}}
logging: {{dir: {dir}/logs, every_steps: 10}}
"""
PS_STEPS = 3 * 44  # 3 epochs of 1437 training examples in batches of 32


@pytest.mark.timeout(240)
@pytest.mark.parametrize("precise", PRECISE)
def test_parameter_server_coordinator_job_across_namespaces_survives_a_lost_ps_host(net,
                                                                                   tmp_path,
                                                                                   precise):
    """The chief (``python -m jaxdist.train``, ClusterCoordinator), worker:0 and ps:0
    (``python -m jaxdist.server``, as ``jaxdist.launch --coordinator`` runs them) on 3 hosts;
    ps:0's link goes down after step 40. The chief names ps:0 within two timeouts; the
    servers keep serving, as TF's do (no coordination service: nothing aborts them); with the
    link back the chief runs again and resumes from the ps checkpoint."""
    config = tmp_path / "netns_ps.yaml"
    config.write_text(PS_CONFIG.format(timeout=TIMEOUT, dir=tmp_path))

    def command(job, index):
        if job == "chief":
            return python_command("jaxdist.train", "--config", str(config))
        return python_command("jaxdist.server") + (
            ["--checkpoint_root", str(tmp_path)] if job == "ps" else [])

    with NetnsCluster(net, workers=1, ps=1, chief=True, cwd=str(tmp_path),
                      env={"JAXDIST_PS_CHECKPOINT_ROOT": str(tmp_path)}) as c:
        assert c.cluster == {"chief": ["10.213.0.1:23001"], "worker": ["10.213.0.2:23001"],
                             "ps": ["10.213.0.3:23001"]}
        _assert_tls_for_the_hosts(c)
        c.start(command)
        c.wait_for_output("chief:0", r"^\[train\] step 40 ", 120)
        net.set_link(c.host_of["ps:0"], up=False)
        (code, took), = _exits(c, ["chief:0"], 3 * TIMEOUT + 10).values()
        out = c.output("chief:0")
        assert code == 1, c.describe()
        line = _typed_lines(out, "python -m jaxdist.train: training failed: ")
        assert "PSUnavailableError: ps:0 at 10.213.0.3:23001 did not answer" in line, line
        assert not precise or took <= 2 * TIMEOUT + 5, f"the chief took {took:.1f} s"
        for server in ("worker:0", "ps:0"):
            assert c.tasks[server].running(), c.describe()
        net.set_link(c.host_of["ps:0"], up=True)
        c.restart("chief:0")
        code = c.wait("chief:0", 120)
        chief = c.output("chief:0")
    assert code == 0, chief
    steps = [int(ln.split()[2]) for ln in chief.splitlines() if ln.startswith("[train] step")]
    assert steps[0] > 20, chief  # resumed from the checkpoint of step 20 or 40, not step 0
    assert f"[end] step {PS_STEPS} " in chief, chief
