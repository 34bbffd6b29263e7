"""The package's import structure: every module imports alone, no circles, arrows point down.

The layers (docs/architecture.md), read from the imports of every file (imports inside functions
included: they run all the same; ``if TYPE_CHECKING:`` blocks, which never run, left out of the
layers, but not of the circles: with them counted there is no circle either):

    job -> train -> coordinator -> strategies -> (input, ps, distributed) -> transport
        -> security -> cluster -> compat
    keras -> strategies (and what strategies may import); input -> values; distributed ->
    security; launch (the launchers, imported by no private package) -> distributed

The public modules (``jaxdist/*.py``, ``jaxdist/train/``, ``jaxdist/testing/``) may import
anything; nothing under ``jaxdist/_src`` imports them. Between files there is no circle at all.

One facade: every ``jaxdist/_src/**/__init__.py`` holds a docstring and nothing else (each name
is imported from the file that defines it), and no module reads another module's private names
(``from x import _name``, ``x._name``): a name another module uses loses its underscore.

docs/architecture.md's table of allowed arrows is read here (``read_doc_table``): an arrow in the
code that it does not allow fails, and so does a table that differs from ``ALLOWED``.

The checker (``module_graph``, ``find_cycles``, ``layer_violations``, ``read_doc_table``,
``table_differences``) is tested on small synthetic graphs and documents first, so a circle, an
upward arrow, an arrow the doc does not allow and a doc out of step are known to fail the test.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Mapping

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jaxdist")
ARCHITECTURE_MD = os.path.join(os.path.dirname(ROOT), "docs", "architecture.md")

# Package -> the jaxdist packages it may import (a package may always import its own modules).
# "*" means anything. The packages are those of the private tree jaxdist/_src/; the public
# modules (jaxdist/__init__.py, jaxdist/launch.py, jaxdist/train/, jaxdist/testing/ ...) are the
# package "" and sit above everything (no private module imports a public one).
_BELOW_STRATEGIES = {"input", "ps", "transport", "distributed", "security", "cluster", "values"}
ALLOWED: dict[str, set[str] | str] = {
    "compat": set(),  # adapters over third-party internals: the bottom layer
    "values": {"compat"},
    "cluster": {"compat"},
    # TLS identities, the local PKI, the cluster's credentials (read from TF_CONFIG in cluster).
    "security": {"cluster", "compat"},
    # A job's life: the bring-up of a synchronous cluster, preemption, the agreed checkpoint step.
    "distributed": {"security", "cluster", "compat"},
    "input": {"values", "compat"},
    "transport": {"security", "cluster", "compat"},  # the RPC layer under ps and coordinator
    "ps": {"transport", "security", "cluster", "values", "compat"},
    "strategies": {*_BELOW_STRATEGIES, "compat"},
    "coordinator": {"strategies", *_BELOW_STRATEGIES, "compat"},
    "keras": {"strategies", *_BELOW_STRATEGIES, "compat"},
    "train": {"coordinator", "strategies", *_BELOW_STRATEGIES, "compat"},
    # The CLI and its job config (python -m jaxdist.train) over the Trainer library.
    "job": {"train", "coordinator", "strategies", *_BELOW_STRATEGIES, "compat"},
    # The launchers (local processes, Slurm, Ray) and the local test clusters: they start
    # processes and read the cluster; nothing under _src imports them.
    "launch": {"distributed", "security", "cluster", "compat"},
    "_src": set(),  # the private tree's own __init__: a docstring
    "publish": set(),  # jaxdist/_src/publish.py: the public modules' one helper
    "": "*",  # the public modules (jaxdist/*.py, jaxdist/train/, jaxdist/testing/) sit on top
}

# Explicit exceptions, each naming why it is still there. Keep these empty: an entry is a bug to
# fix (issue 12), not a rule.
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()   # (importer, imported) arrows
KNOWN_CYCLES: list[list[str]] = []             # circles, as find_cycles reports them


# ---------------------------------------------------------------------- the checker
def _module_name(path: str, root: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(root))[: -len(".py")]
    parts = rel.split(os.sep)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _walk(node: ast.AST, type_checking: bool = False) -> Iterable[ast.AST]:
    """``ast.walk`` without the bodies of ``if TYPE_CHECKING:`` (they never run), unless
    ``type_checking``."""
    todo = [node]
    while todo:
        node = todo.pop()
        yield node
        if _is_type_checking(node) and not type_checking:
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _imports(tree: ast.AST, module: str, is_package: bool,
             type_checking: bool = False) -> Iterable[tuple[str, list[str]]]:
    """Yields ``(base, names)`` for every import in ``tree`` that can run: function bodies
    included, ``if TYPE_CHECKING:`` blocks (annotations only) left out unless
    ``type_checking``."""
    for node in _walk(tree, type_checking):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = module.split(".")
                if not is_package:
                    pkg = pkg[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            yield base, [a.name for a in node.names]


def module_graph(root: str = ROOT, type_checking: bool = False) -> dict[str, set[str]]:
    """``{module: {jaxdist modules it imports}}`` for every ``.py`` file under ``root``
    (with the imports of ``if TYPE_CHECKING:`` blocks when ``type_checking``).

    ``from a.b import c`` is an arrow to ``a.b.c`` when that is a module, else to ``a.b``.
    """
    files: dict[str, str] = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                files[_module_name(path, root)] = path
    top = os.path.basename(root)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        out: set[str] = set()
        is_package = path.endswith("__init__.py")
        for base, names in _imports(tree, module, is_package, type_checking):
            if base != top and not base.startswith(top + "."):
                continue
            targets = [f"{base}.{n}" for n in names if f"{base}.{n}" in files]
            if len(targets) < len(names) or not names:
                # Some names are attributes of ``base`` itself; ``import a.b`` needs ``a.b``.
                while base not in files and "." in base:
                    base = base.rsplit(".", 1)[0]
                targets.append(base)
            out.update(t for t in targets if t != module)
        graph[module] = out
    return graph


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        # Iterative Tarjan: (node, iterator over its successors).
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, succ = work[-1]
            advanced = False
            for w in succ:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    advanced = True
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _packages(root: str = ROOT) -> set[str]:
    src = os.path.join(root, "_src")
    return {d for d in os.listdir(src) if os.path.isfile(os.path.join(src, d, "__init__.py"))}


_PACKAGES = _packages()


def package_of(module: str) -> str:
    """``jaxdist._src.train.job`` -> ``train``; ``jaxdist._src`` itself -> ``_src``; a public
    module (``jaxdist.launch``, ``jaxdist.train``, ``jaxdist.testing.tls``) -> ``""``."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] == "_src":
        return parts[2] if len(parts) > 2 else "_src"
    return ""


