"""``python -m jaxdist.slurm`` without Slurm (issue 37): the layout is SlurmClusterResolver's,
each task's credential directory holds its own role's secrets only (0700 / 0600), a task reads
its own files and deletes its secrets, and ``python -m jaxdist.train`` started by a bare
``srun`` is refused with the fix. tests/test_slurm_cluster.py runs the real thing. CPU only."""

from __future__ import annotations

import json
import os
import stat
from unittest import mock

import pytest
from cryptography import x509

from jaxdist._src.cluster.errors import ClusterConfigError
from jaxdist._src.job.config import ConfigError, load_config
from jaxdist._src.job.rerun import check_one_copy
from jaxdist._src.launch.slurm_launch import (
    PLAN_FILE,
    SECRETS_FILE,
    layout,
    main,
    parse_jobs,
    prepare,
    task_environment,
)
from jaxdist.cluster_resolver import SlurmClusterResolver


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_layout_is_slurm_cluster_resolvers():
    env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "5",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2),1", "SLURM_STEP_NODELIST": "t02n13,t02n41,t02n43"}
    with mock.patch.dict(os.environ, env):
        tf = SlurmClusterResolver(jobs={"ps": 1, "worker": 4}, port_base=8888, gpus_per_node=0)
    plan = layout(["t02n43", "t02n13", "t02n41"], [1, 2, 2], {"worker": 4, "ps": 1}, 8888)
    cluster = {}
    for t in plan:
        cluster.setdefault(t.job, []).append(t.address)
    assert cluster == tf.cluster_spec().as_dict()
    assert [(t.procid, t.name, t.node, t.slot) for t in plan] == [
        (0, "ps:0", "t02n13", 0), (1, "worker:0", "t02n13", 1), (2, "worker:1", "t02n41", 0),
        (3, "worker:2", "t02n41", 1), (4, "worker:3", "t02n43", 0)]


def test_bad_jobs_are_named():
    with pytest.raises(ClusterConfigError, match=r"ask for 3 tasks, but the Slurm job has 2"):
        layout(["n1", "n2"], [1, 1], {"ps": 1, "worker": 2}, 9000)
    with pytest.raises(ClusterConfigError, match=r"'worker=0'.*expected JOB=COUNT"):
        parse_jobs("ps=1,worker=0", 1)
    assert parse_jobs(None, 3) == {"worker": 3}


@pytest.fixture
def creds(tmp_path):
    plan = layout(["n1", "n2"], [2, 1], {"chief": 1, "ps": 1, "worker": 1}, 9000)
    directory = tmp_path / "creds"
    prepare(str(directory), plan, gpus_per_task=2)
    return directory, plan


def test_the_plan_says_which_jobs_train(tmp_path):
    plan = layout(["n1", "n2"], [2, 1], {"chief": 1, "ps": 1, "worker": 1}, 9000)
    prepare(str(tmp_path / "a"), plan)
    prepare(str(tmp_path / "b"), plan, coordinator=True)
    assert json.loads((tmp_path / "a" / PLAN_FILE).read_text())["training_jobs"] == [
        "chief", "worker"]
    assert json.loads((tmp_path / "b" / PLAN_FILE).read_text())["training_jobs"] == ["chief"]


