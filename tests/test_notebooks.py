"""Every notebook runs top to bottom (CPU devices) and is stored without outputs.

Each notebook runs in a fresh kernel process of its own, on 4 CPU devices. The kernel compiles
at the suite's XLA optimisation level (tests/conftest.py: level 0 on CPU unless the environment
chose another), and so do the processes a notebook starts (they inherit the kernel's
environment): the notebooks' checks compare strategies against each other within one run, not
against stored numbers. The notebooks in ``DEFAULT_LEVEL`` run at XLA's default level.
"""

import pathlib

import nbformat
import pytest
from devutil import xla_flags
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))

# notebook -> why it runs at XLA's default optimisation level.
DEFAULT_LEVEL = {
    "02_tpu.ipynb": "it times 2 x 96 training steps of a CNN to show the steps_per_execution "
                    "speed-up; at level 0 the CNN runs about 50x slower, which costs minutes "
                    "and measures nothing a user would see",
}

@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name} has outputs"

# Modules jaxdist's own dependencies bring (pyproject.toml), by import name.
_WITH_JAXDIST = {"jaxdist", "jax", "jaxlib", "flax", "optax", "numpy", "orbax", "grpc",
                 "cloudpickle", "yaml", "tqdm", "tensorboardX", "sklearn", "cryptography"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_first_cell_installs_every_module_the_notebook_imports(path):
    import re
    import sys

    cells = [c.source for c in nbformat.read(path, as_version=4).cells
             if c.cell_type == "code"]
    imported = set(re.findall(r"^\s*(?:import|from)\s+([A-Za-z_]\w*)", "\n".join(cells),
                              re.MULTILINE))
    outside = sorted(imported - _WITH_JAXDIST - set(sys.stdlib_module_names))
    first = cells[0]
    missing = [m for m in outside if f'"{m}"' not in first and f"[{m}]" not in first]
    assert not missing, (f"{path.name} imports {missing}, which its first cell does not "
                         f"install (a fresh Colab runtime would fail there)")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_runs_top_to_bottom(path, monkeypatch):
    # The kernel is a fresh process: give it its own device count, CPU only.
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "4")
    # Of the suite's XLA flags only the optimisation level goes along (the device count is the
    # kernel's own).
    monkeypatch.setenv("XLA_FLAGS", "" if path.name in DEFAULT_LEVEL else xla_flags())
    nb = nbformat.read(path, as_version=4)
    # "immediate": once the last cell has run, the kernel is killed rather than asked to exit
    # and waited for; every notebook stops what it started in its own cells.
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", shutdown_kernel="immediate",
        resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert not errors, errors
