"""Ray, tested for real (issue 37): a two-node Ray cluster started on this machine by ``ray
start`` (a head, and a second node with its own loopback address, 127.0.0.2), jobs run with
``python -m jaxdist.launch --backend ray --address ...``:

* a MultiWorkerMirrored and a between-graph parameter-server ``python -m jaxdist.train`` job
  train to the expected accuracy, their tasks on both nodes, each at its node's address; the
  MultiWorkerMirrored one is preempted once (SIGTERM to a task), restarted by
  ``--max-restarts`` and resumes from its checkpoint;
* every task gets its own credentials, and no secret shows in what Ray records (its state API:
  actors, tasks, jobs, placement groups, workers; every file of its session directory: logs
  included), in the launcher's output or on any process's command line;
* a ``--coordinator`` job's chief, workers and ps are actors on both nodes;
* a failing task's exit code is the launcher's; ``--max-restarts`` restarts a preempted job;
  a task whose actor dies is named (``RayTaskLostError``); Ctrl-C stops every actor (130);
* an ``--evaluator`` is an actor with the local launcher's exit handling (restarted alone,
  stopped after ``--evaluator-grace``);
* a node lost mid-run (every process of it killed) names its task (``RayTaskLostError``, exit
  1) within ``--lost-timeout``; this test comes last and starts the node again;
* ``jaxdist.ray.launch`` (the notebook entry point) starts a local Ray without an address.

Needs ``ray[default]`` (``pip install 'jaxdist[ray]'``); skips with the reason where Ray is not
installed or cannot start. CPU only: one CPU device per task.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
from process_records import process_records

from jaxdist.testing import pick_free_ports

pytestmark = [pytest.mark.slow, pytest.mark.platform("cpu")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--set", "model.hidden_sizes=[32]", "--set", "train.epochs=2",
         "--set", "logging.progress_bar=never", "--set", "logging.every_steps=10",
         "--set", "logging.dir=null"]
SECOND_NODE_IP = "127.0.0.2"


class RayCluster:
    """A head and a second node started with ``ray start``, stopped by process id."""

    def __init__(self, cpus_per_node: int = 3):
        self.marker = uuid.uuid4().hex
        self.temp_dir = tempfile.mkdtemp(prefix="jdray-", dir="/tmp")
        # above Ray's worker ports (10002-19999 by default)
        self.port, self.dashboard_port = [p for p in pick_free_ports(64) if p > 20000][:2]
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("JAXDIST_", "RAY_")) and k not in ("TF_CONFIG",)}
        self.env.update(PATH=os.path.dirname(sys.executable) + os.pathsep + self.env["PATH"],
                        PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1",
                        JAXDIST_RAY_TEST_MARKER=self.marker,
                        **_ray_auth_env(os.path.join(self.temp_dir, "auth_token")))
        self.node_ids: set[str] = set()
        self.ray = os.path.join(os.path.dirname(sys.executable), "ray")
        t0 = time.monotonic()
        self._start("--head", f"--port={self.port}", "--include-dashboard=true",
                    "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
                    f"--temp-dir={self.temp_dir}", f"--num-cpus={cpus_per_node}")
        self.address = f"127.0.0.1:{self.port}"
        self.cpus_per_node = cpus_per_node
        self.start_second_node()
        self.startup_seconds = time.monotonic() - t0

    def start_second_node(self) -> None:
        """(Re)starts the second node (a new Ray node id) and waits for two live nodes."""
        self._start(f"--address={self.address}", f"--node-ip-address={SECOND_NODE_IP}",
                    f"--num-cpus={self.cpus_per_node}")
        self._wait_nodes(2, timeout=60)

    def _start(self, *args: str) -> None:
        r = subprocess.run([self.ray, "start", "--disable-usage-stats", *args], env=self.env,
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            self.close()
            raise RuntimeError(f"ray start {' '.join(args)} failed: {r.stderr[-1500:]}")

    def _wait_nodes(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            nodes = self.state("nodes")
            if sum(1 for x in nodes if x.get("state") == "ALIVE") >= n:
                self.node_ids = {x["node_id"] for x in nodes}
                return
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"the Ray cluster did not get {n} nodes within {timeout} s")

    def state(self, what: str, detail: bool = True) -> list[dict]:
        """``ray list WHAT`` through the state API (as ``ray list`` and the dashboard do)."""
        r = subprocess.run(
            [self.ray, "list", what, "--format=json", "--limit=10000",
             f"--address=http://127.0.0.1:{self.dashboard_port}", *(["--detail"] * detail)],
            env=self.env, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            return []
        try:
            return json.loads(r.stdout)
        except ValueError:
            return []

    def pids(self) -> list[int]:
        """Every process this cluster started: each carries the marker, or (Ray's agents, which
        get an environment of their own) one of its nodes' ids, in its environment."""
        keys = [f"JAXDIST_RAY_TEST_MARKER={self.marker}".encode()]
        keys += [f"RAY_NODE_ID={node}\0".encode() for node in self.node_ids]
        out = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = f.read() + b"\0"
            except OSError:
                continue
            if any(k in environ for k in keys) and int(pid) != os.getpid():
                out.append(int(pid))
        return out

    def node_pids(self, node_id: str) -> list[int]:
        """Every process of Ray node ``node_id``: its raylet (``--node_id=`` on its command
        line), its agents (``RAY_NODE_ID`` in their environment), and their descendants (the
        node's workers and actors, and the tasks' commands)."""
        roots, parent = set(), {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = f.read() + b"\0"
                with open(f"/proc/{pid}/stat", "rb") as f:
                    parent[int(pid)] = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if f"--node_id={node_id}".encode() in cmdline or \
                    f"RAY_NODE_ID={node_id}\0".encode() in environ:
                roots.add(int(pid))
        found, grew = set(roots), True
        while grew:
            more = {p for p, pp in parent.items() if pp in found and p not in found}
            found |= more
            grew = bool(more)
        return sorted(found - {os.getpid()})

    def signal_node(self, node_id: str, sig: int = signal.SIGKILL) -> list[int]:
        """Sends ``sig`` to every process of node ``node_id``: SIGKILL is a machine lost,
        SIGSTOP one that stops answering (frozen, or cut off the network); returns the pids."""
        pids = self.node_pids(node_id)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        return pids

    def session_files(self) -> list[str]:
        """The text of every regular file under the cluster's temp dir (logs included)."""
        texts = []
        for base, _, files in os.walk(self.temp_dir):
            for name in files:
                path = os.path.join(base, name)
                if os.path.isfile(path) and not os.path.islink(path):
                    try:
                        with open(path, "rb") as f:
                            texts.append(f.read().decode("latin-1"))
                    except OSError:
                        continue
        return texts

    def close(self) -> None:
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
            pids = self.pids()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            deadline = time.monotonic() + wait
            while pids and self.pids() and time.monotonic() < deadline:
                time.sleep(0.2)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _ray_auth_env(token_path: str) -> dict[str, str]:
    """Ray's token authentication on, with a token of the test's own (no ``~/.ray``)."""
    import secrets

    if not os.path.exists(token_path):
        fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path,
            "RAY_USAGE_STATS_ENABLED": "0"}


