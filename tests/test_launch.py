"""``python -m jaxdist.launch``: per-task TF_CONFIG, prefixed output, exit codes."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

PROBE = textwrap.dedent("""
    import json, os, sys
    c = json.loads(os.environ["TF_CONFIG"])
    t = c["task"]
    print("hello", t["type"], t["index"], len(c["cluster"]["worker"]),
          c["token"] == os.environ["JAXDIST_CLUSTER_TOKEN"], os.environ["JAX_NUM_CPU_DEVICES"],
          flush=True)
    import time
    ready = os.environ.get("PS_READY")        # a file the ps creates once it has printed
    if t["type"] == "ps":
        if ready:
            open(ready, "w").close()
        time.sleep(600)                       # with --ps-runs-command: serve until stopped
    deadline = time.monotonic() + 60          # the job ends (and stops the ps) only after the
    while ready and not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.05)                      # ps printed, however slowly it started
    sys.exit(int(os.environ.get("FAIL_CODE", "0")) if t == {"type": "worker", "index": 1}
             else 0)
""")


def _launch(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "jaxdist.launch", *args], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, **(env or {})))


@pytest.mark.timeout(90)
def test_launch_runs_every_task_with_prefixed_output(tmp_path):
    r = _launch("--workers", "2", "--chief", "--ps", "1", "--devices-per-process", "2",
                "--grace", "2", "--ps-runs-command", "--", sys.executable, "-c", PROBE,
                env={"PS_READY": str(tmp_path / "ps-ready")})
    assert r.returncode == 0, r.stdout + r.stderr
    for line in ("[chief:0] hello chief 0 2 True 2", "[worker:0] hello worker 0 2 True 2",
                 "[worker:1] hello worker 1 2 True 2", "[ps:0] hello ps 0 2 True 2"):
        assert line in r.stdout, r.stdout
    assert "[launch] all training tasks finished" in r.stdout


@pytest.mark.timeout(90)
def test_launch_propagates_a_failing_exit_code_and_stops_the_others():
    r = _launch("--workers", "2", "--ps", "1", "--grace", "2", "--", sys.executable, "-c", PROBE,
                env={"FAIL_CODE": "7"})
    assert r.returncode == 7, r.stdout + r.stderr
    assert "[launch] worker:1 failed with exit code 7" in r.stdout


def test_launch_without_command_is_a_usage_error():
    r = _launch("--workers", "2")
    assert r.returncode == 2 and "no command given" in r.stderr


@pytest.mark.timeout(120)
def test_launch_multi_worker_training_end_to_end(tmp_path):
    out = tmp_path / "w.json"
    r = _launch("--workers", "2", "--devices-per-process", "1", "--", sys.executable, "-m",
                "jaxdist.testing.workloads", "linreg", "--steps", "4", "--out", str(out),
                "--timeout", "30", env={"JAX_PLATFORMS": "cpu"}, timeout=110)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[worker:0] done" in r.stdout and "[worker:1] done" in r.stdout
    assert out.exists()  # written by the chief (worker 0) only


def _processes_with(marker: str) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


@pytest.mark.timeout(60)
def test_ctrl_c_stops_every_task():
    import signal
    import time
    import uuid

    marker = f"jaxdist-ctrl-c-{uuid.uuid4().hex}"
    script = f"import time; print('up', flush=True); time.sleep(120)  # {marker}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxdist.launch", "--workers", "2", "--ps", "1", "--grace", "2",
         "--", sys.executable, "-c", script],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.monotonic() + 30
    while len(_processes_with(marker)) < 2 + 1 and time.monotonic() < deadline:
        time.sleep(0.2)  # 2 workers (+ the launcher, whose argv carries the script too)
    assert len(_processes_with(marker)) >= 3, "the tasks did not start"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode != 0, out
    deadline = time.monotonic() + 10
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_with(marker), f"tasks left running after Ctrl-C:\n{out}"


SECURITY_PROBE = textwrap.dedent("""
    import json, os, stat
    t = json.loads(os.environ["TF_CONFIG"])["task"]
    name = f"{t['type']}:{t['index']}"
    ca, cert, key = (os.environ.get(k) for k in
                     ("JAXDIST_TLS_CA", "JAXDIST_TLS_CERT", "JAXDIST_TLS_KEY"))
    if ca:
        from cryptography import x509
        cn = x509.load_pem_x509_certificate(open(cert, "rb").read()).subject.rfc4514_string()
        mode = oct(stat.S_IMODE(os.stat(os.path.dirname(key)).st_mode))
        print("tls", name, cn, mode, oct(stat.S_IMODE(os.stat(key).st_mode)),
              os.path.dirname(key))
    print("creds", name, os.environ.get("JAXDIST_INSECURE"),
          "JAXDIST_COORDINATOR_TOKEN" in os.environ,
          "JAXDIST_COORDINATOR_PUBLIC_KEY" in os.environ,
          "JAXDIST_COORDINATOR_ANSWER_KEY" in os.environ)
