"""Every private JAX, jaxlib and flax API jaxdist uses sits in jaxdist/_src/compat/ and still works.

A JAX (or flax) that moves one of them fails here, naming the adapter, instead of somewhere deep
in a strategy. No other module of jaxdist may import ``jax._src`` or ``jaxlib._jax``, call a jit's
``_cache_size`` or name flax's ``JitWrapped``.
"""

import ast
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxdist._src.compat import flax_internals, jax_internals, jaxlib_extension

ROOT = pathlib.Path(__file__).resolve().parents[2] / "jaxdist"


def _private_uses(tree: ast.AST) -> list[str]:
    """What in ``tree`` reaches a JAX, jaxlib or flax private: ``jax._src``, ``jaxlib._jax``, a
    jit's ``_cache_size`` or flax's ``JitWrapped``."""
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.Name):
            names = [node.id]
        found += [n for n in names if n.startswith(("jax._src", "jaxlib._jax"))
                  or n.rsplit(".", 1)[-1] in ("_cache_size", "JitWrapped")]
    return found


def test_private_use_checker_finds_each_kind():
    code = ("from jax._src import core\nfrom jaxlib import _jax\nimport jaxlib._jax\n"
            "n = f._cache_size()\nfrom flax.nnx.transforms.compilation import JitWrapped\n")
    found = _private_uses(ast.parse(code))
    for name in ("jax._src", "jaxlib._jax", "_cache_size", "JitWrapped"):
        assert any(name in f for f in found), (name, found)
    assert _private_uses(ast.parse("import jax\njax.jit(f).lower(1)\n")) == []


def test_no_other_module_uses_jax_or_flax_privates():
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path.parent.name == "compat":
            continue
        offenders += [f"{path.relative_to(ROOT)}: {n}"
                      for n in _private_uses(ast.parse(path.read_text()))]
    assert not offenders, offenders


def test_installed_jax_is_supported():
    assert jax_internals.check_version() is None, jax_internals.check_version()
    assert "found jax 0.9.0" in jax_internals.check_version("0.9.0")
    assert jax_internals.check_version("0.10.2") is None
    assert jax_internals.check_version("0.11.2") is None
    assert jax_internals.check_version("0.12.0") is not None  # not yet tested here


def test_tracing_adapters():
    assert jax_internals.trace_state_clean()
    seen = []

    @jax.jit
    def f(x):
        seen.append((jax_internals.trace_state_clean(), jax_internals.current_trace()))
        return x

    f(1.0)
    clean, trace = seen[0]
    assert not clean and trace is not None


def test_autodiff_and_reduction_adapters():
    fwd, rev = jax_internals.autodiff_tracer_types()
    assert fwd and rev
    kinds = []

    def f(x):
        kinds.append(type(x))
        return x * 2.0

    jax.grad(f)(1.0)
    jax.jvp(f, (1.0,), (1.0,))
    assert any(issubclass(k, rev) for k in kinds) and any(issubclass(k, fwd) for k in kinds)
    assert jax_internals.reduction_primitives()
    assert jax_internals.all_gather_invariant() is not None


def test_distributed_adapters():
    dist = jax_internals.distributed_module()
    assert hasattr(dist, "global_state") and callable(dist.is_initialized)
    assert callable(jax_internals.xla_bridge().backends_are_initialized)
    ext = jax_internals.jax_extension()
    for name in ("get_distributed_runtime_service", "get_distributed_runtime_client"):
        assert hasattr(ext, name), name
    assert hasattr(jaxlib_extension.jaxlib_extension(), "get_distributed_runtime_service")


def test_jaxlib_extension_imports_no_jax():
    """The service process loads the adapter by its path: it must not import JAX."""
    code = ("import runpy, sys; f = runpy.run_path(sys.argv[1])['jaxlib_extension']; "
            "assert f().get_distributed_runtime_service; "
            "assert 'jax' not in sys.modules, 'imported jax'")
    subprocess.run([sys.executable, "-c", code, jaxlib_extension.__file__], check=True)


def test_jit_cache_size_counts_compiled_signatures():
    f = jax.jit(lambda x: x + 1)
    assert jax_internals.jit_cache_size(f) == 0
    f(1.0)
    f(jnp.ones(2))
    assert jax_internals.jit_cache_size(f) == 2


def test_flax_adapters():
    nnx = pytest.importorskip("flax.nnx")
    assert flax_internals.is_nnx_jit(nnx.jit(lambda x: x))
    assert not flax_internals.is_nnx_jit(jax.jit(lambda x: x))
    assert not flax_internals.is_nnx_jit(abs)


def test_all_gather_invariant_in_a_replica_step():
    n = min(2, jax.local_device_count())
    if n < 2:
        pytest.skip(f"needs 2 local devices, {jax.local_device_count()} available")
    from jaxdist._src.strategies.cross_device_ops import all_gather_invariant

    mesh = jax.make_mesh((n,), ("r",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.local_devices()[:n])
    out = jax.shard_map(lambda x: all_gather_invariant(x, ("r",)), mesh=mesh,
                        in_specs=jax.sharding.PartitionSpec("r"),
                        out_specs=jax.sharding.PartitionSpec())(jnp.arange(4.0))
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.devices(2)
def test_carries_vary_over_types_a_constant_carry_varying_only_inside_it():
    """The loop-carry adapter: inside ``carries_vary_over`` a zeros carry that the body makes
    varying is cast to varying (scan, while_loop); outside it JAX's check refuses as before."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("r",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])

    def body(x):
        scanned = jax.lax.scan(lambda c, xt: (c + xt, ()), jnp.zeros(()), x)[0]
        looped = jax.lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, s[1] + x[s[0]]),
                                    (0, jnp.zeros(())))[1]
        return (scanned + looped)[None]

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("r"), out_specs=P("r")))
    with pytest.raises(TypeError, match="carry input and carry output must have equal types"):
        run(jnp.arange(4.0))
    with jax_internals.carries_vary_over(("r",)) as hooked:
        assert hooked
        out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("r"), out_specs=P("r")))(
            jnp.arange(4.0))
    assert out.tolist() == [2.0, 10.0]
    with pytest.raises(TypeError, match="carry input and carry output must have equal types"):
        jax.jit(jax.shard_map(lambda x: body(x) + 0, mesh=mesh, in_specs=P("r"),
                              out_specs=P("r")))(jnp.arange(4.0))
    # the hooks stay in place for good and are JAX's functions outside the context
    for fn in (jax.lax.scan, jax.lax.while_loop, jax.lax.cond, jax.lax.switch):
        assert fn in jax_internals._CARRY_WRAPPERS, fn


@pytest.mark.devices(2)
def test_carries_vary_over_reaches_a_fixpoint_and_joins_branches():
    """A delay line needs a third trace (JAX makes two); a cond output varying in one branch
    is cast in the other; outside the context both keep JAX's errors."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("r",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])

    def body(x):
        (a, b), _ = jax.lax.scan(lambda c, xt: ((c[0] + xt, c[0]), ()),
                                 (jnp.zeros(()), jnp.zeros(())), x)
        c = jax.lax.cond(a > 100, lambda: b, lambda: jnp.zeros(()))
        return jnp.stack([a, b, c])

    def run():
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("r"), out_specs=P("r")))(
            jnp.arange(4.0))

    with pytest.raises(TypeError, match="carry input and carry output must have equal types"):
        run()
    with jax_internals.carries_vary_over(("r",)):
        assert run().tolist() == [1.0, 0.0, 0.0, 5.0, 2.0, 0.0]
