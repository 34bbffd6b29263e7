"""The public surface: docs/api.md, the public modules' ``__all__`` and what the tests import.

* docs/api.md lists every public module and every name in it; the modules' ``__all__`` equal
  those lists (both ways, in order), so each ``__all__`` is sorted; docs/api.md is exactly what
  ``python tools/api_doc.py`` writes from the ``__all__``s and the docstrings;
* every name in an ``__all__`` resolves;
* a public module exposes no other jaxdist name than its ``__all__`` (imports of other
  libraries, e.g. ``sys`` or ``typing.Any``, and documented public submodules aside);
* the docstring examples of the public modules and of every public name use public names only;
* a test outside ``tests/internal/`` imports no ``jaxdist._src`` module (the unit tests of
  private modules live in ``tests/internal/``).

The checkers are tested on small fakes first, so each is known to fail when it should.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import inspect
import os
import pathlib
import re
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
API_MD = ROOT / "docs" / "api.md"
TESTS = ROOT / "tests"

# Test files outside tests/internal/ that may still import jaxdist._src, each with its reason.
# Every entry is a file to move to tests/internal/ or to rewrite on public names.
SRC_IMPORT_ALLOWED: dict[str, str] = {
    "coordinator_util.py": "helper of the coordinator tests: in_process_worker runs a worker task "
                           "inside the test process (WorkerServer, WorkerRuntime, TaskInfo have "
                           "no public face; a real worker is `python -m jaxdist.server`)",
    # TensorFlow's own tests stay in tests/tf_compat/ (the project's rule); these test TF's
    # internal helpers, whose jaxdist counterparts are private too.
    "tf_compat/test_tf_cluster_coordinator.py": "TF's CoordinatedClosureQueueTest tests TF's "
                                                "_CoordinatedClosureQueue (jaxdist's ClosureQueue)",
    "tf_compat/test_tf_cross_device_ops.py": "TF's test resolves device strings (TF's "
                                             "device_util; jaxdist's resolve_device)",
    "tf_compat/test_tf_distribute_lib.py": "TF's test reaches distribute_lib internals (the "
                                           "default strategy, InputContext)",
    "tf_compat/test_tf_failure_handling.py": "TF's local-mode tests send SIGTERM to the test "
                                             "process itself; the fixture gives SIGTERM its "
                                             "default action back (the preemption watcher's "
                                             "uninstall has no public face)",
    "tf_compat/test_tf_multi_worker_util.py": "TF's multi_worker_util (jaxdist's "
                                              "cluster.validation)",
    "tf_compat/test_tf_slurm_cluster_resolver.py": "TF's Slurm host-list expansion helpers",
}

# Test files that import jaxdist._src and belong to parallel work on the same modules (the
# Trainer, the Keras adapter, the transport, the import layers, the docstrings): they move to
# tests/internal/ or to public names once that work is merged. This list only shrinks.
PENDING_MOVE: dict[str, str] = {}


# ---------------------------------------------------------------------- reading the surface
def public_module_files(root: pathlib.Path = ROOT / "jaxdist") -> list[str]:
    """The importable public modules: every ``.py`` under ``jaxdist/`` outside ``_src`` (and
    no ``__main__``)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if "_src" in parts or parts[-1] == "__main__" or any(p.startswith("_") and
                                                             p != "__init__" for p in parts):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append(".".join(parts))
    return out


def parse_api_md(text: str) -> dict[str, list[str]]:
    """``{module: [names in the order listed]}`` from docs/api.md: a ``## `module` `` heading
    per module, then one ``- `name`: description`` line per name.

    Raises:
        ValueError: a name line outside a module, a name without a description, a module
            listed twice.
    """
    out: dict[str, list[str]] = {}
    current = None
    for i, line in enumerate(text.splitlines(), 1):
        m = re.fullmatch(r"## `([\w.]+)`\s*", line)
        if m:
            current = m.group(1)
            if current in out:
                raise ValueError(f"docs/api.md:{i}: module {current} is listed twice")
            out[current] = []
            continue
        if line.startswith("## "):
            current = None
            continue
        m = re.match(r"- `(\w+)`(.*)", line)
        if m and current is not None:
            if not re.match(r": \S", m.group(2)):
                raise ValueError(f"docs/api.md:{i}: `{m.group(1)}` has no ': description'")
            out[current].append(m.group(1))
        elif m:
            raise ValueError(f"docs/api.md:{i}: `{m.group(1)}` is listed outside a module")
    return out


