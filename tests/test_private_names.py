"""No module of jaxdist reads another module's private names; no ``_jaxdist_*`` tags on objects
jaxdist does not own.

A private name (one leading underscore) belongs to the file that defines it: a name another
module uses loses its underscore (or the owner offers a function for it). The scan reads every
file of ``jaxdist/`` (no import):

* the private names a file defines: ``def _x`` / ``class _X``, an assignment to ``_x`` at module
  or class level, a store to ``self._x`` / ``cls._x``, a ``"_x"`` given to
  ``object.__setattr__`` / ``setattr`` or listed in ``__slots__``;
* its reads of private names: ``obj._x`` (``obj`` not ``self``, ``cls`` or ``super()``),
  ``getattr(obj, "_x")`` / ``hasattr`` / ``setattr`` with a constant name, and
  ``from jaxdist... import _x``.

A read of ``_x`` is foreign when this file defines no ``_x`` and another jaxdist file does (a
name no jaxdist file defines belongs to a third-party library: ``jaxdist/_src/compat`` is where
those are read). Not foreign: a subclass calling its base's hook through ``super()``; a class
reading its own attributes through ``self`` / ``cls`` (a mixin of ``StrategyExtended`` reads
what ``StrategyExtended.__init__`` sets: one object); ``other._x`` of the same class in the
same file. ``ALLOWED_ANYWHERE`` (the standard library's names) and ``ALLOWED`` list the foreign
reads left, each with its reason.

``_jaxdist_*`` attributes: none is set or read on an object (``obj._jaxdist_x``, ``getattr``
/ ``setattr`` with such a name, or such a name held in a string) outside ``TAGS_ALLOWED``: a
registry keyed by the object (``weakref.WeakSet`` / ``WeakKeyDictionary``) in the module that
owns the concept replaces a tag on a function or a Keras object, and an attribute of
jaxdist's own classes is declared and documented there under a public name.

The checker is tested on small synthetic sources first, so a foreign read and a tag are known
to fail the test.
"""

from __future__ import annotations

import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxdist"

#: Reads allowed in every file: the standard library's private names.
ALLOWED_ANYWHERE: dict[str, str] = {
    "os._exit": "the standard library's exit without cleanup (cluster/runtime.py happens to "
                "define a method of that name)",
}

_KERAS = ("Keras's private attribute, read in compat/ (the one place third-party internals are "
          "read); a jaxdist file happens to define a name alike")

#: (file relative to the repository, the read as ast.unparse writes it): why it stays.
ALLOWED: dict[tuple[str, str], str] = {
    ("jaxdist/_src/compat/keras_internals.py", "optimizer._learning_rate"): _KERAS,
    ("jaxdist/_src/compat/keras_internals.py", "variable._layout"): _KERAS,
    ("jaxdist/_src/compat/keras_internals.py", "variable._value"): _KERAS,
    # Defined in jaxdist/_src/input/dataset.py (Dataset._make_iter, _unseeded_shuffle).
}

#: (file, the tagged expression as ast.unparse writes it, the attribute): why it stays.
TAGS_ALLOWED: dict[tuple[str, str, str], str] = {}


def _const_str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _is_super(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "super")


def scan(tree: ast.AST) -> tuple[set[str], list[tuple[int, str, str]], list[tuple[int, str, str]]]:
    """``(defined, reads, tags)`` of one parsed file.

    ``reads``: ``(line, expression, private name)``; ``tags``: ``(line, object expression,
    _jaxdist_ attribute)`` for each ``_jaxdist_*`` attribute set or read on an object.
    """
    defined: set[str] = set()
    reads: list[tuple[int, str, str]] = []
    tags: list[tuple[int, str, str]] = []
    named: set[int] = set()  # the getattr / setattr names already reported as tags

    def targets(node: ast.AST) -> list[ast.AST]:
        if isinstance(node, ast.Assign):
            return list(node.targets)
        if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            return [node.target]
        return []

    def define_targets(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if _private(stmt.name):
                    defined.add(stmt.name)
            for t in targets(stmt):
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Name) and _private(sub.id):
                        defined.add(sub.id)
                if isinstance(t, ast.Name) and t.id == "__slots__":
                    for sub in ast.walk(stmt.value):
                        name = _const_str(sub)
                        if name and _private(name):
                            defined.add(name)

    define_targets(tree.body)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            define_targets(node.body)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
            defined.add(node.name)
        elif isinstance(node, ast.Attribute):
            name = node.attr
            if name.startswith("_jaxdist_"):
                tags.append((node.lineno, ast.unparse(node.value), name))
            if not _private(name):
                continue
            if _is_self(node.value):
                if isinstance(node.ctx, ast.Store):
                    defined.add(name)
            elif not _is_super(node.value):
                reads.append((node.lineno, ast.unparse(node), name))
        elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
            fname = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            if fname in ("getattr", "hasattr", "setattr", "delattr", "__setattr__") and \
                    len(node.args) >= 2:
                name = _const_str(node.args[1])
                if name is None:
                    continue
                obj = node.args[0]
                if name.startswith("_jaxdist_"):
                    tags.append((node.lineno, ast.unparse(obj), name))
                    named.add(id(node.args[1]))
                if not _private(name):
                    continue
                if _is_self(obj) and fname in ("setattr", "__setattr__"):
                    defined.add(name)
                elif not _is_self(obj):
                    reads.append((node.lineno, f"{ast.unparse(obj)}.{name}", name))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                node.value.startswith("_jaxdist_") and id(node) not in named:
            tags.append((node.lineno, "<a name held in a string>", node.value))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxdist"):
            for alias in node.names:
                if _private(alias.name):
                    # Always foreign: reported whether or not the name is defined here.
                    reads.append((node.lineno, f"from {node.module} import {alias.name}",
                                  "\0import"))
    return defined, reads, tags