def layer_violations(graph: Mapping[str, Iterable[str]],
                     allowed: Mapping[str, set[str] | str] = ALLOWED,
                     exceptions: set[tuple[str, str]] = frozenset()) -> list[str]:
    """``"a -> b (package x may not import package y)"`` for every arrow the layers forbid."""
    out = []
    for module, targets in sorted(graph.items()):
        src = package_of(module)
        ok = allowed.get(src)
        if ok is None:
            out.append(f"{module}: package {src!r} is not in the layer table; add it")
            continue
        for t in sorted(targets):
            dst = package_of(t)
            if ok == "*" or dst == src or dst in ok or (module, t) in exceptions:
                continue
            out.append(f"{module} -> {t} (package {src or 'jaxdist'!r} may not import "
                       f"{dst or 'jaxdist'!r}; allowed: {sorted(ok)})")
    return out


def package_graph(graph: Mapping[str, Iterable[str]]) -> dict[str, set[str]]:
    """``{package: {packages it imports}}`` from a module graph (``""``: the public modules)."""
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        src = package_of(module)
        out.setdefault(src, set()).update(
            dst for dst in map(package_of, targets) if dst != src)
    return out


#: The line just above the table of allowed arrows in docs/architecture.md.
DOC_TABLE_MARKER = "<!-- import-layers:"
#: The doc's name for the public modules (``ALLOWED``'s package ``""``).
DOC_PUBLIC = "jaxdist"