def _unavailable_reason() -> str | None:
    try:
        import ray  # noqa: F401
    except ImportError:
        return "Ray is not installed: pip install 'jaxdist[ray]'"
    if not os.path.exists(os.path.join(os.path.dirname(sys.executable), "ray")):
        return "the `ray` command is not next to this Python"
    return None


@pytest.fixture(scope="module")
def ray_cluster():
    reason = _unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    try:
        cluster = RayCluster()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"a two-node Ray cluster cannot start here: {e}")
    try:
        yield cluster
    finally:
        cluster.close()


def _launch(cluster, cwd, *args: str, timeout: float = 150, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxdist.launch", "--backend", "ray",
                           "--address", cluster.address, "--grace", "3", *args],
                          cwd=str(cwd), env=cluster.env, capture_output=True, text=True,
                          timeout=timeout, **kw)


def _placed(out: str) -> dict[str, tuple[str, str]]:
    """task -> (node address, Ray node id), from the launcher's lines."""
    return {m[0]: (m[1], m[2]) for m in re.findall(
        r"^\[launch\] (\S+) runs on node (\S+) \(Ray node (\w+),", out, re.M)}


def _assert_on_both_nodes(out: str, tasks: list[str]) -> None:
    placed = _placed(out)
    assert sorted(placed) == sorted(tasks), out[-3000:]
    assert len({node_id for _, node_id in placed.values()}) == 2, placed
    assert SECOND_NODE_IP in {addr for addr, _ in placed.values()}, placed
    config = re.search(r"^\[launch\] started .* on (\{.*\})$", out, re.M)
    cluster = json.loads(config.group(1).replace("'", '"'))
    for name, (addr, _) in placed.items():
        job, i = name.split(":")
        assert cluster[job][int(i)].rsplit(":", 1)[0] == addr, (cluster, placed)


