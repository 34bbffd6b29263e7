"""Slurm, tested for real (issue 37): a Slurm 22.05 cluster from the distribution's packages on
this machine (``jaxdist.testing.slurm``: munged, slurmctld and ``slurmd -N n1`` / ``-N n2``, each
node with a loopback address of its own), jobs submitted with ``sbatch``:

* the documented scripts (``configs/slurm/*.sbatch``) run as written: a MultiWorkerMirrored, a
  between-graph parameter-server and a ``ClusterCoordinator`` ``python -m jaxdist.train`` job,
  each task where Slurm put it, mutual TLS on, trained to the expected accuracy;
* every task gets its own credentials, and no secret shows in Slurm's records of the job
  (``scontrol show job``, the batch script and environment slurmctld keeps, its logs), in the
  job's output, on any process's command line, or in any environment but the tasks' commands';
* ``scancel --signal=TERM`` (what ``#SBATCH --signal=TERM@T`` sends before the time limit) and
  ``scancel --batch --signal=TERM`` (``--signal=B:TERM@T``) end in jaxdist's
  checkpoint-and-exit (42), ``python -m jaxdist.slurm`` requeues the job and the requeued job
  resumes from that checkpoint; a ``timing`` test (deselected by default) lets Slurm's own
  ``--time=2 --signal=TERM@30`` do it;
* a task that dies is reported with its exit code, and its peer ends with ``PeerLostError``
  naming it within the configured timeout; so does a whole node that goes away (its slurmd,
  step daemon and task killed), which the job reports as a task that never reported;
* a user's own script with ``SlurmClusterResolver()`` runs its all-reduce across the two
  nodes with no token or TLS setup of its own;
* the registry of cluster environments detects an ``srun`` step as Slurm and the batch
  script's own shell as no environment.

Needs root and ``slurm-wlm`` + ``munge`` (CI installs them where it can); skips with the reason
elsewhere. CPU only: one CPU device per task.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time

import pytest
from devutil import xla_flags
from process_records import process_records

from jaxdist.testing import pick_free_ports
from jaxdist.testing.slurm import LocalSlurm, SlurmUnavailable, unavailable_reason

pytestmark = [pytest.mark.slow, pytest.mark.platform("cpu")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--set", "model.hidden_sizes=[32]", "--set", "train.epochs=2",
         "--set", "logging.progress_bar=never", "--set", "logging.every_steps=10"]


@pytest.fixture
def slurm():
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    try:
        cluster = LocalSlurm(("n1", "n2"))
    except SlurmUnavailable as e:
        pytest.skip(f"a local Slurm cluster cannot start here: {e}")
    try:
        yield cluster
    finally:
        cluster.close()


def _port_base() -> int:
    """A port free on both nodes' addresses, with the next one free too."""
    for _ in range(50):
        port = pick_free_ports(1)[0]
        ok = True
        for host in ("127.0.0.1", "127.0.0.2"):
            for p in (port, port + 1):
                with socket.socket() as s:
                    try:
                        s.bind((host, p))
                    except OSError:
                        ok = False
        if ok:
            return port
    raise RuntimeError("no free port pair")


def _env(slurm, **extra: str) -> dict[str, str]:
    env = dict(slurm.env)
    for key in list(env):
        if key.startswith("JAXDIST_") or key in ("TF_CONFIG", "XLA_FLAGS"):
            del env[key]
    env.update(PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
               PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1",
               JAXDIST_SLURM_PORT_BASE=str(_port_base()), XLA_FLAGS=xla_flags())
    env.update(extra)
    return env


def _sbatch(slurm, cwd, env, *argv: str) -> str:
    out = slurm.run("sbatch", "--parsable", *argv, cwd=str(cwd), env=env)
    return out.stdout.strip().split(";")[0]


def _output(cwd) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(cwd.glob("slurm-*.out")))


def _wait_output(slurm, job, cwd, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, _output(cwd), re.M)
        if m:
            return m
        if slurm.job_state(job) in ("COMPLETED", "FAILED", "CANCELLED"):
            break
        time.sleep(0.2)
    raise AssertionError(f"job {job} ({slurm.job_state(job)}) never printed {pattern!r}:\n"
                         f"{_output(cwd)[-3000:]}")


def _val_accuracy(out: str) -> float:
    m = re.findall(r"^\[end\] .*val_accuracy=([0-9.]+)", out, re.M)
    assert m, out[-3000:]
    return float(m[-1])


