"""``python -m jaxdist.launch --max-restarts N``: which exits restart which tasks, how often.

Tiny programs as tasks (a file per task remembers how often it ran), real launcher processes on
127.0.0.1; the real training restarts are in ``tests/test_restart_training.py``.
"""

import ast
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: worker:1 exits with $CODE (or kills itself with $SIGNAL) on its first $FAILS runs.
FLAKY = textwrap.dedent("""
    import json, os, signal, sys, time
    config = json.loads(os.environ["TF_CONFIG"])
    t = config["task"]
    name = f"{t['type']}:{t['index']}"
    mem = os.path.join(os.environ["MEM"], name.replace(":", "-"))
    runs = int(open(mem).read()) if os.path.exists(mem) else 0
    open(mem, "w").write(str(runs + 1))
    print("run", runs + 1, json.dumps(config), flush=True)
    if name == "worker:1" and runs < int(os.environ.get("FAILS", "1")):
        if os.environ.get("SIGNAL"):
            os.kill(os.getpid(), int(os.environ["SIGNAL"]))
        sys.exit(int(os.environ.get("CODE", "42")))
    time.sleep(float(os.environ.get("SLEEP", "0")))
    sys.exit(int(os.environ.get("THEN", "0")) if runs else 0)   # a restarted run's exit code
""")


def _launch(tmp_path, *args, timeout=60, **env):
    mem = tmp_path / "mem"
    mem.mkdir(exist_ok=True)
    env = dict(os.environ, MEM=str(mem), **{k: str(v) for k, v in env.items()})
    return subprocess.run([sys.executable, "-m", "jaxdist.launch", "--grace", "2", *args, "--",
                           sys.executable, "-c", FLAKY], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _runs(tmp_path, name):
    path = tmp_path / "mem" / name.replace(":", "-")
    return int(path.read_text()) if path.exists() else 0


def _configs(out, name):
    """The TF_CONFIG of each run of task ``name``, in order."""
    return [json.loads(m) for m in re.findall(rf"^\[{name}\] run \d+ (.*)$", out, re.M)]


@pytest.mark.timeout(60)
def test_a_preempted_task_restarts_every_task_of_a_sync_job_on_a_fresh_cluster(tmp_path):
    r = _launch(tmp_path, "--workers", "2", "--max-restarts", "3", "--restart-delay", "0.5")
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("[launch] worker:1 exited with 42 (preempted); restart 1 of 3: restarting every "
            "task (worker:0, worker:1) in 0.5s") in r.stdout, r.stdout
    assert _runs(tmp_path, "worker:0") == _runs(tmp_path, "worker:1") == 2
    first, second = _configs(r.stdout, "worker:0")
    # new ports (a new coordination service) and a new cluster token; the same task list
    assert set(first["cluster"]["worker"]).isdisjoint(second["cluster"]["worker"])
    assert first["token"] != second["token"]
    assert _configs(r.stdout, "worker:1")[1] == dict(second, task={"type": "worker", "index": 1})
    assert r.stdout.count("[launch] started ") == 2
    assert r.stdout.rstrip().endswith("[launch] all training tasks finished")


@pytest.mark.timeout(60)
def test_a_restarted_job_whose_checkpoint_is_already_complete_is_done(tmp_path):
    """The run before the restart finished the training (exit 3 after a restart: done, 0);
    a first run that exits 3 (a rerun of a finished config) keeps its 3."""
    r = _launch(tmp_path, "--workers", "2", "--max-restarts", "1", "--restart-delay", "0",
                THEN=3)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[launch] the restarted job's checkpoint already completes its training (exit 3)" \
        in r.stdout, r.stdout
    assert r.stdout.rstrip().endswith("[launch] all training tasks finished")
    again = tmp_path / "again"
    (again / "mem").mkdir(parents=True)
    for name in ("worker-0", "worker-1"):
        (again / "mem" / name).write_text("1")   # as if each had run once: both exit 3 now
    r = _launch(again, "--workers", "2", "--max-restarts", "1", FAILS=0, THEN=3)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "worker:" in r.stdout and "failed with exit code 3" in r.stdout, r.stdout


@pytest.mark.timeout(60)
def test_after_n_restarts_the_launcher_stops_with_the_last_failing_code(tmp_path):
    r = _launch(tmp_path, "--workers", "2", "--max-restarts", "2", "--restart-delay", "0",
                FAILS=10, CODE=1)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "restart 1 of 2" in r.stdout and "restart 2 of 2" in r.stdout
    assert "restart 3 of" not in r.stdout
    assert ("[launch] worker:1 failed with exit code 1 (failed; no restart left: 2 of 2 used); "
            "stopping the other tasks") in r.stdout, r.stdout
    assert _runs(tmp_path, "worker:1") == 3


@pytest.mark.timeout(60)
def test_a_task_killed_by_a_signal_is_restarted(tmp_path):
    r = _launch(tmp_path, "--workers", "2", "--max-restarts", "1", "--restart-delay", "0",
                SIGNAL=int(signal.SIGKILL))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[launch] worker:1 exited with 137 (killed by SIGKILL); restart 1 of 1" in r.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code", [2, 130])