def _val_accuracy(out: str) -> float:
    m = re.findall(r"^\[\w+:0\] \[end\] .*val_accuracy=([0-9.]+)", out, re.M)
    assert m, out[-3000:]
    return float(m[-1])


def _train(cluster, cwd, launch_args: list[str], config: str, *sets: str):
    """``python -m jaxdist.launch --backend ray LAUNCH_ARGS -- python -m jaxdist.train`` with
    a small model; returns the result (exit 0 checked) and its wall time."""
    t0 = time.monotonic()
    r = _launch(cluster, cwd, *launch_args, "--", sys.executable, "-m", "jaxdist.train",
                "--config", os.path.join(ROOT, "configs", config), *SMALL, *sets)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r, time.monotonic() - t0


def _task_pid(marker: str, job: str, index: int, timeout: float) -> int:
    """The pid of task ``job:index``'s command (a child of its actor; it carries the test
    cluster's marker and its ``TF_CONFIG`` in its environment)."""
    want = f'"task": {{"type": "{job}", "index": {index}}}'.encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = f.read()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if marker.encode() in environ and want in environ and b"jaxdist.train" in cmdline:
                return int(pid)
        time.sleep(0.2)
    raise AssertionError(f"no process of task {job}:{index} within {timeout} s")


@pytest.mark.timeout(240)
def test_a_multi_worker_job_on_both_nodes_is_preempted_restarted_and_resumes(ray_cluster,
                                                                             tmp_path):
    """worker:1 gets SIGTERM (a preemption notice) at step 10: both tasks save the agreed step
    and exit 42, ``--max-restarts 1`` restarts every task (fresh ports, new actors' calls) and
    the job resumes from that checkpoint, on both nodes again, to the expected accuracy."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxdist.launch", "--backend", "ray", "--address",
         ray_cluster.address, "--workers", "2", "--placement", "STRICT_SPREAD",
         "--max-restarts", "1", "--restart-delay", "0", "--grace", "20", "--",
         sys.executable, "-m", "jaxdist.train", "--config",
         os.path.join(ROOT, "configs", "multi_worker.yaml"), *SMALL,
         "--set", "train.epochs=4", "--set", "logging.every_steps=5",
         "--set", "strategy.timeout_seconds=30", "--set", "checkpoint.dir=ckpt",
         "--set", "checkpoint.every_steps=100000"],
        cwd=str(tmp_path), env=ray_cluster.env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        pid = _task_pid(ray_cluster.marker, "worker", 1, timeout=60)
        lines: list[str] = []
        while not lines or not lines[-1].startswith("[worker:0] [train] step 10 "):
            line = proc.stdout.readline()
            assert line, "".join(lines)[-3000:]
            lines.append(line)
        os.kill(pid, signal.SIGTERM)
        out = "".join(lines) + proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, out[-3000:]
    assert re.search(r"^\[launch\] worker:[01] exited with 42 \(preempted\); restart 1 of 1: "
                     r"restarting every task \(worker:0, worker:1\)", out, re.M), out[-3000:]
    stopped = re.search(r"stopped before step (\d+): the checkpoint of step \1 is written", out)
    assert stopped, out[-3000:]
    assert f"Resumed from checkpoint at step {stopped.group(1)} " in out, out[-3000:]
    assert out.count("[launch] started ") == 2
    _assert_on_both_nodes(out, ["worker:0", "worker:1"])
    assert "MultiWorkerMirroredStrategy with 2 replica(s) on 2 cpu device(s), 2 process(es)" \
        in out
    assert re.search(r"^\[worker:0\] \[end\] step 88 ", out, re.M), out[-2000:]
    assert _val_accuracy(out) >= 0.7, out[-2000:]
    assert out.rstrip().endswith("[launch] all training tasks finished")
    print(f"ray up in {ray_cluster.startup_seconds:.1f} s; multi-worker job, preempted and "
          f"resumed, {wall:.1f} s")


@pytest.mark.timeout(200)
def test_a_parameter_server_job_trains_across_both_nodes(ray_cluster, tmp_path):
    r, wall = _train(ray_cluster, tmp_path, ["--workers", "2", "--ps", "1"],
                     "parameter_server.yaml", "--set", "strategy.timeout=30")
    _assert_on_both_nodes(r.stdout, ["worker:0", "worker:1", "ps:0"])
    ps_addr = _placed(r.stdout)["ps:0"][0]
    assert re.search(rf"^\[ps:0\] jaxdist.server ps:0 listening on {re.escape(ps_addr)}:\d+$",
                     r.stdout, re.M), r.stdout[-3000:]
    assert _val_accuracy(r.stdout) >= 0.7, r.stdout[-2000:]
    print(f"parameter-server job {wall:.1f} s")


@pytest.mark.timeout(200)
def test_a_coordinator_job_runs_its_chief_workers_and_ps_across_both_nodes(ray_cluster,
                                                                          tmp_path):
    """``--coordinator``: the chief runs the program (TF2 ClusterCoordinator), the workers and
    the ps serve, each an actor; the chief schedules its steps on workers on both nodes."""
    r, wall = _train(ray_cluster, tmp_path, ["--coordinator", "--workers", "2", "--ps", "1"],
                     "parameter_server_coordinator.yaml", "--set", "strategy.timeout=30")
    _assert_on_both_nodes(r.stdout, ["chief:0", "worker:0", "worker:1", "ps:0"])
    assert _val_accuracy(r.stdout) >= 0.7, r.stdout[-2000:]
    assert r.stdout.rstrip().endswith("[launch] all training tasks finished"), r.stdout[-2000:]
    print(f"coordinator job {wall:.1f} s")


@pytest.mark.timeout(120)
def test_each_task_gets_its_own_credentials_and_ray_records_none(ray_cluster, tmp_path):
    probes, go = tmp_path / "probes", tmp_path / "go"
    probes.mkdir(mode=0o700)
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxdist.launch", "--backend", "ray", "--address",
         ray_cluster.address, "--chief", "--workers", "1", "--placement", "STRICT_SPREAD",
         "--", sys.executable, os.path.join(ROOT, "tests", "slurm_secret_probe.py"),
         str(probes), str(go)],
        cwd=str(tmp_path), env=ray_cluster.env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(probes.glob("probe-*.json"))) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        facts = {p.name[6:-5]: json.loads(p.read_text()) for p in probes.glob("probe-*.json")}
        assert sorted(facts) == ["chief", "worker"], facts
        chief, worker = facts["chief"], facts["worker"]
        for f in (chief, worker):
            assert (f["dir_mode"], f["key_mode"]) == ("0o700", "0o600")
            assert f["files"] == ["ca.pem", "cert.pem", "key.pem"]
        # the chief alone holds the coordinator token; the worker its public key and answer key
        assert "JAXDIST_COORDINATOR_TOKEN" in chief["secrets"] and not chief["has_public_key"]
        assert "JAXDIST_COORDINATOR_TOKEN" not in worker["secrets"] and worker["has_public_key"]
        assert chief["secrets"]["token"] == worker["secrets"]["token"]
        secrets = {chief["secrets"]["token"], chief["secrets"]["JAXDIST_COORDINATOR_TOKEN"],
                   worker["secrets"]["JAXDIST_COORDINATOR_ANSWER_KEY"]}
        secrets |= {ln for f in (chief, worker) for ln in f["secrets"]["tls_key"]
                    if len(ln) > 16}
        # What Ray holds about the running job: the state API (what `ray list`, `ray summary`
        # and the dashboard show), every file of the session directory (both nodes' logs, the
        # GCS's files), every process's command line (Ray's workers and daemons included) ...
        records = [json.dumps(ray_cluster.state(what)) for what in
                   ("actors", "tasks", "jobs", "placement-groups", "workers", "objects",
                    "nodes")]
        assert "TaskRunner" in records[0]           # the actors are there, and were read
        records += ray_cluster.session_files()
        # ... and every process's environment but the two tasks' commands' (the probes): not
        # the actors, Ray's workers and daemons, or the launcher.
        procs, probes_seen = process_records("slurm_secret_probe.py", "jaxdist.launch")
        records += procs
        assert probes_seen == 2
        go.touch()
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, out[-3000:]
    assert "probe chief:0 ready" in out and "probe worker:0 ready" in out
    records.append(out)
    for secret in secrets:
        for record in records:
            assert secret not in record


FLAKY = """\
import json, os, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
name = f"{task['type']}:{task['index']}"
mark = os.path.join(sys.argv[1], name.replace(":", "-"))
first = not os.path.exists(mark)
open(mark, "a").close()
print(f"{name} run {'1' if first else '2'} on pid {os.getpid()}", flush=True)
if name == "worker:1":
    sys.exit(int(sys.argv[2]) if first else int(sys.argv[3]))