def _ran_where_slurm_put_it(out: str, tasks: dict[str, tuple[int, str]], port: int) -> None:
    for name, (procid, node) in tasks.items():
        slot = port + sum(1 for n, (p, nd) in tasks.items() if nd == node and p < procid)
        assert f"[jaxdist.slurm] {name} (task {procid} on {node}, {node}:{slot}) started" \
            in out, out[-3000:]
        assert f"[jaxdist.slurm] {name} (task {procid} on {node}) exited with code 0" in out


@pytest.mark.timeout(300)
def test_the_multi_worker_sbatch_script_trains_across_two_nodes(slurm, tmp_path):
    env = _env(slurm, JAXDIST_CONFIG=os.path.join(ROOT, "configs", "multi_worker.yaml"))
    t0 = time.monotonic()
    job = _sbatch(slurm, tmp_path, env, os.path.join(ROOT, "configs/slurm/multi_worker.sbatch"),
                  *SMALL, "--set", "strategy.timeout_seconds=30")
    state = slurm.wait_job(job, timeout=240)
    wall = time.monotonic() - t0
    out = _output(tmp_path)
    assert state == "COMPLETED" and slurm.job_field(job, "ExitCode") == "0:0", out[-3000:]
    assert slurm.job_field(job, "NodeList") == "n[1-2]"
    assert slurm.job_field(job, "BatchHost") == "n1"
    port = int(env["JAXDIST_SLURM_PORT_BASE"])
    _ran_where_slurm_put_it(out, {"worker:0": (0, "n1"), "worker:1": (1, "n2")}, port)
    assert "MultiWorkerMirroredStrategy with 2 replica(s) on 2 cpu device(s), 2 process(es)" \
        in out
    assert _val_accuracy(out) >= 0.7, out[-2000:]
    assert os.listdir(tmp_path / ".jaxdist-slurm") == []       # credentials removed
    print(f"slurm up in {slurm.startup_seconds:.2f} s; multi-worker job {wall:.1f} s")


@pytest.mark.timeout(300)
def test_the_parameter_server_sbatch_script_trains_with_ps_and_two_workers(slurm, tmp_path):
    env = _env(slurm, JAXDIST_CONFIG=os.path.join(ROOT, "configs", "parameter_server.yaml"))
    t0 = time.monotonic()
    job = _sbatch(slurm, tmp_path, env,
                  os.path.join(ROOT, "configs/slurm/parameter_server.sbatch"), *SMALL,
                  "--set", "strategy.timeout=30")
    state = slurm.wait_job(job, timeout=240)
    wall = time.monotonic() - t0
    out = _output(tmp_path)
    assert state == "COMPLETED" and slurm.job_field(job, "ExitCode") == "0:0", out[-3000:]
    port = int(env["JAXDIST_SLURM_PORT_BASE"])
    _ran_where_slurm_put_it(
        out.replace(" (stopped once training was over)", ""),
        {"ps:0": (0, "n1"), "worker:0": (1, "n1"), "worker:1": (2, "n2")}, port)
    assert f"jaxdist.server ps:0 listening on n1:{port}" in out
    assert _val_accuracy(out) >= 0.7, out[-2000:]
    print(f"parameter-server job {wall:.1f} s")


@pytest.mark.timeout(300)
def test_the_cluster_coordinator_sbatch_script_runs_signed_steps_on_the_other_node(slurm,
                                                                                   tmp_path):
    env = _env(slurm, JAXDIST_CONFIG=os.path.join(
        ROOT, "configs", "parameter_server_coordinator.yaml"))
    job = _sbatch(slurm, tmp_path, env,
                  os.path.join(ROOT, "configs/slurm/parameter_server_coordinator.sbatch"),
                  *SMALL)
    state = slurm.wait_job(job, timeout=240)
    out = _output(tmp_path)
    assert state == "COMPLETED" and slurm.job_field(job, "ExitCode") == "0:0", out[-3000:]
    port = int(env["JAXDIST_SLURM_PORT_BASE"])
    _ran_where_slurm_put_it(
        out.replace(" (stopped once training was over)", ""),
        {"chief:0": (0, "n1"), "ps:0": (1, "n1"), "worker:0": (2, "n2")}, port)
    # every step ran on worker:0 (n2), from requests the chief signed
    assert re.search(r"^\[coordinator\] steps run: worker:0 88$", out, re.M), out[-2000:]
    assert "[jaxdist.slurm] worker:0 (task 2 on n2) exited with code 0 (stopped once training " \
        "was over)" in out
    assert _val_accuracy(out) >= 0.7, out[-2000:]


