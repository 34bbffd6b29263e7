"""function_key: when two function objects may share one compiled step (strategies/fn_key.py).

A wrong "equal" is a silent wrong result, so each rule is tested both ways."""

import functools

import jax.numpy as jnp
import numpy as np

from jaxdist._src.strategies.fn_key import FunctionKey, function_key


def _make(value):
    def step(x):
        return x * value
    return step


def test_same_code_and_same_or_equal_captures_are_one_key():
    obj = object()
    assert function_key(_make(obj)) == function_key(_make(obj))
    assert hash(function_key(_make(obj))) == hash(function_key(_make(obj)))
    for v in (None, True, 3, 2.5, 1 + 2j, "s", b"b", np.float32(1.5), np.int32(7), (1, (2.0, "a"))):
        assert function_key(_make(v)) == function_key(_make(v)), v
    assert function_key(_make(float("2.5"))) == function_key(_make(2.5))


def test_other_captures_are_other_keys():
    pairs = [(1, 2), (1, 1.0), (True, 1), (0.0, -0.0), (np.float32(1), np.float64(1)),
             (np.float32(1), 1.0), ((1, 2), (1, 3)), ("a", "b"), ([1], [1]),
             (jnp.zeros(2), jnp.zeros(2)), (np.zeros(2), np.zeros(2)), (object(), object())]
    for a, b in pairs:
        assert function_key(_make(a)) != function_key(_make(b)), (a, b)
    nan = float("nan")
    assert function_key(_make(nan)) == function_key(_make(nan))  # the same bits


def test_defaults_kwdefaults_and_nested_functions():
    def with_default(v):
        def step(x, scale=v, *, shift=v):
            return x * scale + shift
        return step

    assert function_key(with_default(2.0)) == function_key(with_default(2.0))
    assert function_key(with_default(2.0)) != function_key(with_default(3.0))

    def outer(v):
        def loss(x):
            return x * v

        def step(x):
            return loss(x)
        return step

    assert function_key(outer(2.0)) == function_key(outer(2.0))  # a nested def, keyed in turn
    assert function_key(outer(2.0)) != function_key(outer(3.0))


def test_other_code_globals_or_objects_are_keyed_by_identity():
    assert function_key(lambda x: x + 1) != function_key(lambda x: x + 2)
    ns: dict = {}
    exec("def f(x):\n    return x", ns)  # noqa: S102 - the same code over other globals
    ns2: dict = {}
    exec("def f(x):\n    return x", ns2)  # noqa: S102
    assert function_key(ns["f"]) != function_key(ns2["f"])
    p = functools.partial(_make(1), 2)
    assert function_key(p) is p  # not a plain function: itself
    f = _make(1)
    f.tag = "x"  # a function with attributes (a wrapper): itself
    assert function_key(f) is f
    assert not isinstance(function_key(p), FunctionKey)


def test_an_unassigned_cell_and_self_reference():
    def outer():
        def step(x):
            return later(x)
        key = function_key(step)  # 'later' is not assigned yet
        later = abs  # noqa: F841
        return key, function_key(step)

    k1, k2 = outer()
    assert k1 != k2

    def recursive(v):
        def f(n):
            return v if n == 0 else f(n - 1)
        return f

    assert function_key(recursive(1)) != function_key(recursive(1))  # f captures itself
