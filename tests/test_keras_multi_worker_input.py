"""Multi-worker Keras trains each step on one global batch, whatever the input kind.

TF's "Multi-worker training with Keras" shape (``tests/keras_input_mw_worker.py``) under
``python -m jaxdist.launch --workers 2 --devices-per-process 2``: global batch
``64 * num_workers = 128``, ``MultiWorkerMirroredStrategy``, ``model.fit`` on a ``tf.data``
pipeline (the tutorial's, and ``AutoShardPolicy.DATA`` / ``OFF``), numpy arrays, a Python
generator, a ``keras.utils.PyDataset`` and a ``jaxdist.Dataset``. The model records the ids of
the rows every step trains on, per process (inside the jitted step). Each step must train each
worker on 64 rows, the two workers' rows disjoint, their union the global batch the same
program trains on in one process (no strategy), and the weights must be that run's. The
tutorial's fault-tolerance pattern runs too: the arrays run as two jobs, the second restoring the
chief's checkpoint with ``keras.models.load_model`` inside ``strategy.scope()`` (make-or-restore)
and ending with the uninterrupted run's weights and optimizer state. Needs TensorFlow (the
tfdata test extra) for the tf.data runs.
"""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from devutil import xla_flags

HERE = os.path.dirname(os.path.abspath(__file__))
TOL = dict(rtol=1e-5, atol=1e-6)
HAS_TF = importlib.util.find_spec("tensorflow") is not None


def _launch_env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", KERAS_BACKEND="jax")
    for key in ("TF_CONFIG", "JAX_NUM_CPU_DEVICES"):
        env.pop(key, None)  # the launcher gives each task its own
    env["XLA_FLAGS"] = xla_flags()
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.dirname(HERE), HERE, env.get("PYTHONPATH")) if p)
    return env