def _api_doc() -> types.ModuleType:
    """``tools/api_doc.py`` (not a package: loaded by path)."""
    spec = importlib.util.spec_from_file_location("api_doc", ROOT / "tools" / "api_doc.py")
    api_doc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(api_doc)
    return api_doc


API_DOC = _api_doc()
#: A public module by name (the generator's own lookup, so the tests read what it writes).
load = API_DOC.load


def undeclared_names(module: types.ModuleType, public_modules: set[str]) -> list[str]:
    """Public (non-underscore) attributes of ``module`` that are jaxdist's and not in its
    ``__all__``: names defined there, or imported from jaxdist. Other libraries' objects
    (``sys``, ``typing.Any``) and documented public submodules are not jaxdist's surface."""
    declared = set(getattr(module, "__all__", ()))
    out = []
    for name, value in sorted(vars(module).items()):
        if name.startswith("_") or name in declared:
            continue
        if isinstance(value, types.ModuleType):
            mod_name = value.__name__
            if (mod_name.split(".")[0] != "jaxdist" or mod_name in public_modules
                    or value is module):
                continue
            out.append(f"{name} (module {mod_name})")
            continue
        owner = getattr(value, "__module__", None)
        if isinstance(owner, str) and owner.split(".")[0] not in ("jaxdist", module.__name__):
            continue  # another library's object, imported for use here
        out.append(name)
    return out


def _example_lines(doc: str | None) -> list[str]:
    lines = []
    for line in (doc or "").splitlines():
        s = line.strip()
        if s.startswith(">>>") or s.startswith("..."):
            lines.append(s[3:].strip())
    return lines


def _resolves_publicly(dotted: str, api: dict[str, list[str]]) -> bool:
    """Whether ``jaxdist.a.b.c`` is reached through public modules and their ``__all__``
    (attributes of a public object, e.g. a class's methods, are fine)."""
    parts = dotted.split(".")
    module = parts[0]
    i = 1
    while i < len(parts):
        nxt = f"{module}.{parts[i]}"
        if nxt in api:
            module, i = nxt, i + 1
            continue
        return parts[i] in api.get(module, ()) or (module == "jaxdist.tpu"
                                                   and parts[i] == "experimental")
    return module in api


def private_references(doc: str | None, api: dict[str, list[str]]) -> list[str]:
    """The jaxdist names an example in ``doc`` uses that are not public."""
    bad = []
    for line in _example_lines(doc):
        for m in re.finditer(r"from\s+(jaxdist[\w.]*)\s+import\s+([\w\s,()]+)", line):
            module, names = m.group(1), re.findall(r"\w+", m.group(2).split(" as ")[0])
            for name in names:
                if not _resolves_publicly(f"{module}.{name}", api):
                    bad.append(f"from {module} import {name}")
        code = re.sub(r"from\s+jaxdist[\w.]*\s+import.*", "", line)
        for m in re.finditer(r"\bjaxdist(?:\.\w+)+", code):
            if not _resolves_publicly(m.group(0), api):
                bad.append(m.group(0))
        if "_src" in line and not bad:
            bad.append(line)
    return bad


def documented_objects(module: types.ModuleType) -> list[tuple[str, object]]:
    """The module and each of its public names, with the methods and properties of its
    classes: everything whose docstring a user reads."""
    out: list[tuple[str, object]] = [(module.__name__, module)]
    for name in getattr(module, "__all__", ()):
        value = getattr(module, name)
        if isinstance(value, types.ModuleType):
            continue
        out.append((f"{module.__name__}.{name}", value))
        if inspect.isclass(value):
            for attr, member in vars(value).items():
                if attr.startswith("_") and attr != "__init__":
                    continue
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if inspect.isfunction(member) or isinstance(member, property):
                    out.append((f"{module.__name__}.{name}.{attr}", member))
    return out