@pytest.mark.timeout(240)
def test_each_task_gets_its_own_credentials_and_slurm_records_none(slurm, tmp_path):
    probes, go = tmp_path / "probes", tmp_path / "go"
    probes.mkdir(mode=0o700)
    script = tmp_path / "probe.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=1 --output=slurm-%j.out\n"
        f"python -m jaxdist.slurm --jobs chief=1,worker=1 -- "
        f"python {ROOT}/tests/slurm_secret_probe.py {probes} {go}\n")
    job = _sbatch(slurm, tmp_path, _env(slurm), str(script))
    deadline = time.monotonic() + 120
    while len(list(probes.glob("probe-*.json"))) < 2 and time.monotonic() < deadline:
        assert slurm.job_state(job) not in ("FAILED", "COMPLETED"), _output(tmp_path)
        time.sleep(0.2)
    facts = {int(p.name[6:-5]): json.loads(p.read_text()) for p in probes.glob("probe-*.json")}
    assert sorted(facts) == [0, 1], _output(tmp_path)
    chief, worker = facts[0], facts[1]
    assert chief["task"] == {"type": "chief", "index": 0} and chief["node"] == "n1"
    assert worker["task"] == {"type": "worker", "index": 0} and worker["node"] == "n2"
    for f in (chief, worker):
        assert (f["dir_mode"], f["parent_mode"], f["key_mode"]) == ("0o700", "0o700", "0o600")
        assert f["files"] == ["ca.pem", "cert.pem", "key.pem"]   # secrets.json read and gone
    # The chief alone holds the coordinator token; the worker its public key and answer key.
    assert "JAXDIST_COORDINATOR_TOKEN" in chief["secrets"] and not chief["has_public_key"]
    assert "JAXDIST_COORDINATOR_TOKEN" not in worker["secrets"] and worker["has_public_key"]
    assert chief["secrets"]["token"] == worker["secrets"]["token"]
    secrets = {chief["secrets"]["token"], chief["secrets"]["JAXDIST_COORDINATOR_TOKEN"],
               worker["secrets"]["JAXDIST_COORDINATOR_ANSWER_KEY"]}
    secrets |= {ln for f in (chief, worker) for ln in f["secrets"]["tls_key"] if len(ln) > 16}
    # What Slurm holds about the running job: its record, its steps, the batch script and
    # environment slurmctld saved, every daemon's log and spool file.
    records = [slurm.run("scontrol", "show", "job", "-dd", job).stdout,
               slurm.run("scontrol", "show", "step", job).stdout,
               slurm.run("squeue", "-j", job, "-o", "%all").stdout,
               slurm.run("scontrol", "write", "batch_script", job, "-", check=False).stdout]
    for base, _, files in os.walk(slurm.directory):
        for name in files:
            path = os.path.join(base, name)
            if name != "munge.key" and os.path.isfile(path):
                with open(path, "rb") as fh:
                    records.append(fh.read().decode("latin-1"))
    assert any("jaxdist.slurm" in r for r in records)      # the script and its record are read
    # No process's command line holds a secret, and only the tasks' commands (the probes)
    # hold them in their environment: not srun, slurmstepd, the wrappers, the batch shell.
    procs, probes_seen = process_records("slurm_secret_probe.py", "jaxdist.slurm")
    records += procs
    assert probes_seen == 2
    go.touch()
    assert slurm.wait_job(job, timeout=60) == "COMPLETED", _output(tmp_path)
    records.append(_output(tmp_path))
    assert "probe chief:0 ready" in records[-1] and "probe worker:0 ready" in records[-1]
    for secret in secrets:
        for record in records:
            assert secret not in record
    assert os.listdir(tmp_path / ".jaxdist-slurm") == []