def read_doc_table(text: str) -> dict[str, set[str] | str]:
    """The allowed arrows of docs/architecture.md: ``{package: {packages} or "*"}``.

    The table follows the line starting with ``DOC_TABLE_MARKER``; each row's first cell is a
    package in backticks (``jaxdist`` for the public modules: ``""``), its second cell names
    every package it may import in backticks, or says ``anything`` (``"*"``) or ``nothing``.

    Raises:
        ValueError: no marker, no rows, a row without one package in backticks, a second cell
            that names nothing and is not ``nothing``, or a package listed twice.
    """
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith(DOC_TABLE_MARKER))
    except StopIteration:
        raise ValueError(f"no line starting with {DOC_TABLE_MARKER!r} above the table of "
                         f"allowed arrows") from None
    rows = []
    for line in lines[start + 1:]:
        if not line.strip().startswith("|"):
            break
        rows.append(line)
    table: dict[str, set[str] | str] = {}
    for row in rows[2:]:  # after the header and the |---| line
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        names = re.findall(r"`([^`]+)`", cells[0])
        if len(cells) < 2 or len(names) != 1 or cells[0] != f"`{names[0]}`":
            raise ValueError(f"row {row!r}: expected `package` | `a`, `b` ... (or anything / "
                             f"nothing) | why")
        package = "" if names[0] == DOC_PUBLIC else names[0]
        if package in table:
            raise ValueError(f"row {row!r}: package {names[0]!r} is listed twice")
        allowed = re.findall(r"`([^`]+)`", cells[1])
        if cells[1] == "anything":
            table[package] = "*"
        elif allowed:
            table[package] = set(allowed)
        elif cells[1] == "nothing":
            table[package] = set()
        else:
            raise ValueError(f"row {row!r}: the second cell {cells[1]!r} names no package in "
                             f"backticks and is not 'anything' or 'nothing'")
    if not table:
        raise ValueError(f"no table rows below {DOC_TABLE_MARKER!r}")
    return table


def table_differences(doc: Mapping[str, set[str] | str],
                      allowed: Mapping[str, set[str] | str] = ALLOWED) -> list[str]:
    """Where the doc's table and ``allowed`` differ, one line per package."""

    def show(rule: set[str] | str) -> str:
        return "anything" if rule == "*" else str(sorted(rule))

    out = []
    for package in sorted(set(doc) | set(allowed)):
        name = package or DOC_PUBLIC
        if package not in doc:
            out.append(f"{name}: ALLOWED has it ({show(allowed[package])}), the doc's table "
                       f"does not")
        elif package not in allowed:
            out.append(f"{name}: the doc's table has it ({show(doc[package])}), ALLOWED does "
                       f"not")
        elif doc[package] != allowed[package]:
            out.append(f"{name}: the doc's table allows {show(doc[package])}, ALLOWED allows "
                       f"{show(allowed[package])}")
    return out


def _doc_table() -> dict[str, set[str] | str]:
    with open(ARCHITECTURE_MD, encoding="utf-8") as f:
        return read_doc_table(f.read())


# ---------------------------------------------------------------------- the checker's own tests
def _write(root: str, files: Mapping[str, str]) -> None:
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(textwrap.dedent(text))