def test_each_task_directory_holds_its_own_role_only(creds):
    directory, plan = creds
    assert _mode(directory) == 0o700
    assert sorted(os.listdir(directory)) == [PLAN_FILE, "task-0", "task-1", "task-2"]
    secrets = {}
    for t in plan:
        task_dir = directory / f"task-{t.procid}"
        assert _mode(task_dir) == 0o700
        assert sorted(os.listdir(task_dir)) == ["ca.pem", "cert.pem", "key.pem", SECRETS_FILE]
        assert _mode(task_dir / "key.pem") == 0o600 and _mode(task_dir / SECRETS_FILE) == 0o600
        secrets[t.name] = json.loads((task_dir / SECRETS_FILE).read_text())
        cert = x509.load_pem_x509_certificate((task_dir / "cert.pem").read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert t.node in san.get_values_for_type(x509.DNSName)
        other = "n2" if t.node == "n1" else "n1"
        assert other not in san.get_values_for_type(x509.DNSName)
    tokens = {s["JAXDIST_CLUSTER_TOKEN"] for s in secrets.values()}
    assert len(tokens) == 1                                   # one cluster token
    assert sorted(secrets["chief:0"]) == ["JAXDIST_CLUSTER_TOKEN", "JAXDIST_COORDINATOR_TOKEN"]
    assert sorted(secrets["worker:0"]) == ["JAXDIST_CLUSTER_TOKEN",
                                           "JAXDIST_COORDINATOR_ANSWER_KEY",
                                           "JAXDIST_COORDINATOR_PUBLIC_KEY"]
    assert sorted(secrets["ps:0"]) == ["JAXDIST_CLUSTER_TOKEN"]
    token = secrets["chief:0"]["JAXDIST_COORDINATOR_TOKEN"]
    for name in ("worker:0", "ps:0"):                         # the chief's token is nowhere else
        assert token not in (directory / f"task-{plan[[t.name for t in plan].index(name)].procid}"
                             / SECRETS_FILE).read_text()
    assert token not in (directory / PLAN_FILE).read_text()
    with pytest.raises(FileExistsError):                      # never reused
        prepare(str(directory), plan)


def _step_env(procid: int, node: str, **extra: str) -> dict[str, str]:
    return {"SLURM_PROCID": str(procid), "SLURM_STEP_NUM_TASKS": "3",
            "SLURMD_NODENAME": node, "JAXDIST_INSECURE": "1", "TF_CONFIG": "{}", **extra}


def test_a_task_reads_its_own_files_and_deletes_its_secrets(creds):
    directory, plan = creds
    me, env = task_environment(str(directory), _step_env(2, "n2"))
    assert me.name == "worker:0" and me.address == "n2:9000"
    config = json.loads(env["TF_CONFIG"])
    assert config["cluster"] == {"chief": ["n1:9000"], "ps": ["n1:9001"], "worker": ["n2:9000"]}
    assert config["task"] == {"type": "worker", "index": 0}
    assert config["token"] == env["JAXDIST_CLUSTER_TOKEN"]
    assert env["JAXDIST_TLS_KEY"] == str(directory / "task-2" / "key.pem")
    assert "JAXDIST_INSECURE" not in env and "JAXDIST_COORDINATOR_TOKEN" not in env
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"               # slot 0 of n2, 2 GPUs per task
    assert not (directory / "task-2" / SECRETS_FILE).exists()  # read once
    _, env = task_environment(str(directory), _step_env(1, "n1"))
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"               # slot 1 of n1
    with pytest.raises(ClusterConfigError, match="already read"):   # a second reader: nothing
        task_environment(str(directory), _step_env(2, "n2"))


def test_a_task_slurm_put_elsewhere_or_a_smaller_step_is_refused(creds):
    directory, _ = creds
    with pytest.raises(ClusterConfigError, match=r"put task 0 \(chief:0\) on node n2, but the "
                                                 r"cluster has it on n1"):
        task_environment(str(directory), _step_env(0, "n2"))
    with pytest.raises(ClusterConfigError, match=r"the srun step has 2 tasks .* cluster has 3"):
        task_environment(str(directory), _step_env(0, "n1", SLURM_STEP_NUM_TASKS="2"))


def test_outside_a_slurm_job_it_says_so(capsys, monkeypatch):
    for name in list(os.environ):
        if name.startswith("SLURM_"):
            monkeypatch.delenv(name)
    assert main(["--", "true"]) == 2
    assert "not inside a Slurm job" in capsys.readouterr().err


def test_train_under_a_bare_srun_is_refused_with_the_fix():
    cfg = load_config(raw={"strategy": {"name": "multi_worker"}})
    env = {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}
    with pytest.raises(ConfigError, match=r"without TF_CONFIG.*python -m jaxdist.slurm --"):
        check_one_copy(cfg, env)
    check_one_copy(cfg, {**env, "TF_CONFIG": json.dumps(
        {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}})})
    check_one_copy(cfg, {"SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"})


def test_an_existing_credentials_dir_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "1(x2)")
    (tmp_path / "creds").mkdir()
    assert main(["--credentials-dir", str(tmp_path / "creds"), "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "cannot create the credentials directory" in err and "File exists" in err
    assert main(["--jobs", "ps=1,worker=2", "--", "true"]) == 2
    assert "ask for 3 tasks, but the Slurm job has 2" in capsys.readouterr().err
