"""Writes docs/api.md from the public modules' ``__all__`` and docstrings.

    python tools/api_doc.py            # rewrite docs/api.md
    python tools/api_doc.py --check    # exit 1 (and say so) when docs/api.md is out of date

The public modules are every ``.py`` under ``jaxdist/`` outside ``jaxdist/_src`` (no
``__main__``, no underscored name), plus each module a public ``__all__`` names
(``jaxdist.ps.optimizers``). Each module gets a ``## `module` `` section: the first paragraph
of its docstring (without a leading ``"`module`: "``), then one line per name of its
``__all__``, in order: ``- `name`: `` and the first paragraph of the name's docstring (RST's
double backquotes become Markdown's single ones). A name without a docstring of its own (a
constant, a namespace) is described by the ``#:`` comment lines just above its assignment, in
the public module or in the module that defines it. ``tests/test_public_api.py`` fails when
docs/api.md differs from what this writes.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import os
import pathlib
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parent.parent
API_MD = ROOT / "docs" / "api.md"
COMMAND = "python tools/api_doc.py"

INTRO = """\
# API reference

Every public module of jaxdist and every name in it, one line each. This list is the public
surface: it equals the modules' `__all__` (`tests/test_public_api.py` keeps the two equal, both
ways). Everything under `jaxdist._src` is the private implementation and may change without
notice; the [README](../README.md) and the guides in this directory show how the names are used.
Each module is imported as written (`import jaxdist.keras`), except `jaxdist.ps.optimizers`,
which is an attribute of `jaxdist.ps` (`from jaxdist.ps import optimizers`).
"""


def public_module_names(root: pathlib.Path = ROOT / "jaxdist") -> list[str]:
    """The importable public modules: every ``.py`` under ``jaxdist/`` outside ``_src`` (no
    ``__main__``, no underscored module)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if "_src" in parts or parts[-1] == "__main__" or any(
                p.startswith("_") and p != "__init__" for p in parts):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append(".".join(parts))
    return out


def load(module: str) -> types.ModuleType:
    """A public module by name; ``jaxdist.ps.optimizers`` is an attribute of ``jaxdist.ps``."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError:
        parent, _, name = module.rpartition(".")
        value = getattr(importlib.import_module(parent), name)
        if not isinstance(value, types.ModuleType):
            raise
        return value


def all_modules() -> dict[str, types.ModuleType]:
    """``{public name: module}``: the public module files and the private modules a public
    ``__all__`` exposes (``jaxdist.ps.optimizers``), sorted by name."""
    out = {name: load(name) for name in public_module_names()}
    for name, mod in list(out.items()):
        for attr in getattr(mod, "__all__", ()):
            value = getattr(mod, attr)
            if isinstance(value, types.ModuleType) and value.__name__.startswith("jaxdist._src"):
                out[f"{name}.{attr}"] = value
    return dict(sorted(out.items()))


def first_paragraph(doc: str | None) -> str:
    """The first paragraph of ``doc`` on one line, with Markdown's single backquotes."""
    para = inspect.cleandoc(doc or "").split("\n\n")[0]
    return " ".join(line.strip() for line in para.splitlines()).replace("``", "`").strip()


def comment_above(module: types.ModuleType, name: str) -> str:
    """The ``#:`` comment lines just above ``name = ...`` at the top level of ``module``'s
    source, joined into one line ("" when there are none)."""
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return ""
    lines = source.splitlines()
    for node in ast.parse(source).body:
        targets = []
        if isinstance(node, ast.Assign):
            targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            targets = [node.target.id]
        if name not in targets:
            continue
        text = []
        i = node.lineno - 2
        while i >= 0 and lines[i].lstrip().startswith("#:"):
            text.insert(0, lines[i].lstrip()[2:].strip())
            i -= 1
        return " ".join(text).replace("``", "`")
    return ""


def describe(module: types.ModuleType, public: str, name: str,
             modules: dict[str, types.ModuleType]) -> str:
    """The one-line description of ``public.name``."""
    value = getattr(module, name)
    if isinstance(value, types.ModuleType):
        target = next((k for k, m in modules.items() if m is value), f"{public}.{name}")
        return f"the module `{target}` (below)"
    if inspect.isclass(value) or inspect.isroutine(value):
        if value.__doc__:
            return first_paragraph(value.__doc__)
    sources = [module]
    defining = sys.modules.get(getattr(value, "__module__", None) or "")
    for mod in [*sources, defining, *(m for m in sys.modules.values()
                                      if m is not None and m.__name__.startswith("jaxdist."))]:
        if mod is None:
            continue
        text = comment_above(mod, name)
        if text and (mod is module or getattr(mod, name, object()) is value):
            return text
    return ""


def render() -> str:
    """docs/api.md as it should read."""
    modules = all_modules()
    out = [INTRO]
    missing = []
    for public, module in modules.items():
        intro = first_paragraph(module.__doc__)
        prefix = f"`{public}`: "
        if intro.startswith(prefix):
            intro = intro[len(prefix):]
            intro = intro[:1].upper() + intro[1:]  # "`jaxdist.ps`: the ..." -> "The ..."
        out.append(f"## `{public}`\n\n{intro}\n")
        lines = []
        for name in getattr(module, "__all__", ()):
            text = describe(module, public, name, modules)
            if not text:
                missing.append(f"{public}.{name}")
            lines.append(f"- `{name}`: {text}")
        if lines:
            out.append("\n".join(lines) + "\n")
    if missing:
        raise SystemExit("no docstring (or '#:' comment above the assignment) describes: "
                         + ", ".join(missing))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Writes docs/api.md, or with ``--check`` says whether it is up to date."""
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when docs/api.md differs")
    args = parser.parse_args(argv)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    sys.path.insert(0, str(ROOT))
    text = render()
    current = API_MD.read_text(encoding="utf-8") if API_MD.exists() else ""
    if args.check:
        if current != text:
            print(f"docs/api.md is out of date: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    if current != text:
        API_MD.write_text(text, encoding="utf-8")
        print(f"wrote {API_MD.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