def foreign_reads(sources: dict[str, str]) -> list[tuple[str, int, str, list[str]]]:
    """``(file, line, expression, files defining the name)`` for each foreign read."""
    scanned = {f: scan(ast.parse(src)) for f, src in sources.items()}
    owners: dict[str, set[str]] = collections.defaultdict(set)
    for f, (defined, _, _) in scanned.items():
        for name in defined:
            owners[name].add(f)
    out = []
    for f, (defined, reads, _) in sorted(scanned.items()):
        for line, expr, name in reads:
            if name == "\0import":
                out.append((f, line, expr, []))
            elif name not in defined and owners.get(name):
                out.append((f, line, expr, sorted(owners[name])))
    return out


def tag_uses(sources: dict[str, str]) -> list[tuple[str, int, str, str]]:
    """``(file, line, object expression, attribute)`` for each ``_jaxdist_*`` attribute."""
    out = []
    for f, src in sorted(sources.items()):
        for line, obj, name in scan(ast.parse(src))[2]:
            out.append((f, line, obj, name))
    return out


def _package_sources() -> dict[str, str]:
    return {
        str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
        for p in sorted(PACKAGE.rglob("*.py"))
    }


# ---------------------------------------------------------------------------- the checker


def test_checker_finds_a_foreign_read():
    sources = {
        "a.py": "class A:\n    def __init__(self):\n        self._x = 1\n"
                "    def _hook(self):\n        pass\n",
        "b.py": "def f(a):\n    return a._x\n",
    }
    assert [(f, expr) for f, _, expr, _ in foreign_reads(sources)] == [("b.py", "a._x")]


def test_checker_finds_private_imports_getattr_and_module_names():
    sources = {
        "a.py": "_TABLE = {}\ndef _helper():\n    pass\n",
        "b.py": "from jaxdist.a import _helper\nimport a\n"
                "def f(o):\n    return a._TABLE, getattr(o, '_helper', None)\n",
    }
    found = sorted(expr for f, _, expr, _ in foreign_reads(sources))
    assert found == ["a._TABLE", "from jaxdist.a import _helper", "o._helper"]


def test_checker_leaves_own_reads_super_and_third_party_names():
    sources = {
        "a.py": "class A:\n    __slots__ = ('_s',)\n    def _hook(self):\n        pass\n"
                "    def same(self, other):\n        return other._s, other._hook\n",
        "b.py": "import a\nclass B(a.A):\n    def _hook(self):\n        return super()._hook()\n"
                "def g(model):\n    return model._keras_private\n",
    }
    assert foreign_reads(sources) == []


def test_checker_finds_tags():
    sources = {"a.py": "HOOK = '_jaxdist_hook'\n"
                       "def f(fn):\n    fn._jaxdist_seen = True\n"
                       "    return getattr(fn, '_jaxdist_seen', False)\n"}
    assert sorted((obj, name) for _, _, obj, name in tag_uses(sources)) == [
        ("<a name held in a string>", "_jaxdist_hook"), ("fn", "_jaxdist_seen"),
        ("fn", "_jaxdist_seen")]


# ---------------------------------------------------------------------------- the package


def test_no_module_reads_another_modules_private_names():
    found = foreign_reads(_package_sources())
    bad = [
        f"{f}:{line}: {expr}" + (f" (defined in {', '.join(owners)})" if owners else "")
        for f, line, expr, owners in found
        if (f, expr) not in ALLOWED and expr not in ALLOWED_ANYWHERE
    ]
    assert not bad, (
        "these read a private name another module defines; drop its underscore in the module "
        "that defines it (or add a function there), or list the read in ALLOWED with the "
        "reason:\n" + "\n".join(bad)
    )


def test_allowlist_is_current():
    found = {(f, expr) for f, _, expr, _ in foreign_reads(_package_sources())}
    stale = sorted(k for k in ALLOWED if k not in found)
    assert not stale, f"ALLOWED entries that no longer match a read: {stale}"


def test_no_jaxdist_tags_on_foreign_objects():
    bad = [
        f"{f}:{line}: {obj}.{name}"
        for f, line, obj, name in tag_uses(_package_sources())
        if (f, obj, name) not in TAGS_ALLOWED
    ]
    assert not bad, (
        "these set or read a _jaxdist_* attribute on an object: keep a registry keyed by the "
        "object (weakref.WeakKeyDictionary / WeakSet) in the module that owns the concept, or "
        "list a jaxdist-owned object's documented attribute in TAGS_ALLOWED:\n" + "\n".join(bad)
    )

