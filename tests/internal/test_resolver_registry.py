"""The registry of cluster environments (``_src/cluster/cluster_env.py``, ``auto_detect.py``):
each environment is detected from its variables, in the documented order, and the default
resolver of ``MultiWorkerMirroredStrategy`` comes from it.

Devices: none (no JAX computation; CPU only).
"""

from __future__ import annotations

import json

import pytest

import jaxdist
from jaxdist._src.cluster.auto_detect import (
    BUILTIN_ENVIRONMENTS,
    detect_environment,
    looked_for,
    resolver_from_environment,
)
from jaxdist._src.cluster.cluster_env import ClusterEnvironment, registered_environments
from jaxdist._src.cluster.errors import ClusterConfigError
from jaxdist._src.cluster.slurm import SlurmEnvironment
from jaxdist._src.cluster.tf_config import TFConfigEnvironment
from jaxdist._src.cluster.tpu_cluster_resolver import TPUEnvironment

ALL_VARIABLES = ("TF_CONFIG", "SLURM_PROCID", "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_TASKS",
                 "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS", "SLURM_JOB_NODELIST",
                 "SLURM_TASKS_PER_NODE", "SLURM_GPUS_PER_TASK", "TPU_PROCESS_ADDRESSES",
                 "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "TPU_NAME")

TF_CONFIG = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["h0:1", "h1:1"]},
                                      "task": {"type": "worker", "index": 1}})}
SLURM = {"SLURM_PROCID": "1", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_NUM_TASKS": "2",
         "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
TPU = {"TPU_WORKER_HOSTNAMES": "t0,t1,t2", "TPU_WORKER_ID": "2"}


@pytest.fixture
def clean_env(monkeypatch):
    for name in ALL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the Slurm resolver counts no GPUs
    return monkeypatch


def test_the_builtin_environments_are_registered_in_the_documented_order():
    order = [env for env in registered_environments() if env in BUILTIN_ENVIRONMENTS]
    assert order == [TFConfigEnvironment, SlurmEnvironment, TPUEnvironment]
    assert [env.name for env in order] == ["tf_config", "slurm", "tpu"]


@pytest.mark.parametrize("variables, name", [
    (TF_CONFIG, "tf_config"), (SLURM, "slurm"), (TPU, "tpu"),
    ({"TPU_PROCESS_ADDRESSES": "t0:8476,t1:8476"}, "tpu")])
def test_each_environment_is_detected_from_its_variables(variables, name):
    assert detect_environment(variables).name == name


@pytest.mark.parametrize("variables", [
    {}, {"TF_CONFIG": ""}, {"SLURM_PROCID": "0"},                 # a batch script's own shell
    {"SLURM_JOB_NODELIST": "n1", "SLURM_PROCID": "0"}, {"TPU_NAME": "local"},
    {"TPU_WORKER_HOSTNAMES": ""}])
def test_nothing_is_detected_without_the_variables(variables):
    assert detect_environment(variables) is None


def test_the_order_decides_when_several_are_present():
    assert detect_environment({**TPU, **SLURM, **TF_CONFIG}).name == "tf_config"
    assert detect_environment({**TPU, **SLURM}).name == "slurm"


@pytest.mark.parametrize("variables, cls, task", [
    (TF_CONFIG, jaxdist.cluster_resolver.TFConfigClusterResolver, ("worker", 1)),
    (SLURM, jaxdist.cluster_resolver.SlurmClusterResolver, ("worker", 1)),
    (TPU, jaxdist.cluster_resolver.TPUClusterResolver, ("worker", 2))])
def test_the_resolver_of_the_present_environment(clean_env, variables, cls, task):
    for name, value in variables.items():
        clean_env.setenv(name, value)
    resolver = resolver_from_environment(required=True)
    assert type(resolver) is cls
    assert (resolver.task_type, resolver.task_id) == task
    assert len(resolver.cluster_spec().job_tasks("worker")) == {
        "TF_CONFIG": 2, "SLURM_PROCID": 2, "TPU_WORKER_HOSTNAMES": 3}[next(iter(variables))]


def test_no_environment_is_none_or_an_error_naming_what_was_looked_for(clean_env):
    assert resolver_from_environment() is None
    with pytest.raises(ClusterConfigError) as info:
        resolver_from_environment(required=True)
    message = str(info.value)
    for name in ("$TF_CONFIG", "$SLURM_PROCID", "$SLURM_STEP_NODELIST",
                 "$TPU_PROCESS_ADDRESSES", "$TPU_WORKER_HOSTNAMES"):
        assert name in message
    assert looked_for() in message


def test_a_new_environment_registers_by_being_defined():
    class Sched(ClusterEnvironment):
        name = "test-scheduler"
        priority = 15   # between TF_CONFIG and Slurm
        variables = ("TEST_SCHEDULER_RANK",)

        @classmethod
        def resolver(cls):
            return jaxdist.cluster_resolver.SimpleClusterResolver({"worker": ["a:1"]})

    try:
        assert detect_environment({"TEST_SCHEDULER_RANK": "0", **SLURM}) is Sched
        assert detect_environment({"TEST_SCHEDULER_RANK": "0", **TF_CONFIG}).name == "tf_config"
        with pytest.raises(ValueError, match="already registered"):
            type("Again", (ClusterEnvironment,), {"name": "test-scheduler"})
    finally:
        Sched.unregister()
    assert Sched not in registered_environments()


def test_multi_worker_strategy_takes_its_default_resolver_from_the_environment(clean_env):
    """Outside any environment: TF's default, an (empty) ``TFConfigClusterResolver``."""
    from jaxdist._src.strategies import multi_worker

    seen = []

    class Stop(Exception):
        pass

    def extended(strategy, resolver, options):
        seen.append(resolver)
        raise Stop

    clean_env.setattr(multi_worker, "MultiWorkerExtended", extended)
    with pytest.raises(Stop):
        jaxdist.MultiWorkerMirroredStrategy()
    assert type(seen[-1]) is jaxdist.cluster_resolver.TFConfigClusterResolver
    for name, value in SLURM.items():
        clean_env.setenv(name, value)
    with pytest.raises(Stop):
        jaxdist.MultiWorkerMirroredStrategy()
    assert type(seen[-1]) is jaxdist.cluster_resolver.SlurmClusterResolver


def test_the_tpu_resolver_joins_a_slice_through_the_registered_bring_up(clean_env):
    from jaxdist._src.cluster import tpu_cluster_resolver

    calls = []
    clean_env.setattr(tpu_cluster_resolver, "_slice_connector",
                      lambda r, **kw: calls.append((r.task_id, kw)))
    jaxdist.cluster_resolver.TPUClusterResolver(worker_hostnames="t0,t1", worker_id=1).connect(
        timeout_seconds=5)
    assert calls == [(1, {"timeout_seconds": 5, "cpu_collectives": None})]
    clean_env.setattr(tpu_cluster_resolver, "_slice_connector", None)
    with pytest.raises(ClusterConfigError, match="no bring-up is registered"):
        jaxdist.cluster_resolver.TPUClusterResolver(worker_hostnames="t0,t1").connect()
