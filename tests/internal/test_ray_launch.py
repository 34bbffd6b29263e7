"""The pure parts of ``python -m jaxdist.launch --backend ray`` (no Ray cluster): options,
layout, ``TF_CONFIG`` assembly, the task actor's environment and files, error messages.
tests/test_ray_cluster.py runs the backend on a real two-node Ray cluster."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time

import pytest

from jaxdist._src.cluster.errors import ClusterConfigError
from jaxdist._src.launch.launcher import parse_launch_args
from jaxdist._src.launch.ray_actor import TaskRunner, task_environment
from jaxdist._src.launch.ray_launch import (
    INSTALL_HINT,
    RayLauncher,
    RayTaskLostError,
    cluster_from_placement,
    forwarded_env,
    import_ray,
    placement_bundles,
)
from jaxdist._src.security.pki import TaskCA

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_command_line_takes_the_ray_options():
    args, command = parse_launch_args(
        ["--backend", "ray", "--address", "head:6379", "--workers", "2", "--ps", "1",
         "--cpus-per-task", "2", "--gpus-per-task", "0.5", "--placement", "STRICT_SPREAD",
         "--env", "A=1", "--lost-timeout", "7.5", "--", "python", "train.py"])
    assert (args.backend, args.address, args.cpus_per_task, args.gpus_per_task,
            args.placement, args.env, args.lost_timeout) == (
        "ray", "head:6379", 2.0, 0.5, "STRICT_SPREAD", ["A=1"], 7.5)
    assert command == ["python", "train.py"]
    defaults, _ = parse_launch_args(["--", "python", "x.py"])
    assert (defaults.backend, defaults.address, defaults.cpus_per_task,
            defaults.placement, defaults.lost_timeout) == ("local", None, 1.0, "SPREAD", 60.0)


@pytest.mark.parametrize("argv, message", [
    (["--backend", "slurm"], "invalid choice: 'slurm'"),
    (["--cpus-per-task", "0"], "expected a number > 0, got '0'"),
    (["--gpus-per-task", "-1"], "expected a number >= 0, got '-1'"),
    (["--placement", "STRICT_PACK"], "invalid choice: 'STRICT_PACK'"),
    (["--lost-timeout", "0"], "expected a number > 0, got '0'"),
    (["--address", "h:1", "--env", "A=1"], "--address, --env only apply to --backend ray"),
])
def test_bad_ray_options_are_usage_errors_naming_the_value(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_launch_args([*argv, "--", "python", "x.py"])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_one_bundle_per_task_with_its_resources():
    assert placement_bundles(2, 1, 0) == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert placement_bundles(1, 0.5, 2) == [{"CPU": 0.5, "GPU": 2.0}]
    with pytest.raises(ClusterConfigError, match="cpus_per_task must be a number > 0, got 0"):
        placement_bundles(1, 0)
    with pytest.raises(ClusterConfigError, match="gpus_per_task must be a number >= 0"):
        placement_bundles(1, 1, -1)


def test_tf_config_cluster_comes_from_each_actors_node_and_port():
    places = {"chief:0": ("10.0.0.1", 9000), "worker:0": ("10.0.0.2", 9000),
              "worker:1": ("fd00::3", 9001), "ps:0": ("10.0.0.1", 9001)}
    cluster = cluster_from_placement(["chief:0", "worker:0", "worker:1", "ps:0"], places)
    assert cluster == {"chief": ["10.0.0.1:9000"], "worker": ["10.0.0.2:9000", "[fd00::3]:9001"],
                       "ps": ["10.0.0.1:9001"]}
    with pytest.raises(ClusterConfigError, match="tasks worker:0 and worker:1 were both given "
                                                 "10.0.0.2:9000"):
        cluster_from_placement(["worker:0", "worker:1"],
                               {"worker:0": ("10.0.0.2", 9000), "worker:1": ("10.0.0.2", 9000)})
    with pytest.raises(ClusterConfigError, match=r"task ps:0 has no place"):
        cluster_from_placement(["ps:0"], {})


def test_forwarded_env_names_a_missing_or_bad_variable():
    assert forwarded_env(["A=1", "B"], {"B": "2"}) == {"A": "1", "B": "2"}
    assert forwarded_env(["A="], {}) == {"A": ""}
    with pytest.raises(ClusterConfigError, match="--env NOPE: NOPE is not set here"):
        forwarded_env(["NOPE"], {})
    with pytest.raises(ClusterConfigError, match="--env '1X=2': expected NAME=VALUE"):
        forwarded_env(["1X=2"], {})


def test_the_launcher_lays_out_every_mode_before_ray_is_touched():
    cmd = ["python", "train.py"]
    assert RayLauncher(cmd, workers=2).names == ["worker:0", "worker:1"]
    assert RayLauncher(cmd, workers=2, ps=1, evaluator=True).names == [
        "worker:0", "worker:1", "ps:0", "evaluator:0"]
    coord = RayLauncher(cmd, workers=1, ps=1, coordinator=True, cpus_per_task=2)
    assert coord.names == ["chief:0", "worker:0", "ps:0"]
    assert coord.bundles == [{"CPU": 2.0}] * 3
    assert coord.argv_for("worker")[1:3] == ["-m", "jaxdist.server"]     # it serves the chief
    assert coord.argv_for("chief") == cmd
    with pytest.raises(ClusterConfigError, match="placement 'ANYWHERE' is not one of SPREAD"):
        RayLauncher(cmd, placement="ANYWHERE")
    with pytest.raises(ClusterConfigError, match="at least one chief or worker task"):
        RayLauncher(cmd, workers=0)


def test_a_lost_task_error_names_the_task_and_its_node():
    e = RayTaskLostError("worker:1", "10.0.0.2", "The actor died unexpectedly")
    assert str(e) == "worker:1 (Ray actor on node 10.0.0.2) was lost: The actor died unexpectedly"
    assert (e.task, e.node) == ("worker:1", "10.0.0.2")


def test_a_task_keeps_its_nodes_environment_without_inherited_credentials():
    base = {"PATH": "/bin", "TF_CONFIG": "old", "JAXDIST_TLS_KEY": "/old", "JAXDIST_INSECURE": "1",
            "JAXDIST_COORDINATOR_TOKEN": "old", "JAXDIST_CLUSTER_TOKEN": "old"}
    env = task_environment(base, {"TF_CONFIG": "new", "JAXDIST_CLUSTER_TOKEN": "t"}, "/d")
    assert env == {"PATH": "/bin", "TF_CONFIG": "new", "JAXDIST_CLUSTER_TOKEN": "t",
                   "JAXDIST_TLS_CA": "/d/ca.pem", "JAXDIST_TLS_CERT": "/d/cert.pem",
                   "JAXDIST_TLS_KEY": "/d/key.pem"}


def test_the_actor_writes_private_files_runs_the_command_and_deletes_them(tmp_path):
    """``TaskRunner`` without Ray: what the actor does on its node."""
    ca = TaskCA()
    cert, key = ca.issue("worker:0", ["127.0.0.1"])
    # The command runs until the test creates `go` (after checking a second start is refused
    # while it runs: on a loaded machine a command that ends at once may already be gone).
    probe = ("import json, os, stat, time; d = os.path.dirname(os.environ['JAXDIST_TLS_KEY']); "
             "print(json.dumps({'mode': oct(stat.S_IMODE(os.stat(d).st_mode)), "
             "'files': sorted(os.listdir(d)), 'token': os.environ['JAXDIST_CLUSTER_TOKEN'], "
             "'dir': d}), flush=True); end = time.monotonic() + 30\n"
             "while not os.path.exists('go') and time.monotonic() < end: time.sleep(0.02)")
    runner = TaskRunner("worker:0")
    port = runner.free_port()
    assert 0 < port < 65536
    runner.start([sys.executable, "-c", probe], {"JAXDIST_CLUSTER_TOKEN": "t0"},
                 (ca.ca_pem, cert, key), cwd=str(tmp_path))
    with pytest.raises(RuntimeError, match="worker:0: its command .* still runs"):
        runner.start([sys.executable, "-c", "pass"], {}, None)   # while it runs
    (tmp_path / "go").touch()
    lines, code, deadline = [], None, time.monotonic() + 30
    while code is None and time.monotonic() < deadline:
        code, more = runner.poll()
        lines += more
        time.sleep(0.05)
    assert code == 0, lines
    facts = json.loads(lines[0])
    assert facts["mode"] == "0o700" and facts["files"] == ["ca.pem", "cert.pem", "key.pem"]
    assert facts["token"] == "t0"
    assert not os.path.exists(facts["dir"])                 # deleted once the command ended
    runner.shutdown()


def test_the_actor_stops_its_command_and_reports_a_missing_one():
    runner = TaskRunner("ps:0")
    runner.start([sys.executable, "-c", "import time; time.sleep(60)"], {}, None)
    assert runner.shutdown(grace=2.0) == -15
    with pytest.raises(RuntimeError, match="ps:0: cannot start '/no/such/program' on "):
        runner.start(["/no/such/program"], {}, None)


def test_without_ray_the_backend_names_the_extra_to_install():
    code = ("import sys; sys.modules['ray'] = None\n"
            "from jaxdist.launch import main\n"
            "sys.exit(main(['--backend', 'ray', '--', sys.executable, '-c', 'pass']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--backend ray needs Ray, which is not installed" in r.stderr
    assert INSTALL_HINT in r.stderr and "pip install 'jaxdist[ray]'" in r.stderr


def test_import_ray_checks_the_version(monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(__version__="2.8.1"))
    with pytest.raises(ClusterConfigError, match=r"needs Ray >= 2.9, found 2.8.1: pip install"):
        import_ray()


def test_the_files_of_a_task_are_owner_only(tmp_path):
    from jaxdist._src.security.pki import write_task_identity

    ca = TaskCA()
    tls = write_task_identity(str(tmp_path / "t"), ca.ca_pem, *ca.issue("ps:0", ["n1"]))
    assert stat.S_IMODE(os.stat(tmp_path / "t").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tls.key).st_mode) == 0o600
    with pytest.raises(FileExistsError):
        write_task_identity(str(tmp_path / "t"), ca.ca_pem, b"", b"")
