"""Every private JAX API jaxdist uses sits in jaxdist/_src/compat/jax_internals.py and still works.

A JAX that moves one of them fails here, naming the adapter, instead of somewhere deep in a
strategy. No other module of jaxdist may import ``jax._src``.
"""

import ast
import pathlib

import jax
import jax.numpy as jnp
import pytest

from jaxdist._src.compat import jax_internals

ROOT = pathlib.Path(__file__).resolve().parents[2] / "jaxdist"


def test_no_other_module_imports_jax_private_modules():
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path.parent.name == "compat":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names
                          if n.startswith("jax._src")]
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
        assert getattr(fn, "_jaxdist_carry_promotion", False), fn


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