REQUEUE_SCRIPT = """\
#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --requeue --open-mode=append --output=slurm-%j.out
# runs 0 and 1 would train for ever; run 2 trains 6 epochs (132 steps) in all
if [ "${{SLURM_RESTART_COUNT:-0}}" -lt 2 ]; then EPOCHS=100000; else EPOCHS=6; fi
exec python -m jaxdist.slurm -- python -m jaxdist.train \\
    --config {root}/configs/multi_worker.yaml \\
    --set train.epochs=$EPOCHS --set model.hidden_sizes=[32] --set logging.every_steps=1 \\
    --set logging.progress_bar=never --set checkpoint.every_steps=100000 \\
    --set strategy.timeout_seconds=30
"""


@pytest.mark.timeout(420)
def test_sigterm_saves_exits_42_and_the_requeued_job_resumes_twice(slurm, tmp_path):
    """Run 0 is preempted the way ``#SBATCH --signal=TERM@T`` does it (SIGTERM to every task,
    ``scancel --signal=TERM``), run 1 the way ``--signal=B:TERM@T`` does (SIGTERM to the batch
    shell only, ``scancel --batch``: jaxdist.slurm passes it on through srun); run 2 ends."""
    script = tmp_path / "requeue.sbatch"
    script.write_text(REQUEUE_SCRIPT.format(root=ROOT))
    job = _sbatch(slurm, tmp_path, _env(slurm), str(script))
    _wait_output(slurm, job, tmp_path, r"^\[train\] step 30 ", timeout=180)
    slurm.run("scancel", "--signal=TERM", job)
    _wait_output(slurm, job, tmp_path, r"requeueing job \d+; it resumes", timeout=60)
    m = _wait_output(slurm, job, tmp_path, r"Resumed from checkpoint at step (\d+)", timeout=120)
    first = int(m.group(1))
    _wait_output(slurm, job, tmp_path, rf"^\[train\] step {first + 10} ", timeout=120)
    slurm.run("scancel", "--batch", "--signal=TERM", job)
    _wait_output(slurm, job, tmp_path, r"requeueing job \d+; it resumes[\s\S]*requeueing job",
                 timeout=60)
    deadline = time.monotonic() + 240
    while slurm.job_field(job, "Restarts") != "2" and time.monotonic() < deadline:
        time.sleep(0.3)
    assert slurm.wait_job(job, timeout=240) == "COMPLETED", _output(tmp_path)[-3000:]
    out = _output(tmp_path)
    saved = [int(x) for x in re.findall(r"stopped before step (\d+)", out)]
    resumed = [int(x) for x in re.findall(r"Resumed from checkpoint at step (\d+)", out)]
    assert len(saved) >= 2 and resumed == [saved[0], saved[-1]], (saved, resumed, out[-3000:])
    assert first == saved[0] < saved[-1] < 132
    assert out.count("[jaxdist.slurm] worker:0 (task 0 on n1) exited with code 42") == 2, out
    assert out.count("[jaxdist.slurm] worker:1 (task 1 on n2) exited with code 42") == 2, out
    assert f"job {job} (restart 1)" in out and f"job {job} (restart 2)" in out
    assert slurm.job_field(job, "Restarts") == "2"
    assert re.search(r"^\[end\] step 132 ", out, re.M), out[-2000:]
    assert _val_accuracy(out) >= 0.7


