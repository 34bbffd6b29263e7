"""pytest's setup for the whole checkout: ``pytest --doctest-modules jaxdist`` and the suite.

Loaded before anything imports JAX, for every pytest run from this checkout:

* JAX gets 8 forced CPU host devices (``JAX_NUM_CPU_DEVICES``, ``JAX_PLATFORMS=cpu``) unless the
  environment names others, as tests/conftest.py explains;
* the docstrings' own doctest options are registered, and a docstring example that states a
  need skips, with the reason, when it is absent:

  - ``# doctest: +NEEDS_2_DEVICES`` (also ``_4_`` and ``_8_``): that many devices on the default
    backend;
  - ``# doctest: +NEEDS_LIBTPU``: libtpu, to compile for a named TPU topology
    (``pip install 'jaxdist[tpu]'``);
  - ``# doctest: +NEEDS_KERAS``: Keras 3 (``pip install 'jaxdist[keras]'``);
  - ``# doctest: +NEEDS_TF``: TensorFlow's tf.data (``pip install 'jaxdist[tfdata]'``);
  - ``# doctest: +NEEDS_GRAIN``: grain (``pip install 'jaxdist[grain]'``);

* each docstring example runs in a fresh temporary working directory, with ``os.environ``
  restored afterwards and JAX's traceback filtering off (a filtered traceback ends with a note
  that doctest would read as the exception's message).

tests/internal/test_docstrings.py runs the same examples module by module, with the same rules.
"""

import doctest
import importlib.util
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

DEVICE_FLAGS = {n: doctest.register_optionflag(f"NEEDS_{n}_DEVICES") for n in (2, 4, 8)}
LIBTPU_FLAG = doctest.register_optionflag("NEEDS_LIBTPU")
KERAS_FLAG = doctest.register_optionflag("NEEDS_KERAS")
TF_FLAG = doctest.register_optionflag("NEEDS_TF")
GRAIN_FLAG = doctest.register_optionflag("NEEDS_GRAIN")


def doctest_skip_reason(test: doctest.DocTest) -> str | None:
    """Why ``test`` (one docstring's examples) cannot run here, or None when it can."""
    options = [ex.options for ex in test.examples]
    need = max((n for opts in options for n, flag in DEVICE_FLAGS.items() if opts.get(flag)),
               default=0)
    if need:
        import jax

        have = len(jax.devices())
        if have < need:
            return f"needs {need} devices, {have} available"
    if any(opts.get(LIBTPU_FLAG) for opts in options):
        import jaxdist.tpu

        if not jaxdist.tpu.libtpu_available():
            return "needs libtpu (pip install 'jaxdist[tpu]')"
    if any(opts.get(KERAS_FLAG) for opts in options) and importlib.util.find_spec("keras") is None:
        return "needs Keras 3 (pip install 'jaxdist[keras]')"
    if (any(opts.get(TF_FLAG) for opts in options)
            and importlib.util.find_spec("tensorflow") is None):
        return "needs TensorFlow's tf.data (pip install 'jaxdist[tfdata]')"
    if any(opts.get(GRAIN_FLAG) for opts in options) and importlib.util.find_spec("grain") is None:
        return "needs grain (pip install 'jaxdist[grain]')"
    return None


def pytest_runtest_setup(item):
    dtest = getattr(item, "dtest", None)
    if isinstance(dtest, doctest.DocTest):
        why = doctest_skip_reason(dtest)
        if why:
            pytest.skip(why)


@pytest.fixture(autouse=True)
def _doctest_isolation(request):
    """A docstring example runs in a fresh working directory, leaves os.environ as it found it,
    and sees JAX's tracebacks unfiltered."""
    if not isinstance(getattr(request.node, "dtest", None), doctest.DocTest):
        yield
        return
    import jax

    request.getfixturevalue("monkeypatch").chdir(request.getfixturevalue("tmp_path"))
    saved_env = dict(os.environ)
    saved_filtering = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", "off")
    try:
        yield
    finally:
        jax.config.update("jax_traceback_filtering", saved_filtering)
        os.environ.clear()
        os.environ.update(saved_env)
