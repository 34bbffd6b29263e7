"""Every test that takes the first N devices states that it needs them (tests/conftest.py).

A test that slices ``jax.devices()[:N]`` (or ``jax.local_devices()[:N]``, or the ``devices``
fixture's list) with N >= 2 and no ``@pytest.mark.devices(M)`` (M >= N, on the test, on its
class or in a ``pytestmark``) would quietly run fewer replicas on a machine with fewer
devices (CI's ``JAX_NUM_CPU_DEVICES=1`` pass) and pass without testing what it says. A helper
shared by several tests takes ``devutil.first_devices(n)`` instead, which skips the test
calling it. This test reads the test files' source, so a new one cannot slip in.
"""

from __future__ import annotations

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent


def _sliced_devices(node: ast.AST) -> int | None:
    """N for ``jax.devices()[a:N]``, ``jax.local_devices()[a:N]`` or ``devices[a:N]`` (N a
    constant >= 2), else None."""
    if not isinstance(node, ast.Subscript) or not isinstance(node.slice, ast.Slice):
        return None
    v = node.value
    listed = (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute)
              and isinstance(v.func.value, ast.Name) and v.func.value.id == "jax"
              and v.func.attr in ("devices", "local_devices"))
    listed = listed or (isinstance(v, ast.Name) and v.id == "devices")
    upper = node.slice.upper
    if listed and isinstance(upper, ast.Constant) and isinstance(upper.value, int):
        return upper.value if upper.value >= 2 else None
    return None


def _stated(nodes) -> int:
    """The largest n of the ``devices(n)`` marks among ``nodes`` (decorators, pytestmark)."""
    n = 0
    for node in nodes:
        for sub in ast.walk(node):
            if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
                    and sub.func.attr == "devices" and sub.args
                    and isinstance(sub.args[0], ast.Constant)):
                n = max(n, sub.args[0].value)
    return n


def unstated_device_slices(source: str, filename: str = "<test>") -> list[str]:
    """``file:line: what`` for each slice of N >= 2 devices no mark covers."""
    tree = ast.parse(source)

    def pytestmarks(body):
        return [st.value for st in body if isinstance(st, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in st.targets)]

    module_marks = pytestmarks(tree.body)
    found = []

    def visit(node, scopes):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, scopes + [child])
                continue
            n = _sliced_devices(child)
            if n:
                marks = module_marks + [d for s in scopes for d in s.decorator_list]
                marks += [m for s in scopes if isinstance(s, ast.ClassDef)
                          for m in pytestmarks(s.body)]
                stated = _stated(marks)
                funcs = [s for s in scopes if not isinstance(s, ast.ClassDef)]
                test = next((f for f in funcs if f.name.startswith("test")), None)
                if stated >= n:
                    pass
                elif test is None:
                    where = f"{funcs[-1].name}()" if funcs else "module level"
                    found.append(f"{filename}:{child.lineno}: {where} takes {n} devices; a "
                                 f"helper takes devutil.first_devices({n}) (skips its caller)")
                else:
                    found.append(f"{filename}:{child.lineno}: {test.name} takes {n} devices "
                                 f"without @pytest.mark.devices({n})")
            visit(child, scopes)

    visit(tree, [])
    return found


def test_every_test_that_takes_several_devices_states_them():
    found = []
    for path in sorted(TESTS.rglob("test_*.py")):
        found += unstated_device_slices(path.read_text(), str(path.relative_to(TESTS.parent)))
    assert not found, "tests that take several devices without stating them:\n" + "\n".join(found)


def test_the_check_sees_a_slice_without_a_mark():
    """The check fails for each way of taking devices without the mark, and passes with it."""
    src = '''
import jax, pytest

pair = jax.devices()[:2]

def helper():
    return jax.local_devices()[:4]

def test_a():
    return jax.devices()[:2]

def test_b(devices):
    return devices[1:3]

@pytest.mark.devices(2)
def test_c():
    return jax.devices()[:4]

@pytest.mark.devices(4)
def test_d():
    return jax.devices()[:4], jax.devices()[:1]

class TestE:
    pytestmark = pytest.mark.devices(8)

    def test_f(self):
        return jax.devices()[:8]

@pytest.mark.devices(2)
class TestG:
    def test_h(self):
        return jax.devices()[:8]
'''
    found = unstated_device_slices(src)
    assert [f.split(": ", 1)[1] for f in found] == [
        "module level takes 2 devices; a helper takes devutil.first_devices(2) (skips its caller)",
        "helper() takes 4 devices; a helper takes devutil.first_devices(4) (skips its caller)",
        "test_a takes 2 devices without @pytest.mark.devices(2)",
        "test_b takes 3 devices without @pytest.mark.devices(3)",
        "test_c takes 4 devices without @pytest.mark.devices(4)",
        "test_h takes 8 devices without @pytest.mark.devices(8)",
    ]