@pytest.mark.timing
@pytest.mark.timeout(300)
def test_a_preempted_parameter_server_job_exits_42_is_requeued_and_resumes(slurm, tmp_path):
    """``sbatch --requeue configs/slurm/parameter_server.sbatch`` preempted as ``--signal=TERM@T``
    does it (SIGTERM to every task, ps included): the ps keeps serving, the chief saves and
    the workers exit 42, the ps is stopped, the job is requeued and its run 1 resumes from
    that checkpoint and finishes. Marked ``timing`` (deselected by default): about 60 s, 10 s
    of it the requeue hold."""
    env = _env(slurm, JAXDIST_CONFIG=os.path.join(ROOT, "configs", "parameter_server.yaml"))
    t0 = time.monotonic()
    job = _sbatch(slurm, tmp_path, env, "--requeue",
                  os.path.join(ROOT, "configs/slurm/parameter_server.sbatch"), *SMALL,
                  "--set", "train.epochs=4", "--set", "logging.every_steps=5",
                  "--set", "strategy.timeout=30", "--set", f"checkpoint.dir={tmp_path}/ckpt",
                  "--set", "checkpoint.every_steps=100000")
    _wait_output(slurm, job, tmp_path, r"^\[train\] step 15 ", timeout=180)
    slurm.run("scancel", "--signal=TERM", job)
    _wait_output(slurm, job, tmp_path, r"requeueing job \d+; it resumes", timeout=60)
    assert slurm.wait_job(job, timeout=200) == "COMPLETED", _output(tmp_path)[-3000:]
    wall = time.monotonic() - t0
    out = _output(tmp_path)
    # the chief saves and exits 42; worker:1 too, or, still starting when the SIGTERM came
    # (before its preemption handler), it is ended by the signal: the job is requeued either way
    assert "[jaxdist.slurm] worker:0 (task 1 on n1) exited with code 42" in out, out[-3000:]
    assert re.search(r"^\[jaxdist.slurm\] worker:1 \(task 2 on n2\) (exited with code 42|was "
                     r"killed by signal 15)$", out, re.M), out[-3000:]
    assert "[jaxdist.slurm] ps:0 (task 0 on n1) exited with code 0 (stopped once training was " \
        "over)" in out, out[-3000:]
    stopped = re.search(r"stopped before step (\d+): the checkpoint of step \1 is written", out)
    assert stopped, out[-3000:]
    assert f"Resumed from checkpoint at step {stopped.group(1)} " in out, out[-3000:]
    assert re.search(r"^\[end\] step 88 ", out, re.M), out[-2000:]
    assert f"job {job} (restart 1)" in out and slurm.job_field(job, "Restarts") == "1"
    assert _val_accuracy(out) >= 0.7, out[-2000:]
    print(f"parameter-server job preempted, requeued and resumed: {wall:.1f} s")


PREEMPT_SCRIPT = """\
#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --requeue --open-mode=append --output=slurm-%j.out
#SBATCH --time=2 --signal=TERM@30
# runs 0 and 1 would train for ever; the test writes the last run's epochs to epochs.txt
EPOCHS=$(cat epochs.txt 2>/dev/null || echo 100000)
exec python -m jaxdist.slurm -- python -m jaxdist.train \\
    --config {root}/configs/multi_worker.yaml \\
    --set train.epochs=$EPOCHS --set model.hidden_sizes=[32] --set logging.every_steps=5 \\
    --set logging.progress_bar=never --set checkpoint.every_steps=100000 \\
    --set strategy.timeout_seconds=30
"""
_REQUEUED = r"requeueing job \d+; it resumes"


@pytest.mark.timing
@pytest.mark.timeout(480)
def test_the_time_limit_signal_preempts_and_the_requeued_job_resumes(slurm, tmp_path):
    """Marked ``timing`` (deselected by default; CI runs it, not gating): it waits for Slurm's
    clock, 30-90 s of training before the signal. Run 0 meets its time limit: ``#SBATCH
    --time=2 --signal=TERM@30`` makes slurmctld send SIGTERM to every task (30 s before the
    limit, or up to a minute earlier: Slurm's resolution), nobody else signals anything. Run 1
    is preempted as ``--signal=B:TERM@T`` does it (SIGTERM to the batch shell alone,
    ``scancel --batch``), which jaxdist.slurm passes on to every task. Each time every task
    saves the agreed step and exits 42, the job is requeued and resumes there; run 2
    finishes."""
    script = tmp_path / "preempt.sbatch"
    script.write_text(PREEMPT_SCRIPT.format(root=ROOT))
    t0 = time.monotonic()
    job = _sbatch(slurm, tmp_path, _env(slurm), str(script))
    _wait_output(slurm, job, tmp_path, _REQUEUED, timeout=200)
    signalled_after = time.monotonic() - t0
    slurm.run("scontrol", "update", f"JobId={job}", "TimeLimit=10")  # runs 1, 2: no limit
    first = int(re.search(r"stopped before step (\d+)", _output(tmp_path)).group(1))
    _wait_output(slurm, job, tmp_path, rf"Resumed from checkpoint at step {first} "
                 r"[\s\S]*\[train\] step \d+ [\s\S]*\[train\] step \d+ ", timeout=120)
    slurm.run("scancel", "--batch", "--signal=TERM", job)
    _wait_output(slurm, job, tmp_path, _REQUEUED + r"[\s\S]*" + _REQUEUED, timeout=60)
    second = int(re.findall(r"stopped before step (\d+)", _output(tmp_path))[-1])
    epochs = second // 22 + 2                                 # 22 steps per epoch
    (tmp_path / "epochs.txt").write_text(str(epochs))         # run 2 starts >= 10 s later
    deadline = time.monotonic() + 120
    while slurm.job_field(job, "Restarts") != "2" and time.monotonic() < deadline:
        time.sleep(0.3)
    assert slurm.wait_job(job, timeout=240) == "COMPLETED", _output(tmp_path)[-3000:]
    out = _output(tmp_path)
    assert set(re.findall(r"stopped before step (\d+)", out)) == {str(first), str(second)}
    resumed = [int(x) for x in re.findall(r"Resumed from checkpoint at step (\d+)", out)]
    assert resumed == [first, second] and first < second, (resumed, out[-3000:])
    assert "got signal 15: sending SIGTERM to every task" in out     # run 1: via the batch shell
    for task in ("worker:0 (task 0 on n1)", "worker:1 (task 1 on n2)"):
        assert out.count(f"[jaxdist.slurm] {task} exited with code 42") == 2, out[-3000:]
        assert out.count(f"[jaxdist.slurm] {task} exited with code 0") == 1, out[-3000:]
    assert f"job {job} (restart 1)" in out and f"job {job} (restart 2)" in out
    assert slurm.job_field(job, "Restarts") == "2"
    assert re.search(rf"^\[end\] step {epochs * 22} ", out, re.M), out[-2000:]
    assert _val_accuracy(out) >= 0.7
    assert signalled_after < 120                             # before the limit
    print(f"time-limit SIGTERM: requeued {signalled_after:.0f} s after sbatch; "
          f"resumed at {first}, then {second}; {time.monotonic() - t0:.0f} s in all")