def test_checker_finds_a_circle_through_an_import_inside_a_function(tmp_path):
    root = tmp_path / "jaxdist"
    _write(str(root), {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/x.py": "from jaxdist.a.y import f\n",
        "a/y.py": "def f():\n    from jaxdist.a import z\n",
        "a/z.py": "import jaxdist.a.x\n",
        "a/t.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import jaxdist.a.u\n",
        "a/u.py": "import jaxdist.a.t\n",      # only a type-checking arrow back: no circle
        "a/w.py": "from jaxdist.a.x import f\n",   # depends on the circle, not part of it
    })
    graph = module_graph(str(root))
    assert graph["jaxdist.a.y"] == {"jaxdist.a.z"}
    assert find_cycles(graph) == [["jaxdist.a.x", "jaxdist.a.y", "jaxdist.a.z"]]
    graph["jaxdist.a.z"] = set()
    assert find_cycles(graph) == []
    with_types = module_graph(str(root), type_checking=True)
    assert ["jaxdist.a.t", "jaxdist.a.u"] in find_cycles(with_types)


def test_checker_finds_an_upward_arrow():
    graph = {
        # cluster imports nothing
        "jaxdist._src.cluster.tf_config": {"jaxdist._src.values.per_replica"},
        "jaxdist._src.input.distributed": {"jaxdist._src.values.per_replica"},   # allowed
        "jaxdist._src.strategies.strategy": {"jaxdist._src.train.job"},          # upward
        "jaxdist.testing.cluster": {"jaxdist._src.train.job"},              # testing: anything
    }
    assert package_graph(graph) == {"cluster": {"values"}, "input": {"values"},
                                    "strategies": {"train"}, "": {"train"}}
    bad = layer_violations(graph)
    assert len(bad) == 2, bad
    assert bad[0].startswith("jaxdist._src.cluster.tf_config -> jaxdist._src.values.per_replica")
    assert bad[1].startswith("jaxdist._src.strategies.strategy -> jaxdist._src.train.job")
    assert layer_violations(graph, exceptions={
        ("jaxdist._src.cluster.tf_config", "jaxdist._src.values.per_replica"),
        ("jaxdist._src.strategies.strategy", "jaxdist._src.train.job")}) == []


def test_checker_resolves_relative_and_attribute_imports(tmp_path):
    root = tmp_path / "jaxdist"
    _write(str(root), {
        "__init__.py": "from jaxdist.b import thing\n",
        "b/__init__.py": "from .c import thing\nfrom . import d\n",
        "b/c.py": "thing = 1\nfrom jaxdist import b\n",
        "b/d.py": "from ..b.c import thing\n",
    })
    graph = module_graph(str(root))
    assert graph["jaxdist"] == {"jaxdist.b"}
    assert graph["jaxdist.b"] == {"jaxdist.b.c", "jaxdist.b.d"}
    assert graph["jaxdist.b.d"] == {"jaxdist.b.c"}
    assert find_cycles(graph) == [["jaxdist.b", "jaxdist.b.c", "jaxdist.b.d"]]  # b->d->c->b


_SYNTHETIC_DOC = """
# Layers

| not | this table |
|-----|------------|
| `x` | `y` |

<!-- import-layers: read by the test -->
| package | may import (of jaxdist) | why |
|---------|-------------------------|-----|
| `compat` | nothing | bottom |
| `cluster` | `compat` | TLS (`tls.py`) is not a package: the third column is free text |
| `input` | `values`, `compat` | |
| `jaxdist` | anything | the public modules |

After the table.
"""


def test_checker_reads_the_doc_table_and_finds_an_arrow_it_does_not_allow():
    doc = read_doc_table(_SYNTHETIC_DOC)
    assert doc == {"compat": set(), "cluster": {"compat"}, "input": {"values", "compat"},
                   "": "*"}
    graph = {
        "jaxdist._src.cluster.tf_config": {"jaxdist._src.compat.jax_internals"},   # allowed
        "jaxdist._src.input.dataset": {"jaxdist._src.values.per_replica"},   # allowed
        "jaxdist._src.compat.jax_internals": {"jaxdist._src.cluster.tf_config"},   # not in the doc
        "jaxdist._src.values.per_replica": set(),                            # no row: reported
        "jaxdist.launch": {"jaxdist._src.input.dataset"},                    # public: anything
    }
    bad = layer_violations(graph, doc)
    assert len(bad) == 2, bad
    assert bad[0].startswith("jaxdist._src.compat.jax_internals -> jaxdist._src.cluster.tf_config")
    assert bad[1] == ("jaxdist._src.values.per_replica: package 'values' is not in the layer "
                      "table; add it")