def test_a_bad_config_or_an_interrupt_is_never_restarted(tmp_path, code):
    r = _launch(tmp_path, "--workers", "2", "--max-restarts", "3", CODE=code)
    assert r.returncode == code, r.stdout + r.stderr
    assert "restart 1" not in r.stdout
    assert _runs(tmp_path, "worker:1") == 1
    assert f"[launch] worker:1 failed with exit code {code} (" in r.stdout


@pytest.mark.timeout(60)
def test_without_max_restarts_a_preempted_task_ends_the_job_with_its_code(tmp_path):
    r = _launch(tmp_path, "--workers", "2")
    assert r.returncode == 42, r.stdout + r.stderr
    assert "[launch] worker:1 failed with exit code 42; stopping the other tasks" in r.stdout
    assert _runs(tmp_path, "worker:1") == 1


@pytest.mark.timeout(60)
def test_an_evaluator_is_restarted_alone(tmp_path):
    """A side-car evaluator that fails is restarted by itself: the training tasks go on."""
    prog = FLAKY.replace('name == "worker:1"', 'name == "evaluator:0"')
    mem = tmp_path / "mem"
    mem.mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "jaxdist.launch", "--workers", "1", "--evaluator",
         "--max-restarts", "1", "--restart-delay", "0", "--grace", "2", "--", sys.executable,
         "-c", prog], capture_output=True, text=True, timeout=50,
        env=dict(os.environ, MEM=str(mem), SLEEP="3", CODE="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"evaluator:0 exited with 1 \(failed\); restart 1 of 1: restarting "
                     r"evaluator:0 on 127\.0\.0\.1:\d+ in 0s", r.stdout), r.stdout
    assert _runs(tmp_path, "worker:0") == 1 and _runs(tmp_path, "evaluator:0") == 2


@pytest.mark.parametrize("value", ["-1", "x", "1.5"])
def test_max_restarts_must_be_a_whole_number_of_at_least_zero(value):
    r = subprocess.run([sys.executable, "-m", "jaxdist.launch", "--max-restarts", value, "--",
                        "true"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.splitlines()[-1] == (
        f"python -m jaxdist.launch: error: argument --max-restarts: expected a whole number "
        f">= 0, got '{value}'")


def test_the_launcher_api_refuses_a_negative_number_of_restarts():
    from jaxdist.launch import Launcher

    with pytest.raises(ValueError, match=r"max_restarts must be a whole number >= 0, got -2"):
        Launcher(["python", "x.py"], max_restarts=-2)


@pytest.mark.timeout(60)
def test_ctrl_c_during_the_restart_delay_stops_everything_without_restarting(tmp_path):
    mem = tmp_path / "mem"
    mem.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxdist.launch", "--workers", "2", "--max-restarts", "5",
         "--restart-delay", "30", "--grace", "2", "--", sys.executable, "-c", FLAKY],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, MEM=str(mem), SLEEP="60"))
    lines = []
    deadline = time.monotonic() + 30
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        lines.append(proc.stdout.readline())
        if "restart 1 of 5" in lines[-1]:
            break
    assert "restart 1 of 5" in lines[-1], "".join(lines)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=20)
    out = "".join(lines) + out
    assert proc.returncode == 130, out
    assert "[launch] interrupted (signal 2): stopping every task" in out
    assert out.count("[launch] started ") == 1, out
    assert _runs(tmp_path, "worker:0") == _runs(tmp_path, "worker:1") == 1


@pytest.mark.timeout(60)
def test_ctrl_c_while_tasks_run_stops_everything_without_restarting(tmp_path):
    mem = tmp_path / "mem"
    mem.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxdist.launch", "--workers", "2", "--max-restarts", "5",
         "--grace", "5", "--", sys.executable, "-c", FLAKY],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, MEM=str(mem), SLEEP="60", FAILS="0"))
    deadline = time.monotonic() + 30
    while (_runs(tmp_path, "worker:0") + _runs(tmp_path, "worker:1") < 2
           and time.monotonic() < deadline):
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 130, out
    assert "restart" not in out and out.count("[launch] started ") == 1, out