@pytest.mark.timeout(240)
def test_a_killed_task_is_reported_and_its_peer_names_it_within_the_timeout(slurm, tmp_path):
    script = tmp_path / "die.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=1 --output=slurm-%j.out\n"
        f"python -m jaxdist.slurm --no-requeue -- python -m jaxdist.train --config "
        f"{ROOT}/configs/multi_worker.yaml --set train.epochs=100000 "
        f"--set model.hidden_sizes=[32] --set logging.every_steps=5 "
        f"--set logging.progress_bar=never --set strategy.timeout_seconds=10 "
        f"--set checkpoint.dir=null\n")
    job = _sbatch(slurm, tmp_path, _env(slurm), str(script))
    _wait_output(slurm, job, tmp_path, r"^\[train\] step 20 ", timeout=180)
    pid = int(re.search(r"worker:1 \(task 1 on n2, n2:\d+\) started as pid (\d+)",
                        _output(tmp_path)).group(1))
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    _wait_output(slurm, job, tmp_path, r"PeerLostError: worker:0: lost peer task\(s\) worker:1",
                 timeout=30)
    named_after = time.monotonic() - t0
    assert slurm.wait_job(job, timeout=60) == "FAILED"
    out = _output(tmp_path)
    assert "[jaxdist.slurm] worker:1 (task 1 on n2) was killed by signal 9" in out, out[-3000:]
    assert "[jaxdist.slurm] worker:0 (task 0 on n1) exited with code 1" in out, out[-3000:]
    assert slurm.job_field(job, "ExitCode") != "0:0"
    assert named_after < 10 + 5, named_after
    print(f"worker:1 named {named_after:.1f} s after its death (timeout_seconds 10)")


RESOLVER_SCRIPT = """\
import os
import numpy as np
import jax.numpy as jnp
import jaxdist
from jaxdist.cluster_resolver import SlurmClusterResolver

resolver = SlurmClusterResolver(port_base=int(os.environ["JAXDIST_SLURM_PORT_BASE"]))
strategy = jaxdist.MultiWorkerMirroredStrategy(
    cluster_resolver=resolver,
    communication_options=jaxdist.CommunicationOptions(timeout_seconds=30))
ones = strategy.experimental_distribute_values_from_function(
    lambda ctx: jnp.full((), ctx.replica_id_in_sync_group + 1, jnp.float32))
total = strategy.run(lambda v: jaxdist.get_replica_context().all_reduce("SUM", v), args=(ones,))
print(f"{resolver.task_type}:{resolver.task_id} on {os.environ['SLURMD_NODENAME']} "
      f"master {resolver.master()} sum {float(np.asarray(total.addressable_data(0)))}",
      flush=True)
"""