""")


@pytest.mark.timeout(90)
def test_launch_gives_each_task_its_own_certificate_in_a_private_dir_removed_at_exit():
    r = _launch("--workers", "1", "--chief", "--grace", "2", "--", sys.executable, "-c",
                SECURITY_PROBE, env={"JAXDIST_INSECURE": "1"})  # inherited: ignored
    assert r.returncode == 0, r.stdout + r.stderr
    tls = [ln.split()[2:] for ln in r.stdout.splitlines() if " tls " in ln]
    assert sorted((n, cn, d, k) for n, cn, d, k, _ in tls) == [
        ("chief:0", "OU=chief,CN=chief:0", "0o700", "0o600"),
        ("worker:0", "OU=worker,CN=worker:0", "0o700", "0o600")]
    assert not os.path.exists(tls[0][4])  # the keys are gone with the launcher
    assert "[chief:0] creds chief:0 None True False False" in r.stdout  # the token
    # A worker: the chief's public key and its own answer key, never the token.
    assert "[worker:0] creds worker:0 None False True True" in r.stdout


@pytest.mark.timeout(90)
def test_launch_insecure_is_plaintext_and_issues_no_certificate():
    r = _launch("--insecure", "--workers", "1", "--grace", "2", "--", sys.executable, "-c",
                SECURITY_PROBE)
    assert r.returncode == 0, r.stdout + r.stderr
    assert " tls " not in r.stdout and "[worker:0] creds worker:0 1 " in r.stdout


def test_who_runs_what():
    """ps tasks run a server with the checkpoint root; between-graph every worker runs the
    command, with --coordinator the chief does and the workers serve; jaxdist.train (or
    --ps-runs-command) serves its own ps tasks."""
    from jaxdist.launch import Launcher

    cmd = ["python", "train.py"]
    between = Launcher(cmd, workers=2, ps=2, checkpoint_root="/runs/x")
    assert between.argv_for("ps") == [sys.executable, "-m", "jaxdist.server",
                                      "--checkpoint_root", "/runs/x"]
    assert between.argv_for("worker") == cmd
    coord = Launcher(cmd, workers=2, ps=1, coordinator=True, checkpoint_root="/runs/x")
    assert coord.argv_for("chief") == cmd
    assert coord.argv_for("worker") == [sys.executable, "-m", "jaxdist.server"]
    assert coord.argv_for("ps")[-2:] == ["--checkpoint_root", "/runs/x"]
    train = ["python", "-m", "jaxdist.train", "--config", "configs/parameter_server.yaml"]
    assert Launcher(train, workers=2, ps=2).argv_for("ps") == train
    assert Launcher(train, workers=2, ps=1, coordinator=True).argv_for("ps")[1:3] == [
        "-m", "jaxdist.server"]   # the coordinated Trainer restores from the chief
    assert Launcher(cmd, workers=1, ps=1, ps_runs_command=True).argv_for("ps") == cmd


def test_the_checkpoint_root_defaults_to_the_environment_then_the_working_directory(
        monkeypatch, tmp_path):
    from jaxdist.launch import Launcher

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("JAXDIST_PS_CHECKPOINT_ROOT", raising=False)
    assert Launcher(["x"], ps=1).checkpoint_root == str(tmp_path)
    monkeypatch.setenv("JAXDIST_PS_CHECKPOINT_ROOT", "rel/root")
    assert Launcher(["x"], ps=1).checkpoint_root == str(tmp_path / "rel" / "root")
    assert Launcher(["x"], ps=1, checkpoint_root="/a/b").checkpoint_root == "/a/b"


BETWEEN_GRAPH = textwrap.dedent("""
    import json, os
    import numpy as np
    import jaxdist
    from jaxdist.ps import optimizers as O
    s = jaxdist.ParameterServerStrategy(timeout=60.0)
    with s.scope():
        v = s.create_variables({"w": np.zeros(3, np.float32)}, O.sgd(-1.0), name="m")
    v.apply_gradients({"w": np.ones(3, np.float32)})
    if s.extended.should_checkpoint:
        print("saved", json.dumps(s.extended.save("ckpts/run1", 1)), flush=True)
        try:
            s.extended.save("elsewhere", 2)
        except Exception as e:
            print("refused", type(e).__name__, "--checkpoint-root DIR" in str(e), flush=True)
    s.extended.worker_done()
    print("worker done", flush=True)
""")


@pytest.mark.timeout(150)
def test_ps_tasks_run_as_servers_and_save_only_under_the_checkpoint_root(tmp_path):
    """``--workers 2 --ps 2 -- python train.py`` (between-graph): the ps tasks serve (they do
    not run the script), the workers train against them, and the chief's checkpoints land
    under --checkpoint-root; a directory outside it is refused, naming the flag."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = tmp_path / "ckpts"
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1",
               PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("JAXDIST_PS_CHECKPOINT_ROOT", None)
    r = subprocess.run(
        [sys.executable, "-m", "jaxdist.launch", "--workers", "2", "--ps", "2", "--grace", "3",
         "--checkpoint-root", str(root), "--", sys.executable, "-c", BETWEEN_GRAPH],
        capture_output=True, text=True, timeout=140, env=env, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    for i in (0, 1):
        assert f"[ps:{i}] jaxdist.server ps:{i} listening on" in out, out[-3000:]
        assert f"[ps:{i}] jaxdist.server ps:{i} stopped" in out, out[-3000:]
        assert f"[worker:{i}] worker done" in out
        assert (root / "run1" / f"ps-{i}" / "ckpt-1").is_dir(), out[-3000:]
    assert (root / "run1" / "checkpoint").is_file()   # the chief's pointer: the same place
    assert "[worker:0] refused PSInvalidArgumentError True" in out, out[-3000:]
    assert not (tmp_path / "elsewhere").exists()
    assert f"[launch] ps tasks checkpoint under {root}" in out
