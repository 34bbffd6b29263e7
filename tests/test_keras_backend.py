"""Keras's backend as a reader's program gets it, in fresh processes without the suite's
``KERAS_BACKEND`` (issue 35, point 6): importing jaxdist before keras selects JAX,
``jaxdist.keras`` resolves after ``import jaxdist`` (as ``tf.keras`` does), the Keras
sample of docs/keras.md runs as written, and Keras already loaded on another backend gets an
error naming the fix. Meaningful where TensorFlow is installed (Keras's default backend)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
from devutil import xla_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytest.importorskip("keras")
if __import__("importlib.util").util.find_spec("tensorflow") is None:
    pytest.skip("Keras's default backend is TensorFlow: without it installed, importing keras "
                "first cannot pick another backend (pip install -e '.[test]')",
                allow_module_level=True)


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    full.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="4", PYTHONPATH=str(ROOT),
                XLA_FLAGS=xla_flags(), **env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                          text=True, timeout=240, cwd=ROOT)


def _doc_block(marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "keras.md").read_text(), re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"docs/keras.md has {len(found)} python blocks with {marker!r}"
    return found[0]


def test_importing_jaxdist_first_runs_the_keras_doc_sample_on_jax():
    sample = _doc_block("jaxdist first: Keras runs on JAX")
    code = (sample + "\nimport keras\nassert keras.backend.backend() == 'jax'\n"
            "assert jaxdist.keras.scope is not None  # resolves after `import jaxdist`\n"
            "print('OK')\n")
    proc = _run(code)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_keras_loaded_on_another_backend_gets_the_fix_and_jaxdist_keras_chooses_jax():
    proc = _run("import keras, jaxdist.keras")  # keras first: TensorFlow, its default
    assert proc.returncode != 0
    assert "already imported on 'tensorflow'" in proc.stderr
    assert "import jaxdist (or jaxdist.keras) before keras" in proc.stderr
    proc = _run("import jaxdist.keras, keras; print(keras.backend.backend())",
                KERAS_BACKEND="tensorflow")
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "jax", proc.stderr[-2000:]
    assert "KERAS_BACKEND='tensorflow' in the environment is replaced by 'jax'" in proc.stderr
    # `import jaxdist` alone respects a backend the program chose.
    proc = _run("import jaxdist, keras; print(keras.backend.backend())",
                KERAS_BACKEND="tensorflow")
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "tensorflow", proc.stderr