@pytest.mark.timeout(240)
def test_a_script_with_slurm_cluster_resolver_runs_its_all_reduce_with_no_setup(slurm, tmp_path):
    # The user: no invented token, TLS left on; jaxdist.slurm gives both.
    (tmp_path / "train.py").write_text(RESOLVER_SCRIPT)
    script = tmp_path / "resolver.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=1 --output=slurm-%j.out\n"
                      "python -m jaxdist.slurm -- python train.py\n")
    env = _env(slurm)
    job = _sbatch(slurm, tmp_path, env, str(script))
    assert slurm.wait_job(job, timeout=180) == "COMPLETED", _output(tmp_path)[-3000:]
    out, port = _output(tmp_path), env["JAXDIST_SLURM_PORT_BASE"]
    assert f"worker:0 on n1 master grpc://n1:{port} sum 3.0" in out, out[-3000:]
    assert f"worker:1 on n2 master grpc://n2:{port} sum 3.0" in out, out[-3000:]


DETECT = ("from jaxdist._src.cluster.auto_detect import detect_environment as d; import os; "
          "e = d(); print(os.environ.get('SLURMD_NODENAME'), '{where}', e and e.name)")


def test_the_environment_registry_detects_a_job_step_and_not_the_batch_shell(slurm, tmp_path):
    """``auto_detect``'s Slurm environment, as Slurm sets it: an ``srun`` step (both of its
    tasks) is detected, the batch script's own shell (which has ``SLURM_PROCID`` too) is not."""
    script = tmp_path / "detect.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=1 --output=slurm-%j.out\n"
                      f"python -c \"{DETECT.format(where='batch')}\"\n"
                      f"srun python -c \"{DETECT.format(where='step')}\"\n")
    job = _sbatch(slurm, tmp_path, _env(slurm), str(script))
    assert slurm.wait_job(job, timeout=120) == "COMPLETED", _output(tmp_path)[-3000:]
    out = _output(tmp_path)
    assert "n1 batch None" in out, out[-3000:]
    assert "n1 step slurm" in out and "n2 step slurm" in out, out[-3000:]


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.timeout(300)
def test_a_lost_node_is_named_by_its_peer_within_the_timeout(slurm, tmp_path):
    script = tmp_path / "node.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=1 --no-requeue --output=slurm-%j.out\n"
        f"python -m jaxdist.slurm -- python -m jaxdist.train --config "
        f"{ROOT}/configs/multi_worker.yaml --set train.epochs=100000 "
        f"--set model.hidden_sizes=[32] --set logging.every_steps=5 "
        f"--set logging.progress_bar=never --set strategy.timeout_seconds=10 "
        f"--set checkpoint.dir=null\n")
    job = _sbatch(slurm, tmp_path, _env(slurm), str(script))
    _wait_output(slurm, job, tmp_path, r"^\[train\] step 20 ", timeout=180)
    pid = int(re.search(r"worker:1 \(task 1 on n2, n2:\d+\) started as pid (\d+)",
                        _output(tmp_path)).group(1))
    wrapper = _ppid(pid)
    stepd = _ppid(wrapper)
    with open(f"/proc/{stepd}/cmdline", "rb") as f:
        assert b"slurmstepd" in f.read()
    # node n2 goes away at once: its slurmd, its step daemon, the task and its wrapper
    t0 = time.monotonic()
    slurm.stop_node("n2")
    for p in (stepd, wrapper, pid):
        os.kill(p, signal.SIGKILL)
    _wait_output(slurm, job, tmp_path, r"PeerLostError: worker:0: lost peer task\(s\) worker:1",
                 timeout=30)
    named_after = time.monotonic() - t0
    _wait_output(slurm, job, tmp_path,
                 r"worker:0 \(task 0 on n1\) exited with code 1", timeout=30)
    state = slurm.wait_job(job, timeout=120)
    ended_after = time.monotonic() - t0
    out = _output(tmp_path)
    assert state in ("FAILED", "NODE_FAIL"), (state, out[-3000:])
    assert named_after < 10 + 5, named_after
    assert "[jaxdist.slurm] worker:1 (task 1 on n2) did not report an exit code: its process " \
        "or node was lost" in out, out[-3000:]
    assert "Traceback" not in out and "Check failure" not in out
    print(f"lost node: worker:1 named after {named_after:.1f} s, job {state} after "
          f"{ended_after:.1f} s;\n{out[-1500:]}")