def test_checker_finds_a_doc_table_out_of_step_with_allowed():
    doc = read_doc_table(_SYNTHETIC_DOC)
    assert table_differences(doc, dict(doc)) == []
    allowed = {"compat": set(), "cluster": {"compat", "values"}, "input": {"values", "compat"},
               "ps": {"cluster"}, "": "*"}
    assert table_differences(doc, allowed) == [
        "cluster: the doc's table allows ['compat'], ALLOWED allows ['compat', 'values']",
        "ps: ALLOWED has it (['cluster']), the doc's table does not"]
    assert table_differences({**doc, "input": "*", "keras": set()}, doc) == [
        "input: the doc's table allows anything, ALLOWED allows ['compat', 'values']",
        "keras: the doc's table has it ([]), ALLOWED does not"]


@pytest.mark.parametrize("text, message", [
    ("| `a` | `b` |\n", "no line starting with"),
    ("<!-- import-layers: -->\nno table\n", "no table rows"),
    ("<!-- import-layers: -->\n| p | i |\n|-|-|\n| a | `b` |\n", "expected `package`"),
    ("<!-- import-layers: -->\n| p | i |\n|-|-|\n| `a` | b, c |\n", "names no package"),
    ("<!-- import-layers: -->\n| p | i |\n|-|-|\n| `a` | nothing |\n| `a` | `b` |\n",
     "listed twice"),
])
def test_checker_refuses_a_doc_table_it_cannot_read(text, message):
    with pytest.raises(ValueError, match=message):
        read_doc_table(text)


# ---------------------------------------------------------------------- the package itself
@functools.cache
def _jaxdist_graph() -> dict[str, frozenset[str]]:
    """``module_graph()`` of the package, read once for the tests below (read-only)."""
    return {m: frozenset(t) for m, t in module_graph().items()}


def test_no_import_circle_between_files():
    cycles = [c for c in find_cycles(_jaxdist_graph()) if c not in KNOWN_CYCLES]
    assert not cycles, "import circles between files:\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_no_import_circle_even_through_type_checking_imports():
    """An ``if TYPE_CHECKING:`` import back up is a circle in the design all the same (a
    shared type belongs in the lower module, e.g. ``context.StrategyLike``)."""
    cycles = find_cycles(module_graph(type_checking=True))
    assert not cycles, "import circles through TYPE_CHECKING imports:\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_known_exceptions_are_still_needed():
    """An entry that no longer applies is deleted (the lists only shrink): a stale one fails."""
    graph = _jaxdist_graph()
    stale = [f"{a} -> {b}" for a, b in sorted(KNOWN_EXCEPTIONS) if b not in graph.get(a, ())]
    cycles = find_cycles(graph)
    stale += [" <-> ".join(c) for c in KNOWN_CYCLES if c not in cycles]
    assert not stale, "delete from KNOWN_EXCEPTIONS / KNOWN_CYCLES (fixed): " + "; ".join(stale)


def test_only_allowed_arrows_between_packages():
    missing = _PACKAGES - set(ALLOWED)
    assert not missing, f"packages without a layer in ALLOWED: {sorted(missing)}"
    bad = layer_violations(_jaxdist_graph(), exceptions=KNOWN_EXCEPTIONS)
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_doc_table_is_allowed():
    """docs/architecture.md's table and ``ALLOWED`` are the same rules."""
    diff = table_differences(_doc_table(), ALLOWED)
    assert not diff, ("docs/architecture.md's table of allowed arrows and ALLOWED in "
                      "tests/test_import_layers.py differ (change both):\n" + "\n".join(diff))