def src_imports(path: pathlib.Path) -> list[str]:
    """The ``jaxdist._src`` modules a Python file imports (anywhere in it)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("jaxdist._src")]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("jaxdist._src"):
                out.append(node.module)
            elif node.module == "jaxdist" and any(a.name == "_src" for a in node.names):
                out.append("jaxdist._src")
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and str(arg.value).startswith("jaxdist._src"):
                out.append(arg.value)
    return out


# ---------------------------------------------------------------------- the checkers' own tests
def test_parse_api_md_reads_modules_and_names_and_refuses_a_bare_name():
    text = "# API\n\n## `pkg`\n\nintro\n\n- `A`: a class.\n- `f`: a function.\n\n## `pkg.sub`\n"
    assert parse_api_md(text) == {"pkg": ["A", "f"], "pkg.sub": []}
    with pytest.raises(ValueError, match="`g` has no ': description'"):
        parse_api_md("## `pkg`\n- `g`\n")
    with pytest.raises(ValueError, match="listed twice"):
        parse_api_md("## `pkg`\n## `pkg`\n")


def test_undeclared_names_flags_jaxdist_names_outside_all():
    fake = types.ModuleType("jaxdist.fake")
    exec("import os\nfrom typing import Any\n__all__ = ['f']\n"
         "def f(): pass\ndef g(): pass\nCONSTANT = 3\n", fake.__dict__)
    fake.helper = importlib.import_module("jaxdist").get_strategy  # imported, undeclared
    fake.internal = types.ModuleType("jaxdist._src.fake")  # a private module, exposed
    assert undeclared_names(fake, {"jaxdist"}) == [
        "CONSTANT", "g", "helper", "internal (module jaxdist._src.fake)"]


def test_private_references_flags_private_and_unknown_names():
    api = {"jaxdist": ["MirroredStrategy"], "jaxdist.ps": ["optimizers"],
           "jaxdist.ps.optimizers": ["adam"], "jaxdist.tpu": ["Topology"]}
    ok = """Example:
        >>> s = jaxdist.MirroredStrategy()
        >>> from jaxdist.ps import optimizers
        >>> opt = jaxdist.ps.optimizers.adam(1e-3)
        >>> t = jaxdist.tpu.experimental.Topology("v5e:2x2")
        jaxdist._src in prose (not an example line) is not checked here
    """
    assert private_references(ok, api) == []
    bad = """
        >>> from jaxdist._src.train.models import MLP
        >>> x = jaxdist.NotPublic()
        ... jaxdist.ps.optimizers.lamb(1)
        >>> s.run(fn)  # as jaxdist._src.strategies.strategy does
    """
    assert private_references(bad, api) == [
        "from jaxdist._src.train.models import MLP", "jaxdist.NotPublic",
        "jaxdist.ps.optimizers.lamb", "jaxdist._src.strategies.strategy"]


def test_src_imports_finds_every_form(tmp_path):
    f = tmp_path / "test_x.py"
    f.write_text("import jaxdist._src.ps.wire\nfrom jaxdist._src.cluster import tls\n"
                 "from jaxdist import _src\nimport importlib\n"
                 "def t():\n    importlib.import_module('jaxdist._src.keras')\n"
                 "from jaxdist import MirroredStrategy\n")
    assert src_imports(f) == ["jaxdist._src.ps.wire", "jaxdist._src.cluster", "jaxdist._src",
                              "jaxdist._src.keras"]


# ---------------------------------------------------------------------- the package itself
@pytest.fixture(scope="module")
def api() -> dict[str, list[str]]:
    return parse_api_md(API_MD.read_text(encoding="utf-8"))


def test_api_md_lists_every_public_module_and_no_other(api):
    files = set(public_module_files())
    attribute_modules = set()  # modules reached as a name in an __all__ (jaxdist.ps.optimizers)
    for module in files:
        mod = load(module)
        for name in getattr(mod, "__all__", ()):
            value = getattr(mod, name)
            if isinstance(value, types.ModuleType) and value.__name__.startswith("jaxdist._src"):
                attribute_modules.add(f"{module}.{name}")
    expected = files | attribute_modules
    assert sorted(set(api) - expected) == [], "docs/api.md lists modules that do not exist"
    assert sorted(expected - set(api)) == [], "public modules missing from docs/api.md"


def test_all_equals_api_md_and_is_sorted(api):
    for module, names in api.items():
        mod = load(module)
        assert hasattr(mod, "__all__"), f"{module} has no __all__"
        declared = list(mod.__all__)
        assert declared == sorted(declared), f"{module}.__all__ is not sorted"
        missing = sorted(set(declared) - set(names))
        extra = sorted(set(names) - set(declared))
        assert not missing, f"{module}: in __all__ but not in docs/api.md: {missing}"
        assert not extra, f"{module}: in docs/api.md but not in __all__: {extra}"
        assert names == declared, f"{module}: docs/api.md lists the names in another order"


def test_api_md_is_generated():
    """docs/api.md is what tools/api_doc.py writes (each description: the first paragraph of the
    name's docstring)."""
    api_doc = API_DOC
    want = api_doc.render()
    have = API_MD.read_text(encoding="utf-8")
    diff = "".join(list(difflib.unified_diff(have.splitlines(True), want.splitlines(True),
                                             "docs/api.md", "generated"))[:40])
    assert have == want, (f"docs/api.md is out of date: run `{api_doc.COMMAND}` (it writes "
                          f"docs/api.md from the public __all__s and docstrings):\n{diff}")


def test_every_name_in_all_resolves(api):
    for module in api:
        mod = load(module)
        unresolved = [n for n in mod.__all__ if not hasattr(mod, n)]
        assert not unresolved, f"{module}.__all__ names what it does not have: {unresolved}"


def test_public_modules_expose_only_their_all(api):
    for module in api:  # importing them all first: submodules become attributes of parents
        load(module)
    bad = {m: undeclared_names(load(m), set(api)) for m in api}
    bad = {m: names for m, names in bad.items() if names}
    assert not bad, ("public modules expose jaxdist names that are not in their __all__ (make "
                     f"them private with a leading underscore, or declare them): {bad}")


def test_docstring_examples_use_public_names_only(api):
    bad = {}
    for module in api:
        for where, obj in documented_objects(load(module)):
            refs = private_references(inspect.getdoc(obj), api)
            if refs:
                bad[where] = refs
    assert not bad, f"docstring examples that use private or unknown names: {bad}"


def test_tests_outside_internal_import_no_private_module():
    offenders = {}
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS)
        if rel.parts[0] == "internal":
            continue
        key = rel.as_posix()
        if key in SRC_IMPORT_ALLOWED or key in PENDING_MOVE:
            continue
        found = src_imports(path)
        if found:
            offenders[key] = sorted(set(found))
    assert not offenders, ("tests outside tests/internal/ import private modules; use the "
                           f"public names (docs/api.md) or move the test there: {offenders}")


def test_allow_lists_name_files_that_still_need_them():
    stale = [k for k in {**SRC_IMPORT_ALLOWED, **PENDING_MOVE}
             if not (TESTS / k).exists() or not src_imports(TESTS / k)]
    assert not stale, f"delete from SRC_IMPORT_ALLOWED / PENDING_MOVE (no longer needed): {stale}"


def test_internal_tests_are_collected():
    internal = TESTS / "internal"
    assert any(internal.glob("test_*.py")), "tests/internal/ holds no tests"
    # pytest's testpaths is "tests", so tests/internal is collected by every CI pass.
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'testpaths\s*=\s*\["tests"\]', text), "pyproject's testpaths changed"


if __name__ == "__main__":
    sys.exit(pytest.main([os.path.abspath(__file__), "-q"]))
