"""Test configuration: the devices the suite runs on, and how a test states what it needs.

By default the suite runs on 8 forced CPU host devices. The environment can change both
before JAX initialises its backend:

* ``JAX_NUM_CPU_DEVICES=1 python -m pytest`` runs it on one CPU device;
* ``JAX_PLATFORMS=cuda,cpu python -m pytest`` runs it on the GPUs (the host CPU stays
  available for what lives there, e.g. CentralStorage's parameter device).

On CPU the suite compiles at ``--xla_backend_optimization_level=0`` (about a third less CPU
time), unless ``XLA_FLAGS`` names a level or ``JAXDIST_TEST_XLA_DEFAULT_OPT=1`` asks for XLA's
default.

A test states what it needs and is skipped, with the reason, when that is absent; everything
else runs on whatever devices exist:

* ``@pytest.mark.devices(4)``: at least 4 devices on the default backend;
* ``@pytest.mark.platform("cpu")``: the default backend is CPU (a test of host-only behaviour);
* the ``devices`` fixture gives the default backend's devices (all of them; take a prefix only
  with a ``devices(n)`` marker), and ``devutil.first_devices(n)`` / ``devutil.cpu_devices(n)``
  do the same inside a test body or a parametrised case.
"""

import json
import os
import pathlib
import shutil
import tempfile

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Older spelling, honoured by every jaxlib; JAX_NUM_CPU_DEVICES wins where both are read.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags = (_flags + " --xla_force_host_platform_device_count="
              + os.environ["JAX_NUM_CPU_DEVICES"]).strip()
# On CPU, LLVM's optimisation passes are most of the suite's run time (it compiles many small
# programs and runs each a few steps): level 0 takes about a third less CPU time. XLA's own
# passes are the same; LLVM forms no fused multiply-adds at level 0, so results can differ in
# the last bits (tests/test_programs.py's tolerances hold at both levels). LocalCluster's tasks
# inherit the flag. To choose: name a level in
# XLA_FLAGS, or set JAXDIST_TEST_XLA_DEFAULT_OPT=1 for XLA's default.
FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"
if (os.environ["JAX_PLATFORMS"] == "cpu" and "xla_backend_optimization_level" not in _flags
        and os.environ.get("JAXDIST_TEST_XLA_DEFAULT_OPT") != "1"):
    _flags += " " + FAST_COMPILE_FLAG
os.environ["XLA_FLAGS"] = _flags

import jax  # noqa: E402
import pytest  # noqa: E402
from devutil import require_devices, require_platform, restore_environ  # noqa: E402, F401

# Keras on the JAX backend for every test, also where TensorFlow (the tf.data tests' extra)
# would be Keras's default: as in a user's program, importing jaxdist before keras selects it
# (the suite sets no KERAS_BACKEND of its own; tests/test_keras_backend.py checks fresh
# processes without one).
import jaxdist  # noqa: E402, F401

# The processes the tests start (trainers, cluster tasks, doc blocks: some 600 in a run, many
# compiling the same programs) share one persistent compilation cache for the session, in a
# temporary directory that the first pytest process makes and removes (the xdist processes
# inherit it). The pytest processes themselves compile without it: tests there count
# compilations. JAXDIST_TEST_COMPILE_CACHE=0 turns it off; a JAX_COMPILATION_CACHE_DIR of the
# environment is used as it is.
_CACHE_DIR_ENV = "JAX_COMPILATION_CACHE_DIR"
_CACHE_OWNER_ENV = "JAXDIST_TEST_COMPILE_CACHE_OWNER"
if os.environ.get("JAXDIST_TEST_COMPILE_CACHE", "1") != "0" and _CACHE_DIR_ENV not in os.environ:
    os.environ[_CACHE_DIR_ENV] = tempfile.mkdtemp(prefix="jaxdist-test-compile-cache-")
    os.environ[_CACHE_OWNER_ENV] = str(os.getpid())
    # every program, however quick to compile (level 0 compiles most in well under a second);
    # a size bound turns on JAX's file lock, so no process reads an entry another is writing
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(8 << 30)
jax.config.update("jax_compilation_cache_dir", None)


def pytest_unconfigure(config):
    if os.environ.get(_CACHE_OWNER_ENV) == str(os.getpid()):
        shutil.rmtree(os.environ[_CACHE_DIR_ENV], ignore_errors=True)


def pytest_configure(config):
    # pytest-xdist hands loadfile's files out by their number of tests unless told not to
    # (--no-loadscope-reorder, from 3.8, the version pyproject.toml asks for); the suite
    # orders them by their length (pytest_collection_modifyitems)
    config.option.loadscopereorder = False
    config.addinivalue_line(
        "markers", "devices(n): the test needs at least n devices on the default backend "
        "(skipped with the reason otherwise)")
    config.addinivalue_line(
        "markers", "platform(name): the test needs the default backend to be `name` "
        "('cpu', 'gpu', 'tpu'; skipped with the reason otherwise)")


# Longest files first: pytest-xdist's `--dist loadfile` hands files out in collection order as
# its processes free up (its own reordering, by number of tests, is turned off in
# pytest_configure), so the few long multi-process files start early and the many short ones
# fill in at the end, and the processes end together. The seconds come from a full run
# (tools/file_durations.py); a file not listed counts 0.2 s a test. They only order the files.
_DURATIONS = pathlib.Path(__file__).with_name("file_durations.json")


def _file_seconds() -> dict[str, float]:
    try:
        return json.loads(_DURATIONS.read_text())
    except (OSError, ValueError):
        return {}


@pytest.hookimpl(trylast=True)  # after -m / -k deselect: a file counts its selected tests
def pytest_collection_modifyitems(session, config, items):
    root = pathlib.Path(str(config.rootpath))
    seconds = _file_seconds()
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(pathlib.Path(os.path.relpath(item.path, root)).as_posix(), []).append(item)
    order = sorted(files, key=lambda f: -seconds.get(f, 0.2 * len(files[f])))
    items[:] = [item for f in order for item in files[f]]


def pytest_runtest_setup(item):
    for mark in item.iter_markers("platform"):
        require_platform(*mark.args)
    need = max((mark.args[0] for mark in item.iter_markers("devices")), default=0)
    if need:
        require_devices(need)


@pytest.fixture
def plaintext_on_loopback(monkeypatch):
    """Plaintext on loopback, asked for (tests that send hand-made frames), and no TLS identity
    another module left in the process environment."""
    monkeypatch.setenv("JAXDIST_INSECURE", "1")
    for key in ("JAXDIST_TLS_CA", "JAXDIST_TLS_CERT", "JAXDIST_TLS_KEY", "JAXDIST_TLS_SERVER_NAME"):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture(scope="session")
def devices():
    """All devices of the default backend (a test that needs ``n`` says so with
    ``@pytest.mark.devices(n)``)."""
    return jax.devices()


@pytest.fixture(autouse=True, scope="module")
def _restore_environment():
    """Each test module starts from the same os.environ: cluster helpers put a task's TLS paths
    and tokens there (as a real task has them), and those files go with their cluster."""
    saved = dict(os.environ)
    yield
    restore_environ(saved)
