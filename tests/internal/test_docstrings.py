"""jaxdist's docstrings: every public class and function has one with an example, and every
``>>>`` example in the package (public modules and ``jaxdist/_src``) runs under doctest.

The doctest run walks the package (so a module that moves is still found), imports each
module once in this process and runs its docstrings' examples the way ``doctest.testmod``
does: in a copy of the module's globals, plus ``jax``, ``jnp`` (``jax.numpy``), ``np``
(``numpy``) and ``jaxdist``. Each example runs in a fresh temporary working directory with
``os.environ`` restored afterwards. Conventions inside a docstring:

* ``# doctest: +SKIP`` marks a line that is only illustrative (it needs a cluster, a TPU, a
  file or the network); keep these few.
* ``# doctest: +NEEDS_2_DEVICES`` (also ``_4_`` and ``_8_``) on a line states that the
  example needs that many devices on the default backend: with fewer (e.g. under
  ``JAX_NUM_CPU_DEVICES=1``) the docstring's examples are skipped, and the skip is reported.
  ``# doctest: +NEEDS_LIBTPU`` does the same for an example that compiles for a named TPU
  topology (``pip install 'jaxdist[tpu]'``).
* Output is compared with ``ELLIPSIS`` and ``NORMALIZE_WHITESPACE``; an exception's name is
  compared without its module path (``DoubleReductionError: ...`` matches
  ``jaxdist._src.strategies.replica_reduce.DoubleReductionError: ...``), its message in full.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import os
import pkgutil
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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

_DEVICE_FLAGS = {n: doctest.register_optionflag(f"NEEDS_{n}_DEVICES") for n in (2, 4, 8)}
_LIBTPU_FLAG = doctest.register_optionflag("NEEDS_LIBTPU")
_OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
_GLOBALS = {"jax": jax, "jnp": jnp, "np": np, "jaxdist": jaxdist}


# An exception line's qualified name ("pkg.mod.SomeError: msg"): doctest prints the module path.
_QUALIFIED_ERROR = re.compile(
    r"^(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*(?:Error|Exception|Exit|Warning|Interrupt)\b)", re.M)


class _Checker(doctest.OutputChecker):
    """doctest's checker, reading exception names without their module path."""

    def check_output(self, want: str, got: str, optionflags: int) -> bool:
        return super().check_output(_QUALIFIED_ERROR.sub(r"\1", want),
                                    _QUALIFIED_ERROR.sub(r"\1", got), optionflags)


def _modules() -> list[str]:
    """Every module of the package, found by walking it (not a hard-coded list)."""
    names = ["jaxdist"]
    names += [m.name for m in pkgutil.walk_packages(jaxdist.__path__, prefix="jaxdist.")]
    return sorted(names)


def _devices_needed(test: doctest.DocTest) -> int:
    return max((n for ex in test.examples for n, flag in _DEVICE_FLAGS.items()
                if ex.options.get(flag)), default=0)


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
    have = len(jax.devices())
    for test in finder.find(module, module_name, extraglobs=_GLOBALS):
        if not test.examples:
            continue
        need = _devices_needed(test)
        if need > have:
            skipped.append(f"{_where(test)}: needs {need} devices, {have} available")
            continue
        if (any(ex.options.get(_LIBTPU_FLAG) for ex in test.examples)
                and not jaxdist.tpu.libtpu_available()):
            skipped.append(f"{_where(test)}: needs libtpu (pip install 'jaxdist[tpu]')")
            continue
        runner = doctest.DocTestRunner(checker=_Checker(),
                                       optionflags=_OPTIONS | doctest.REPORT_ONLY_FIRST_FAILURE)
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
            os.environ.clear()
            os.environ.update(saved_env)
        ran += result.attempted
        if result.failed:
            failures.append(f"{_where(test)}:\n{''.join(report)}")
    return ran, skipped, failures


class DocstringExamplesSkipped(UserWarning):
    """Some docstrings' examples did not run here (they need more devices, or libtpu)."""


@pytest.mark.parametrize("module_name", _modules())
def test_docstring_examples_run(module_name, tmpdir):
    ran, skipped, failures = _run_module_examples(module_name, tmpdir)
    assert not failures, (f"{len(failures)} docstring(s) of {module_name} have a failing "
                          "example:\n\n" + "\n\n".join(failures))
    if skipped and not ran:
        pytest.skip("; ".join(skipped))
    for why in skipped:  # the module's other examples ran: the skips show in the summary
        warnings.warn(why, DocstringExamplesSkipped, stacklevel=1)
