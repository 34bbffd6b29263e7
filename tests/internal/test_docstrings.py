"""jaxdist's docstrings: every public class and function has one with an example, and every
``>>>`` example in the package (public modules and ``jaxdist/_src``) runs under doctest, the
way ``pytest --doctest-modules jaxdist`` runs it from a plain checkout.

The doctest run walks the package (so a module that moves is still found), imports each
module once in this process and runs its docstrings' examples with doctest, each in globals
of its own that hold nothing but ``__name__``: an example imports what it uses (``jax``,
``jnp``, ``jaxdist`` ...), so it runs as a reader copies it, and under
``pytest --doctest-modules`` (which adds the module's globals). Each example runs in a fresh
temporary working directory with ``os.environ`` restored afterwards. Conventions inside a
docstring (the checkout's root conftest.py registers the options and gives their skips, for
this harness and for ``pytest --doctest-modules jaxdist`` alike):

* ``# doctest: +SKIP`` marks a line that is only illustrative (it needs a cluster, a TPU, a
  file or the network); keep these few.
* ``# doctest: +NEEDS_2_DEVICES`` (also ``_4_`` and ``_8_``) on a line states that the
  example needs that many devices on the default backend: with fewer (e.g. under
  ``JAX_NUM_CPU_DEVICES=1``) the docstring's examples are skipped, and the skip is reported.
  ``# doctest: +NEEDS_LIBTPU`` does the same for an example that compiles for a named TPU
  topology (``pip install 'jaxdist[tpu]'``), ``+NEEDS_KERAS``, ``+NEEDS_TF`` and
  ``+NEEDS_GRAIN`` for one that needs Keras, TensorFlow's tf.data or grain.
* Output is compared with ``ELLIPSIS`` and ``NORMALIZE_WHITESPACE`` (pyproject's
  ``doctest_optionflags``); an exception is written as Python prints it, with its module
  path (``jaxdist.DoubleReductionError: ...``; most public errors print their public module).

``test_pytest_doctest_modules_collects`` checks that ``pytest --doctest-modules jaxdist``
collects every module in a clean environment (no ``KERAS_BACKEND``, no
``JAX_NUM_CPU_DEVICES``): an unregistered option or a module that cannot be imported there
fails it.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import inspect
import os
import pathlib
import pkgutil
import re
import subprocess
import sys
import warnings

import jax
import pytest
from devutil import DocstringExamplesSkipped, restore_environ

import jaxdist
import jaxdist._src.coordinator
import jaxdist.cluster_resolver
import jaxdist.tpu

NAMESPACES = [jaxdist, jaxdist.cluster_resolver, jaxdist.coordinator, jaxdist.tpu]


def _public():
    for mod in NAMESPACES:
        for name in getattr(mod, "__all__", []):
            obj = getattr(mod, name)
            if inspect.isclass(obj) and issubclass(obj, BaseException):
                continue  # errors are documented by their message and where they are raised
            if inspect.isclass(obj) or inspect.isfunction(obj):
                yield f"{mod.__name__}.{name}", obj


@pytest.mark.parametrize("name,obj", list(_public()), ids=lambda v: v if isinstance(v, str) else "")
def test_public_api_has_docstring_with_example(name, obj):
    doc = inspect.getdoc(obj) or ""
    assert doc, f"{name} has no docstring"
    assert "Example" in doc, f"{name}'s docstring has no example"


# --- every docstring example runs -------------------------------------------------------------

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _root_conftest():
    """The checkout's root conftest.py (pytest imports it as ``conftest`` and then this
    directory's as ``conftest`` too): the doctest options and their skips."""
    spec = importlib.util.spec_from_file_location("_jaxdist_root_conftest",
                                                  ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_RULES = _root_conftest()
_OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _modules() -> list[str]:
    """Every module of the package, found by walking it (not a hard-coded list)."""
    names = ["jaxdist"]
    names += [m.name for m in pkgutil.walk_packages(jaxdist.__path__, prefix="jaxdist.")]
    return sorted(names)


def _where(test: doctest.DocTest) -> str:
    path = os.path.relpath(test.filename) if test.filename else "?"
    line = "?" if test.lineno is None else test.lineno + 1
    if test.lineno is None and test.filename and test.docstring:
        # doctest finds no line for a property's docstring: where its text is in the file
        with open(test.filename) as f:
            text = f.read()
        at = text.find(test.docstring)
        line = "?" if at < 0 else text.count("\n", 0, at) + 1
    return f"{test.name} ({path}:{line})"


def _run_module_examples(module_name: str, workdir) -> tuple[int, list[str], list[str]]:
    """Runs every docstring example of ``module_name``; returns the number of examples run,
    the skipped docstrings (with why) and the failure reports (each naming the object, its
    file and line, the failing example and what it gave)."""
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    ran, skipped, failures = 0, [], []
    # each docstring's examples run in globals of their own: what they use, they import
    for test in finder.find(module, module_name, globs={"__name__": module_name}):
        if not test.examples:
            continue
        why = _RULES.doctest_skip_reason(test)
        if why:
            skipped.append(f"{_where(test)}: {why}")
            continue
        runner = doctest.DocTestRunner(optionflags=_OPTIONS | doctest.REPORT_ONLY_FIRST_FAILURE)
        report: list[str] = []
        saved_env, saved_cwd = dict(os.environ), os.getcwd()
        saved_filtering = jax.config.jax_traceback_filtering
        os.chdir(workdir.mkdir(re.sub(r"\W", "_", test.name)))
        # JAX's filtered tracebacks end with a note, which doctest would read as the message.
        jax.config.update("jax_traceback_filtering", "off")
        try:
            result = runner.run(test, out=report.append, clear_globs=True)
        finally:
            jax.config.update("jax_traceback_filtering", saved_filtering)
            os.chdir(saved_cwd)
            restore_environ(saved_env)
        ran += result.attempted
        if result.failed:
            failures.append(f"{_where(test)}:\n{''.join(report)}")
    return ran, skipped, failures


@pytest.mark.parametrize("module_name", _modules())
def test_docstring_examples_run(module_name, tmpdir):
    ran, skipped, failures = _run_module_examples(module_name, tmpdir)
    assert not failures, (f"{len(failures)} docstring(s) of {module_name} have a failing "
                          "example:\n\n" + "\n\n".join(failures))
    if skipped and not ran:
        pytest.skip("; ".join(skipped))
    for why in skipped:  # the module's other examples ran: the skips show in the summary
        warnings.warn(why, DocstringExamplesSkipped, stacklevel=1)


def test_needs_options_skip_with_the_reason(monkeypatch):
    """A docstring that states a need is skipped, naming it, when it is absent (here: every
    optional package hidden, and more devices than exist asked for)."""
    parser = doctest.DocTestParser()

    def reason(line):
        return _RULES.doctest_skip_reason(parser.get_doctest(f">>> {line}\n", {}, "t", None, 0))

    assert reason("1 + 1") is None
    have = len(jax.devices())
    assert reason(f"1  # doctest: +NEEDS_{2 if have < 2 else 8}_DEVICES") == (
        None if have >= 8 else f"needs {2 if have < 2 else 8} devices, {have} available")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert reason("import keras  # doctest: +NEEDS_KERAS") == (
        "needs Keras 3 (pip install 'jaxdist[keras]')")
    assert reason("import tensorflow  # doctest: +NEEDS_TF") == (
        "needs TensorFlow's tf.data (pip install 'jaxdist[tfdata]')")
    assert reason("import grain  # doctest: +NEEDS_GRAIN") == (
        "needs grain (pip install 'jaxdist[grain]')")


def test_pytest_doctest_modules_collects(tmp_path):
    """``pytest --doctest-modules jaxdist`` from the checkout, in an environment without the
    suite's settings, collects every module's examples (the examples themselves run above)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("KERAS_BACKEND", "JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "PYTEST_ADDOPTS")
           and not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--doctest-modules", "jaxdist", "--collect-only", "-q",
         "-p", "no:cacheprovider"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    collected = re.search(r"(\d+) tests? collected", proc.stdout)
    assert collected and int(collected.group(1)) >= len(_modules()), proc.stdout[-2000:]