def _worker_module():
    sys.path.insert(0, HERE)
    import keras_input_mw_worker

    return keras_input_mw_worker


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_every_input_kind_trains_each_worker_on_its_half_of_each_global_batch(tmp_path):
    w = _worker_module()
    runs = [r for r in w.RUNS if HAS_TF or not r.startswith("tfdata")]
    out, log = tmp_path / "result", tmp_path / "launch.log"
    with open(log, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxdist.launch", "--workers", "2", "--devices-per-process",
             "2", "--", sys.executable, os.path.join(HERE, "keras_input_mw_worker.py"), str(out),
             ",".join(runs)],
            cwd=os.path.dirname(HERE), env=_launch_env(), stdout=log_file,
            stderr=subprocess.STDOUT)
    try:
        import jaxdist

        # The one-process reference (no strategy: plain Keras) while the cluster runs.
        global_batch = 2 * w.PER_WORKER_BATCH_SIZE
        ref = {name: w.run(name, jaxdist.get_strategy(), global_batch)
               for name in runs if name in w.SAME_AS_ONE_PROCESS}
        proc.wait(timeout=360)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the launcher stops its tasks on SIGTERM
            proc.wait(timeout=60)
    assert proc.returncode == 0, log.read_text()[-4000:]
    got = [json.loads((tmp_path / f"result.{i}.json").read_text()) for i in range(2)]
    assert [(g["processes"], g["replicas"]) for g in got] == [(2, 4), (2, 4)]
    steps = w.STEPS_PER_EPOCH * w.EPOCHS
    for name in runs:
        mine = [g[name]["steps"] for g in got]
        n_steps = 8 if name in ("tfdata_off", "tfdata_file") else steps
        assert sorted(mine[0], key=int) == [str(s) for s in range(n_steps)], name
        for s in mine[0]:
            a, b = mine[0][s], mine[1][s]
            if name in ("tfdata_off", "tfdata_file"):  # batches of 128 read as 2 steps of 64
                assert not set(a) & set(b), (name, s)
                continue
            assert (len(a), len(b)) == (64, 64), (name, s, len(a), len(b))
            assert not set(a) & set(b), (name, s)
            if name in ref or name == "make_or_restore":
                want = ref["arrays" if name == "make_or_restore" else name]
                assert sorted(a + b) == want["steps"][s], (name, s)
            else:  # shuffled PyDataset: one of its 3 global batches
                k = min(a + b) // global_batch
                assert sorted(a + b) == list(range(k * global_batch, (k + 1) * global_batch))
        for a, b in zip(got[0][name]["weights"], got[1][name]["weights"]):
            np.testing.assert_array_equal(a, b)  # one model
        if name in ref or name == "make_or_restore":
            want = ref["arrays" if name == "make_or_restore" else name]
            for key in ("weights", "optimizer"):
                for a, b in zip(got[0][name][key], want[key]):
                    np.testing.assert_allclose(a, b, **TOL)
    if "pydataset_shuffled" in runs:  # each epoch reads every global batch once
        mine = got[0]["pydataset_shuffled"]["steps"]
        for epoch in range(w.EPOCHS):
            firsts = sorted(min(mine[str(epoch * 3 + k)]) // global_batch for k in range(3))
            assert firsts == [0, 1, 2]
    if "tfdata_off" in runs:  # each worker its own rows (shard), 64 a step, each twice
        for i in range(2):
            # a step of 32 real rows is padded to 64 with copies of its last row (masked)
            mine = {s: set(ids) for s, ids in got[i]["tfdata_off"]["steps"].items()}
            sizes = [len(mine[str(s)]) for s in range(8)]
            assert sizes == [64, 64, 32, 32] * 2
            ids = sorted(r for s in mine.values() for r in s)
            assert ids == sorted(list(range(i, 3 * global_batch, 2)) * 2)
    if "tfdata_file" in runs:  # FILE: worker i reads files i and i + 2 (96 rows each)
        per = 3 * global_batch // w.FILES
        for i in range(2):
            mine = {s: set(ids) for s, ids in got[i]["tfdata_file"]["steps"].items()}
            assert [len(mine[str(s)]) for s in range(8)] == [64, 64, 32, 32] * 2
            ids = sorted(r for s in mine.values() for r in s)
            files = list(range(i * per, (i + 1) * per)) + list(range((i + 2) * per,
                                                                     (i + 3) * per))
            assert ids == sorted(files * 2)
    if "make_or_restore" in runs:  # restored inside the scope: optimizer state and all
        assert sorted(os.listdir(f"{out}.work/ckpt")) == ["ckpt-1.keras", "ckpt-2.keras"]
    if "tfdata" in runs:
        for g in got:
            np.testing.assert_allclose(g["tfdata"]["evaluate"], ref["tfdata"]["evaluate"], **TOL)
            for key in ("predict", "predict_uneven", "predict_arrays"):
                np.testing.assert_allclose(g["tfdata"][key], ref["tfdata"][key], **TOL)
            assert np.shape(g["tfdata"]["predict_uneven"]) == (70, 1)


@pytest.mark.skipif(not HAS_TF, reason="tensorflow (the tfdata test extra) is not installed")
def test_keras_on_another_backend_refuses_to_train_in_a_scope(tmp_path):
    """TF's tutorial imports tensorflow first, which imports keras on its default backend
    (tensorflow) unless KERAS_BACKEND says otherwise: jaxdist cannot distribute that model, so
    compile / fit inside a strategy's scope raise, naming KERAS_BACKEND=jax (they would train
    each worker alone on its whole global batch). Outside every scope, and jax code inside
    one, run as without jaxdist."""
    program = (
        "import tensorflow as tf\n"
        "import jax, keras, numpy as np, jaxdist\n"
        "assert keras.backend.backend() == 'tensorflow'\n"
        "strategy = jaxdist.MirroredStrategy(jax.devices()[:1])\n"
        "m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])\n"
        "with strategy.scope():\n"
        "    assert float(jax.numpy.ones(3).sum()) == 3.0\n"
        "    try:\n"
        "        m.compile(optimizer='sgd', loss='mse')\n"
        "    except RuntimeError as e:\n"
        "        print('REFUSED COMPILE', e)\n"
        "m.compile(optimizer='sgd', loss='mse')\n"
        "m.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)\n"
        "with strategy.scope():\n"
        "    try:\n"
        "        m.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)\n"
        "    except RuntimeError as e:\n"
        "        print('REFUSED FIT')\n"
        "print('OK')\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("KERAS_BACKEND", None)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.dirname(HERE), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    refused = [ln for ln in lines if ln.startswith("REFUSED COMPILE ")]
    assert len(refused) == 1 and "KERAS_BACKEND=jax" in refused[0]
    assert "'tensorflow' backend" in refused[0] and "MirroredStrategy.scope()" in refused[0]
    assert "REFUSED FIT" in lines and lines[-1] == "OK"