if len(sys.argv) > 4 and first:
    time.sleep(float(sys.argv[4]))
"""


@pytest.mark.timeout(90)
def test_a_failing_task_gives_its_exit_code_and_max_restarts_restarts_the_job(ray_cluster,
                                                                                tmp_path):
    prog = tmp_path / "flaky.py"
    prog.write_text(FLAKY)
    (tmp_path / "a").mkdir()
    r = _launch(ray_cluster, tmp_path, "--workers", "2", "--", sys.executable, str(prog),
                str(tmp_path / "a"), "7", "0")
    assert r.returncode == 7, r.stdout + r.stderr
    assert "[launch] worker:1 failed with exit code 7; stopping the other tasks" in r.stdout
    (tmp_path / "b").mkdir()
    r = _launch(ray_cluster, tmp_path, "--workers", "2", "--max-restarts", "1",
                "--restart-delay", "0", "--", sys.executable, str(prog),
                str(tmp_path / "b"), "42", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("[launch] worker:1 exited with 42 (preempted); restart 1 of 1: restarting every "
            "task (worker:0, worker:1) in 0s") in r.stdout, r.stdout
    assert "[worker:1] worker:1 run 2" in r.stdout and "[worker:0] worker:0 run 2" in r.stdout
    assert r.stdout.count("[launch] started ") == 2
    assert r.stdout.rstrip().endswith("[launch] all training tasks finished")


@pytest.mark.timeout(120)
def test_a_lost_actor_is_named_or_restarted_and_ctrl_c_stops_every_actor(ray_cluster,
                                                                          tmp_path):
    prog = tmp_path / "flaky.py"
    prog.write_text(FLAKY)
    restart = ["--max-restarts", "1", "--restart-delay", "0"]
    for case, extra in (("lost", []), ("restarted", restart), ("interrupt", [])):
        (tmp_path / case).mkdir()
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxdist.launch", "--backend", "ray", "--address",
             ray_cluster.address, "--workers", "2", "--grace", "3", *extra, "--",
             sys.executable, str(prog), str(tmp_path / case), "0", "0", "600"],
            cwd=str(tmp_path), env=ray_cluster.env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        try:
            lines: list[str] = []
            deadline = time.monotonic() + 60
            while not any("[worker:0] worker:0 run 1" in ln for ln in lines):
                assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
                lines.append(proc.stdout.readline())
            task_pid = int(re.search(r"worker:0 run 1 on pid (\d+)", "".join(lines)).group(1))
            t0 = time.monotonic()
            if case in ("lost", "restarted"):
                actor_pid = int(re.search(r"worker:0 runs on node \S+ .*actor pid (\d+)\)",
                                          "".join(lines)).group(1))
                os.kill(actor_pid, signal.SIGKILL)
            else:
                proc.send_signal(signal.SIGINT)
            out = "".join(lines) + proc.communicate(timeout=60)[0]
        finally:  # a failed case must not leave its actors to the module's next test
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        ended_after = time.monotonic() - t0
        if case == "lost":
            assert proc.returncode == 1, out[-3000:]
            assert re.search(r"^\[launch\] worker:0 lost: RayTaskLostError: worker:0 \(Ray "
                             r"actor on node \S+\) was lost: ", out, re.M), out[-3000:]
            assert "jaxdist.launch: RayTaskLostError: worker:0 (Ray actor on node" in out
        elif case == "restarted":   # in a new actor; worker:0's second run ends at once
            assert proc.returncode == 0, out[-3000:]
            assert "[launch] worker:0 lost: RayTaskLostError: worker:0" in out, out[-3000:]
            assert "[launch] worker:0 exited with 1 (failed); restart 1 of 1: restarting " \
                "every task (worker:0, worker:1)" in out, out[-3000:]
            assert "[worker:0] worker:0 run 2" in out and out.count("[launch] started ") == 2
        else:
            assert proc.returncode == 130, out[-3000:]
            assert "[launch] interrupted (signal 2): stopping every task" in out, out[-3000:]
        assert ended_after < 30, ended_after
        # the task's process is gone with its actor, and no actor of the launch is left
        deadline = time.monotonic() + 15
        while os.path.exists(f"/proc/{task_pid}") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not os.path.exists(f"/proc/{task_pid}"), f"{case}: task {task_pid} outlived"
        alive = [a for a in ray_cluster.state("actors", detail=False)
                 if a.get("state") not in ("DEAD",)]
        assert alive == [], alive


EVALUATE = """\
import json, os, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
name = f"{task['type']}:{task['index']}"
mark = os.path.join(sys.argv[1], name.replace(":", "-"))
first = not os.path.exists(mark)
open(mark, "a").close()
print(f"{name} run {'1' if first else '2'} on pid {os.getpid()}", flush=True)
if name == "evaluator:0":
    if first:
        sys.exit(int(sys.argv[2]))
    time.sleep(600)  # evaluates until the launcher stops it (--evaluator-grace)