@pytest.mark.timeout(120)
def test_under_a_coordinator_a_killed_worker_is_restarted_alone_on_its_address():
    """TF2 ``ClusterCoordinator``: the chief tolerates the lost worker (its functions in
    flight run again elsewhere); the launcher restarts that worker alone, on the same address,
    and the chief sends it work again. No chief or ps restart, no function lost."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(
        [sys.executable, "-m", "jaxdist.launch", "--coordinator", "--workers", "2", "--ps", "1",
         "--devices-per-process", "1", "--grace", "3", "--max-restarts", "1",
         "--restart-delay", "0.5", "--", sys.executable,
         os.path.join(ROOT, "tests", "restart_coordinator_chief.py")],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=110)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    cluster = re.search(r"^\[launch\] started chief:0, worker:0, worker:1, ps:0 on (.*)$",
                        r.stdout, re.M)
    assert cluster, out[-4000:]
    address = ast.literal_eval(cluster.group(1))["worker"][1]
    assert (f"[launch] worker:1 exited with 137 (killed by SIGKILL); restart 1 of 1: "
            f"restarting worker:1 on {address} in 0.5s") in r.stdout, out[-4000:]
    assert r.stdout.count("[launch] started ") == 1   # nothing else restarted
    assert r.stdout.count(f"[worker:1] jaxdist.server worker:1 listening on {address}") == 2
    result = json.loads(re.findall(r"^\[chief:0\] (\{.*\})$", r.stdout, re.M)[-1])
    assert result["new"] and result["old"] not in result["new"], result
    assert result["step"] >= result["scheduled"], result   # every function ran
    assert r.stdout.rstrip().endswith("[launch] all training tasks finished")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("saves", [True, False])
def test_sigterm_to_the_launcher_exits_42_when_every_task_saved_and_asked_for_a_restart(
        tmp_path, saves):
    """SIGTERM to the launcher (a preempted host) reaches every task; when each saves and
    exits 42, so does the launcher (a scheduler restarts it); otherwise 143. Never a restart
    by the launcher itself."""
    prog = textwrap.dedent("""
        import os, signal, sys, time
        code = int(os.environ["ON_SIGTERM"])
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(code))
        open(os.path.join(os.environ["MEM"], str(os.getpid())), "w").close()
        time.sleep(60)
    """)
    mem = tmp_path / "mem"
    mem.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxdist.launch", "--workers", "2", "--max-restarts", "3",
         "--grace", "5", "--", sys.executable, "-c", prog],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, MEM=str(mem), ON_SIGTERM="42" if saves else "143"))
    deadline = time.monotonic() + 30
    while len(os.listdir(mem)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == (42 if saves else 143), out
    assert "restart 1" not in out and out.count("[launch] started ") == 1, out
    assert ("every training task saved and exited with 42" in out) == saves, out


@pytest.mark.timeout(60)
def test_after_a_42_the_other_tasks_get_the_grace_period_to_save_and_exit_on_their_own(
        tmp_path):
    """A preempted job's tasks all exit 42 after the chief's save: the launcher lets the slower
    ones finish (up to --grace seconds) before it stops them; a SIGTERM would cut the save."""
    prog = textwrap.dedent("""
        import json, os, signal, sys, time
        t = json.loads(os.environ["TF_CONFIG"])["task"]
        mem = os.environ["MEM"]
        ran = os.path.join(mem, f"ran{t['index']}")  # each task's own: no start-order race
        first = not os.path.exists(ran)
        open(ran, "a").close()
        signal.signal(signal.SIGTERM, lambda *_: (open(os.path.join(mem, "sigterm"), "w")
                                                 .close(), sys.exit(143)))
        if first:
            time.sleep(0.2 if t["index"] == 1 else 2.0)   # worker:0 saves for 2 s
            sys.exit(42)
    """)
    mem = tmp_path / "mem"
    mem.mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "jaxdist.launch", "--workers", "2", "--max-restarts", "1",
         "--restart-delay", "0", "--grace", "10", "--", sys.executable, "-c", prog],
        capture_output=True, text=True, timeout=50, env=dict(os.environ, MEM=str(mem)))
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("[launch] worker:1 exited with 42 (preempted); restart 1 of 1: restarting every "
            "task (worker:0, worker:1) in 0s once worker:0 saved and exited (at most 10s, then "
            "stopped)") in r.stdout, r.stdout
    assert not (mem / "sigterm").exists(), r.stdout   # worker:0 exited on its own