def test_only_arrows_the_doc_table_allows():
    doc = _doc_table()
    missing = _PACKAGES - set(doc)
    assert not missing, f"packages without a row in docs/architecture.md: {sorted(missing)}"
    bad = layer_violations(_jaxdist_graph(), doc, exceptions=KNOWN_EXCEPTIONS)
    assert not bad, "imports that docs/architecture.md's table does not allow:\n" + "\n".join(bad)


def package_inits_with_code(root: str = ROOT) -> list[str]:
    """The ``__init__.py`` files under ``root/_src`` that hold more than a docstring.

    One facade (optax's way): a public module imports each name from the file that defines it
    (``from jaxdist._src.ps.client import PSClient``); a private package's ``__init__`` only
    says what the package is, and re-exports nothing.
    """
    out = []
    for dirpath, _, names in os.walk(os.path.join(root, "_src")):
        if "__init__.py" not in names:
            continue
        path = os.path.join(dirpath, "__init__.py")
        with open(path, encoding="utf-8") as f:
            body = ast.parse(f.read(), path).body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]
        if body:
            rel = os.path.relpath(path, os.path.dirname(root))
            out.append(f"{rel}:{body[0].lineno}: {type(body[0]).__name__}")
    return sorted(out)


def test_checker_finds_code_in_a_package_init(tmp_path):
    root = tmp_path / "jaxdist"
    _write(str(root), {
        "__init__.py": "from jaxdist._src.a.x import f\n",      # a public module: anything
        "_src/__init__.py": '"""The private tree."""\n',
        "_src/a/__init__.py": '"""A."""\n\nfrom jaxdist._src.a.x import f\n',
        "_src/a/x.py": "def f(): pass\n",
        "_src/b/__init__.py": "",
        "_src/b/c/__init__.py": '"""C."""\nX = 1\n',
    })
    assert package_inits_with_code(str(root)) == [
        os.path.join("jaxdist", "_src", "a", "__init__.py") + ":3: ImportFrom",
        os.path.join("jaxdist", "_src", "b", "c", "__init__.py") + ":2: Assign"]


def test_private_package_inits_hold_a_docstring_only():
    bad = package_inits_with_code()
    assert not bad, ("a jaxdist/_src package __init__.py holds more than a docstring; import "
                     "each name from its defining module instead (one facade: the public "
                     "modules):\n" + "\n".join(bad))


def _defines(root: str, module: str, name: str) -> bool:
    """Whether ``module`` (a dotted name under ``root``'s parent) defines ``name`` at its top
    level (``def``, ``class``, an assignment) or has a submodule ``name``."""
    base = os.path.join(os.path.dirname(root), *module.split("."))
    if os.path.exists(os.path.join(base, name + ".py")) or os.path.isfile(
            os.path.join(base, name, "__init__.py")):
        return True
    path = base + ".py" if os.path.exists(base + ".py") else os.path.join(base, "__init__.py")
    if not os.path.exists(path):
        return False
    with open(path, encoding="utf-8") as f:
        body = ast.parse(f.read(), path).body
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == name:
                return True
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
    return False