time.sleep(float(sys.argv[3]))
"""


@pytest.mark.timeout(90)
def test_an_evaluator_is_an_actor_restarted_alone_and_stopped_after_training(ray_cluster,
                                                                            tmp_path):
    """``--evaluator``: a side-car actor on the other node. As with local processes, its
    failure is its exit code without restarts; with ``--max-restarts`` it is restarted
    alone (same address, the training task runs once) and, still running when training has
    finished, stopped after ``--evaluator-grace``."""
    prog = tmp_path / "evaluate.py"
    prog.write_text(EVALUATE)
    (tmp_path / "a").mkdir()
    r = _launch(ray_cluster, tmp_path, "--workers", "1", "--evaluator", "--", sys.executable,
                str(prog), str(tmp_path / "a"), "5", "30")
    assert r.returncode == 5, r.stdout + r.stderr
    assert "[launch] evaluator:0 failed with exit code 5; stopping the other tasks" \
        in r.stdout, r.stdout
    (tmp_path / "b").mkdir()
    t0 = time.monotonic()
    r = _launch(ray_cluster, tmp_path, "--workers", "1", "--evaluator", "--placement",
                "STRICT_SPREAD", "--max-restarts", "1", "--restart-delay", "0",
                "--evaluator-grace", "1", "--", sys.executable, str(prog),
                str(tmp_path / "b"), "1", "4")
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    _assert_on_both_nodes(r.stdout, ["worker:0", "evaluator:0"])
    addr = _placed(r.stdout)["evaluator:0"][0]
    assert re.search(rf"^\[launch\] evaluator:0 exited with 1 \(failed\); restart 1 of 1: "
                     rf"restarting evaluator:0 on {re.escape(addr)}:\d+ in 0s$", r.stdout,
                     re.M), r.stdout
    assert "[evaluator:0] evaluator:0 run 2" in r.stdout, r.stdout
    assert "[worker:0] worker:0 run 1" in r.stdout and "worker:0 run 2" not in r.stdout
    assert r.stdout.count("[launch] started ") == 1
    assert r.stdout.rstrip().endswith("[launch] all training tasks finished")
    alive = [a for a in ray_cluster.state("actors", detail=False)
             if a.get("state") not in ("DEAD",)]
    assert alive == [], alive
    print(f"evaluator restarted alone and stopped after training: {wall:.1f} s")


@pytest.mark.timeout(120)
def test_the_python_entry_point_starts_a_local_ray_without_an_address(tmp_path):
    reason = _unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    # Each task prints its TF_CONFIG task. The ps task runs until the training tasks end (then
    # the launcher stops it), so the workers end only once it has printed (a file says so);
    # otherwise a ps that starts last may be stopped before it prints.
    task = tmp_path / "task.py"
    task.write_text(
        "import json, os, pathlib, sys, time\n"
        "task = json.loads(os.environ['TF_CONFIG'])['task']\n"
        "print(task, flush=True)\n"
        "here = pathlib.Path(sys.argv[1])\n"
        "(here / f\"{task['type']}{task['index']}.up\").touch()\n"
        "deadline = time.monotonic() + 60\n"
        "while task['type'] == 'worker' and not (here / 'ps0.up').exists() \\\n"
        "        and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n")
    code = (
        "import sys, jaxdist\n"
        f"status = jaxdist.ray.launch([sys.executable, {str(task)!r}, {str(tmp_path)!r}], "
        "workers=2, ps=1, ps_runs_command=True, cpus_per_task=0.5, grace=3)\n"
        "import ray\n"
        "print('ray still up:', ray.is_initialized())\n"
        "sys.exit(status)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PYTHONPATH=ROOT, **_ray_auth_env(str(tmp_path / "auth_token")))
    r = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), env=env,
                       capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for task in ("{'type': 'worker', 'index': 0}", "{'type': 'worker', 'index': 1}",
                 "{'type': 'ps', 'index': 0}"):
        assert task in r.stdout, r.stdout
    assert "ray still up: False" in r.stdout


# Every task runs until stopped, so the task on the lost node is running whichever it is.
SLEEPER = """\
import json, os, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
print(f"{task['type']}:{task['index']} run 1 on pid {os.getpid()}", flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_node_lost_mid_run_is_a_typed_error_naming_its_task(ray_cluster, tmp_path, how):
    """The second node goes away while a two-worker job runs, ``killed`` (every process of it
    SIGKILLed: its raylet, agents, workers, the task's actor and command) or ``hung`` (every
    one SIGSTOPped: a machine frozen or cut off, whose connections refuse nothing): the
    launcher names the task that ran there (``RayTaskLostError``, exit 1) within
    ``--lost-timeout`` and a margin, and stops every other actor. Last of the module's cluster
    tests; the node is started again."""
    lost_timeout = 10
    prog = tmp_path / "sleeper.py"
    prog.write_text(SLEEPER)
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxdist.launch", "--backend", "ray", "--address",
         ray_cluster.address, "--workers", "2", "--placement", "STRICT_SPREAD", "--grace", "3",
         "--lost-timeout", str(lost_timeout), "--", sys.executable, str(prog)],
        cwd=str(tmp_path), env=ray_cluster.env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    node_id = None
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 60
        while sum("run 1 on pid" in ln for ln in lines) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stdout.readline())
        placed = _placed("".join(lines))
        [(task, (_, node_id))] = [(t, p) for t, p in placed.items() if p[0] == SECOND_NODE_IP]
        other = next(t for t in placed if t != task)
        other_pid = int(re.search(rf"{other} run 1 on pid (\d+)", "".join(lines)).group(1))
        t0 = time.monotonic()
        gone = ray_cluster.signal_node(
            node_id, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        assert len(gone) >= 3, gone  # the raylet, the actor, the task's command at least
        out = "".join(lines) + proc.communicate(timeout=lost_timeout + 60)[0]
        ended_after = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if how == "hung" and node_id is not None:
            ray_cluster.signal_node(node_id, signal.SIGKILL)
        try:
            ray_cluster.start_second_node()
        except RuntimeError as e:
            pytest.fail(f"the second node did not start again: {e}")
    assert proc.returncode == 1, out[-3000:]
    assert re.search(rf"^\[launch\] {task} lost: RayTaskLostError: {task} \(Ray actor on node "
                     rf"{re.escape(SECOND_NODE_IP)}\) was lost: ", out, re.M), out[-3000:]
    assert f"jaxdist.launch: RayTaskLostError: {task} (Ray actor on node {SECOND_NODE_IP})" \
        in out, out[-3000:]
    assert ended_after < lost_timeout + 20, ended_after
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{other_pid}") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{other_pid}"), f"{other}'s command outlived the job"
    alive = [a for a in ray_cluster.state("actors", detail=False)
             if a.get("state") not in ("DEAD",)]
    assert alive == [], alive
    print(f"{task} named lost {ended_after:.1f} s after its node was {how} "
          f"(--lost-timeout {lost_timeout})")
