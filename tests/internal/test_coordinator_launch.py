"""``python -m jaxdist.launch --coordinator``: a chief runs the program, ps and worker tasks
run ``python -m jaxdist.server`` and are stopped when the chief is done."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_launch_coordinator_mode_end_to_end():
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "jaxdist.launch", "--coordinator", "--workers", "2", "--ps", "1",
         "--devices-per-process", "1", "--grace", "3", "--",
         sys.executable, os.path.join(REPO, "tests", "coordinator_chief.py"), "count", "-"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln.split("] ", 1)[-1] for ln in proc.stdout.splitlines() if "chief:0" in ln]
    out = json.loads([ln for ln in lines if ln.startswith("{")][-1])
    assert out["step"] == 10.0
    assert 1 <= len(out["pids"]) <= 2  # functions ran in the worker processes
    assert "worker:0 listening on" in proc.stdout and "all training tasks finished" in proc.stdout


def test_a_server_task_logs_jaxdist_from_info_and_other_libraries_from_warning(monkeypatch):
    import logging

    from jaxdist._src.coordinator.server import configure_logging

    root, ours = logging.getLogger(), logging.getLogger("jaxdist")
    monkeypatch.setattr(root, "handlers", [])  # a fresh process: basicConfig configures root
    saved = (root.level, ours.level)
    try:
        configure_logging()
        assert logging.getLogger("jaxdist.server").isEnabledFor(logging.INFO)
        jax_log = logging.getLogger("jax._src.xla_bridge")  # "Unable to initialize backend"
        assert not jax_log.isEnabledFor(logging.INFO)
        assert jax_log.isEnabledFor(logging.WARNING)
    finally:
        root.setLevel(saved[0])
        ours.setLevel(saved[1])


def test_a_worker_server_imports_keras_on_the_jax_backend(monkeypatch):
    from jaxdist._src.coordinator.server import use_keras_jax_backend

    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    use_keras_jax_backend("worker:0")
    assert os.environ["KERAS_BACKEND"] == "jax"
    monkeypatch.setenv("KERAS_BACKEND", "torch")
    with pytest.raises(ValueError, match=r"^worker:3: KERAS_BACKEND='torch' in the environment, "
                                         r"but jaxdist workers run Keras on the JAX backend"):
        use_keras_jax_backend("worker:3")


def test_a_worker_server_with_another_keras_backend_exits_with_one_line():
    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
    env = dict(os.environ, KERAS_BACKEND="tensorflow", JAXDIST_INSECURE="1",
               JAXDIST_CLUSTER_TOKEN="t" * 32,
               TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}}),
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "jaxdist.server"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "jaxdist.server: worker:0: KERAS_BACKEND='tensorflow' in the environment, but jaxdist "
        "workers run Keras on the JAX backend: unset KERAS_BACKEND or set KERAS_BACKEND=jax"]