def public_imports_not_from_the_defining_file(root: str = ROOT) -> list[str]:
    """The names a public module imports from a private module that does not define them
    (``from jaxdist._src.job.config import ConfigError`` when ``schema.py`` defines it), and the
    same for ``jaxdist.train``'s lazy table ``_LAZY`` (name -> module)."""
    out = []
    for dirpath, _, names in os.walk(root):
        if os.path.join(root, "_src") in os.path.join(dirpath, ""):
            continue
        for file in sorted(names):
            if not file.endswith(".py"):
                continue
            path = os.path.join(dirpath, file)
            rel = os.path.relpath(path, os.path.dirname(root))
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                        node.module.startswith(os.path.basename(root) + "._src"):
                    out += [f"{rel}:{node.lineno}: {a.name} from {node.module}"
                            for a in node.names if not _defines(root, node.module, a.name)]
                elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and any(
                        isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
                    for k, v in zip(node.value.keys, node.value.values):
                        if isinstance(k, ast.Constant) and isinstance(v, ast.Constant) and \
                                not _defines(root, v.value, k.value):
                            out.append(f"{rel}:{k.lineno}: {k.value} from {v.value} (_LAZY)")
    return sorted(out)


def test_checker_finds_a_public_import_through_a_re_export(tmp_path):
    root = tmp_path / "jaxdist"
    _write(str(root), {
        "__init__.py": "from jaxdist._src.a.x import f, sub\nfrom jaxdist._src.a.y import f as g\n"
                       "_LAZY = {'F': 'jaxdist._src.a.x', 'G': 'jaxdist._src.a.y',\n"
                       "         'f': 'jaxdist._src.a.y'}\n",
        "_src/__init__.py": "",
        "_src/a/__init__.py": "",
        "_src/a/x.py": "def f(): pass\nF = 1\n",
        "_src/a/sub.py": "",                       # a module of a, not of x
        "_src/a/y.py": "from jaxdist._src.a.x import F, f\nG = F\n",
    })
    assert public_imports_not_from_the_defining_file(str(root)) == [
        os.path.join("jaxdist", "__init__.py") + ":1: sub from jaxdist._src.a.x",
        os.path.join("jaxdist", "__init__.py") + ":2: f from jaxdist._src.a.y",
        os.path.join("jaxdist", "__init__.py") + ":4: f from jaxdist._src.a.y (_LAZY)"]


def test_public_modules_import_each_name_from_its_defining_file():
    bad = public_imports_not_from_the_defining_file()
    assert not bad, ("public modules that import a name from a module that only re-exports it "
                     "(import it from the file that defines it):\n" + "\n".join(bad))


def private_name_reads(root: str = ROOT) -> list[str]:
    """Where a jaxdist module reads another jaxdist module's private (underscored) names:
    ``from jaxdist.a.b import _name`` and ``b._name`` with ``b`` an imported jaxdist module.

    A name another module uses is not private: it loses its underscore where it is defined.
    Importing a public name under a private alias (``import publish as _publish``) is fine.
    """
    files: dict[str, str] = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                files[_module_name(path, root)] = path
    top = os.path.basename(root)

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    out = []
    for module, path in sorted(files.items()):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        rel = os.path.relpath(path, os.path.dirname(root))
        aliases: dict[str, str] = {}  # local name -> the jaxdist module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                    node.module == top or node.module.startswith(top + ".")):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full in files:
                        aliases[a.asname or a.name] = full
                    elif private(a.name) and node.module != module:
                        out.append(f"{rel}:{node.lineno}: from {node.module} import {a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in files:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and private(node.attr)
                    and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and aliases[node.value.id] != module):
                out.append(f"{rel}:{node.lineno}: {node.value.id}.{node.attr} "
                           f"({aliases[node.value.id]})")
    return sorted(set(out))


def test_checker_finds_private_names_read_across_modules(tmp_path):
    root = tmp_path / "jaxdist"
    _write(str(root), {
        "__init__.py": "from jaxdist.a.x import f as _f\n",           # public name, private alias
        "a/__init__.py": "",
        "a/x.py": "def f(): pass\ndef _g(): pass\n_STATE = {}\nprint(_g, _STATE)\n",
        "a/y.py": "from jaxdist.a.x import _g\nfrom jaxdist.a import x\nx._STATE['k'] = 1\n"
                  "x.f()\nx.__name__\n",
        "a/z.py": "import jaxdist.a.x as xx\nxx._g()\n",
    })
    y, z = os.path.join("jaxdist", "a", "y.py"), os.path.join("jaxdist", "a", "z.py")
    assert private_name_reads(str(root)) == [
        f"{y}:1: from jaxdist.a.x import _g", f"{y}:3: x._STATE (jaxdist.a.x)",
        f"{z}:2: xx._g (jaxdist.a.x)"]


def test_no_module_reads_another_modules_private_names():
    bad = private_name_reads()
    assert not bad, ("jaxdist modules that read another module's private names (a name another "
                     "module uses loses its underscore where it is defined):\n" + "\n".join(bad))


# Importing ``jaxdist.a.b`` runs ``import jaxdist`` first (Python imports the parents of a
# module before it), and that import is the same in every fresh interpreter. So a module that
# ``import jaxdist`` loads imports alone exactly when ``import jaxdist`` does, and any other
# module imports alone exactly when it imports in the state ``import jaxdist`` leaves. The
# script imports jaxdist once, then forks one child per other module from that state: each
# child runs only that module's own jaxdist code (the third-party packages, imported once
# before jaxdist, stay imported: they import nothing of jaxdist).
_IMPORT_EACH = """
import importlib, json, os, sys, traceback
import jax, numpy, flax, optax, keras, grpc, orbax  # third-party only: stay imported
names = json.loads(sys.argv[1])
failed, forked = {}, []
try:
    import jaxdist
except BaseException:
    failed["jaxdist"] = traceback.format_exc(limit=-3)
    loaded = []
else:
    loaded = sorted(k for k in sys.modules if k == "jaxdist" or k.startswith("jaxdist."))
    for name in names:
        if name in sys.modules:
            continue
        forked.append(name)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: import one module, write its traceback if it fails
            os.close(read)
            code = 0
            try:
                importlib.import_module(name)
            except BaseException:
                os.write(write, traceback.format_exc(limit=-3).encode())
                code = 1
            os._exit(code)
        os.close(write)
        with os.fdopen(read, "rb") as f:
            error = f.read().decode()
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code or error:
            failed[name] = error or f"the child importing it exited with {code}"
print(json.dumps({"failed": failed, "loaded": loaded, "forked": forked}))
"""


def test_every_module_imports_alone():
    modules = sorted(m for m in _jaxdist_graph() if not m.endswith("__main__"))
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=os.path.dirname(ROOT) + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _IMPORT_EACH, json.dumps(modules)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = out["failed"]
    assert not failed, "modules that fail to import alone:\n" + "\n".join(
        f"{k}:\n{v}" for k, v in failed.items())
    # Every module was checked: loaded by ``import jaxdist`` or imported in a child of its own.
    assert set(modules) <= set(out["loaded"]) | set(out["forked"]), \
        sorted(set(modules) - set(out["loaded"]) - set(out["forked"]))
    assert out["forked"], "every module loaded with jaxdist: no child imported one alone"
    assert len(modules) > 50  # the walk found the package



_IMPORTED_BY_IMPORT_JAXDIST = """
import json, sys
import jaxdist
heavy = ("flax", "optax", "orbax", "grpc", "jaxdist._src.ps", "jaxdist._src.coordinator",
         "jaxdist.ps", "jaxdist.coordinator")
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy[:4]
                        or any(m == h or m.startswith(h + ".") for h in heavy[4:]))))
jaxdist.ParameterServerStrategy, jaxdist.ps.PSClient, jaxdist.coordinator.ClusterCoordinator
print(json.dumps(sorted(m for m in sys.modules if m.startswith("jaxdist._src.ps."))))
"""


def test_import_jaxdist_leaves_the_trainer_and_parameter_server_modules_for_first_use():
    """``import jaxdist`` (a synchronous program) imports neither flax/optax/orbax nor the
    parameter-server packages; their names still resolve, on first use."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(ROOT) + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _IMPORTED_BY_IMPORT_JAXDIST],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after = (json.loads(line) for line in proc.stdout.strip().splitlines()[-2:])
    assert before == [], f"import jaxdist imported {before}"
    assert "jaxdist._src.ps.client" in after

if __name__ == "__main__":
    # The arrows between packages in the code (docs/architecture.md shows them).
    for package, targets in sorted(package_graph(module_graph()).items(),
                                   key=lambda kv: (-len(kv[1]), kv[0])):
        print(f"  {package or 'public modules':<14} -> {', '.join(sorted(targets)) or '-'}")
