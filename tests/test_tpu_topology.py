"""TPU topologies without a TPU: Topology / DeviceAssignment, compile-only TPUStrategy, the
compile reports of strategy.run steps, the Trainer's step, a Keras fit step and the CLI.

The tests that compile for a named topology need libtpu (``pip install 'jaxdist[tpu]'``) and
are skipped with that reason without it; the others run on the forced CPU devices.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdist
from jaxdist.tpu import CompileOnlyError, DeviceAssignment, Topology
from jaxdist.train.models import CNN

needs_libtpu = pytest.mark.skipif(
    not jaxdist.tpu.libtpu_available(),
    reason="needs libtpu to compile for a TPU topology: pip install 'jaxdist[tpu]'")

TOPOLOGIES = ["v4:2x2x1", "v5e:2x2", "v5p:2x2x1"]
KINDS = {"v4:2x2x1": "TPU v4", "v5e:2x2": "TPU v5 lite", "v5p:2x2x1": "TPU v5"}
D, H = 256, 512  # multiples of the TPU's (8, 128) tiles: no layout padding in the byte counts


def _forward(w, x):
    """Per replica: a matmul of its rows, summed over replicas."""
    return jaxdist.get_replica_context().all_reduce("SUM", jnp.sum(x @ w))


def _batch(strategy, rows_per_replica):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: jax.ShapeDtypeStruct((rows_per_replica, D), jnp.float32))


# ------------------------------------------------------------ without libtpu (CPU devices)
@pytest.mark.devices(4)
def test_topology_of_devices_and_device_assignment(devices):
    topo = Topology(devices=devices[:4])
    assert not topo.compile_only and topo.name is None
    assert topo.mesh_shape.tolist() == [4, 1, 1, 1] and topo.mesh_rank == 4
    assert topo.num_tasks == 1 and topo.num_tpus_per_task == 4
    assert topo.device_coordinates.shape == (1, 4, 4)
    assert topo.missing_devices.shape == (0, 4)
    assert topo.device_at_coordinates([2, 0, 0, 0]) is devices[2]
    assert topo.tpu_device_name_at_coordinates([3, 0, 0, 0], job="worker") == \
        "/job:worker/task:0/device:TPU:3"
    da = DeviceAssignment.build(topo, num_replicas=2)
    assert da.num_replicas == 2 and da.num_cores_per_replica == 1
    assert da.devices == tuple(devices[:2])
    assert da.coordinates(1, 0) == (1, 0, 0, 0) and da.tpu_ordinal(1) == 1
    assert da.lookup_replicas(0, 0) == [0, 1]
    assert da.core_assignment.shape == (2, 1, 4)


@pytest.mark.devices(4)
def test_device_assignment_errors(devices):
    topo = Topology(devices=devices[:4])
    with pytest.raises(ValueError, match="num_replicas=5"):
        DeviceAssignment.build(topo, num_replicas=5)
    with pytest.raises(NotImplementedError, match="one core per replica"):
        DeviceAssignment.build(topo, computation_shape=[1, 1, 1, 2])
    with pytest.raises(ValueError, match="no device at coordinates"):
        DeviceAssignment(topo, [[[7, 0, 0, 0]]])
    with pytest.raises(ValueError, match="uses a device twice"):
        DeviceAssignment(topo, [[[1, 0, 0, 0]], [[1, 0, 0, 0]]])


@pytest.mark.devices(4)
def test_strategy_runs_on_a_device_assignment_of_attached_devices(devices):
    da = DeviceAssignment.build(Topology(devices=devices[:4]), num_replicas=2)
    s = jaxdist.TPUStrategy(experimental_device_assignment=da)
    assert not s.compile_only and s.num_replicas_in_sync == 2
    assert set(s.extended.worker_devices) == set(devices[:2])
    v = s.experimental_distribute_values_from_function(
        lambda c: np.float32(c.replica_id_in_sync_group + 1))
    total = s.run(lambda v: jaxdist.get_replica_context().all_reduce("SUM", v), args=(v,))
    assert float(total) == 3.0
    with pytest.raises(TypeError, match="DeviceAssignment"):
        jaxdist.TPUStrategy(experimental_device_assignment="v5e:2x2")
    with pytest.raises(ValueError, match="not both"):
        jaxdist.TPUStrategy(experimental_device_assignment=da, devices=devices[:2])


@pytest.mark.devices(4)
def test_experimental_compile_on_attached_devices_counts_the_step(devices):
    s = jaxdist.TPUStrategy(devices=devices[:4])
    w = jax.ShapeDtypeStruct((D, H), jnp.float32)
    small = s.experimental_compile(_forward, args=(w, _batch(s, 16)))
    big = s.experimental_compile(_forward, args=(w, _batch(s, 64)))
    assert not small.compile_only and small.unit == "device" and small.num_replicas == 4
    # one device's matmul: 2 * rows * D * H flops (plus the sum), rows per replica only
    assert 2 * 16 * D * H <= small.flops < 1.1 * 2 * 16 * D * H
    assert big.flops == pytest.approx(4 * small.flops, rel=0.05)
    assert small.argument_bytes == D * H * 4 + 16 * D * 4
    assert big.argument_bytes - small.argument_bytes == 48 * D * 4


def test_topology_name_errors_and_missing_libtpu(monkeypatch):
    with pytest.raises(ValueError, match="not a topology name"):
        Topology("v5e-4")
    with pytest.raises(ValueError, match="name"):
        Topology()
    monkeypatch.setattr("jaxdist._src.strategies.tpu.libtpu_available", lambda: False)
    with pytest.raises(ImportError, match=r"pip install 'jaxdist\[tpu\]'"):
        jaxdist.TPUStrategy(topology="v5e:2x2")


def test_importing_jaxdist_does_not_load_libtpu():
    code = ("import sys, jax, jaxdist; print(jax.default_backend(), "
            "'libtpu' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cpu", "False"]


# ------------------------------------------------------------ named topologies (libtpu)
@needs_libtpu
@pytest.mark.parametrize("name", TOPOLOGIES)
def test_topology_from_name(name):
    before = dict(os.environ)
    topo = jaxdist.tpu.experimental.Topology(name)
    assert topo.compile_only and topo.name == name
    assert topo.device_kind == KINDS[name] and len(topo.devices) == 4  # megacore on v4, v5p
    assert topo.mesh_shape.tolist() == [2, 2, 1, 1] and topo.num_tasks == 1
    assert all(d.platform == "tpu" for d in topo.devices)
    assert jax.default_backend() == "cpu"  # the default backend is untouched
    # libtpu's environment is set while it loads only
    for key in ("TPU_WORKER_HOSTNAMES", "TPU_HOST_BOUNDS", "ALLOW_MULTIPLE_LIBTPU_LOAD"):
        assert os.environ.get(key) == before.get(key)


@needs_libtpu
def test_multi_host_topology_and_unknown_names():
    topo = Topology("v4:2x2x2", chips_per_host_bounds=(2, 2, 1))
    assert topo.num_tasks == 2 and topo.num_tpus_per_task == 4
    assert topo.device_coordinates.shape == (2, 4, 4)
    assert topo.task_ordinal_at_coordinates([0, 0, 1, 0]) == 1
    with pytest.raises(ValueError, match="libtpu does not know"):
        Topology("v9:2x2")
    with pytest.raises(ValueError, match="libtpu does not know"):
        Topology("v5e:3x3")


@needs_libtpu
@pytest.mark.parametrize("name", TOPOLOGIES)
def test_compile_only_strategy_compiles_run_steps(name):
    s = jaxdist.TPUStrategy(topology=name)
    assert s.compile_only and s.num_replicas_in_sync == 4 and s.topology.name == name
    with s.scope():
        w = jnp.zeros((D, H), jnp.float32)
    assert w.devices() == {jax.devices()[0]}  # state stays on the host
    report = s.experimental_compile(_forward, args=(w, _batch(s, 32)))
    assert report.compile_only and report.topology == name and report.unit == "chip"
    assert report.device_kind == KINDS[name] and report.num_devices == 4
    assert report.argument_bytes == D * H * 4 + 32 * D * 4
    assert 2 * 32 * D * H <= report.flops < 1.1 * 2 * 32 * D * H
    assert report.total_bytes > report.argument_bytes and report.fits
    assert report.hbm_bytes == {"TPU v4": 32, "TPU v5 lite": 16, "TPU v5": 95}[
        report.device_kind] * 2**30
    assert report.memory_analysis is not None and "flops" in report.cost_analysis
    text = str(report)
    assert f"compiled for {KINDS[name]} {name}" in text and "per chip: memory" in text


@needs_libtpu
def test_compile_only_strategy_refuses_to_run():
    s = jaxdist.TPUStrategy(topology="v5e:2x2")
    w = np.zeros((D, H), np.float32)
    batch = s.experimental_distribute_values_from_function(
        lambda ctx: np.zeros((8, D), np.float32))
    with pytest.raises(CompileOnlyError, match="compile-only .*'v5e:2x2'"):
        s.run(_forward, args=(w, batch))
    with pytest.raises(CompileOnlyError, match="strategy.reduce"):
        s.reduce("SUM", batch, axis=None)
    with pytest.raises(CompileOnlyError, match="experimental_distribute_dataset"):
        s.experimental_distribute_dataset([np.zeros((8, D), np.float32)])
    with pytest.raises(CompileOnlyError):
        s.gather(batch, axis=0)
    # host values compile as their shapes do
    report = s.experimental_compile(_forward, args=(w, batch))
    assert report.argument_bytes == D * H * 4 + 8 * D * 4


@needs_libtpu
def test_device_assignment_on_a_named_topology_and_donation():
    topo = Topology("v5e:2x2")
    s = jaxdist.TPUStrategy(
        experimental_device_assignment=DeviceAssignment.build(topo, num_replicas=2))
    assert s.compile_only and s.num_replicas_in_sync == 2
    w = jax.ShapeDtypeStruct((D, H), jnp.float32)

    def update(w, x):
        g = jaxdist.get_replica_context().all_reduce("SUM", x.sum(axis=0))
        return w + g[:, None]

    plain = s.experimental_compile(update, args=(w, _batch(s, 8)))
    donated = s.experimental_compile(update, args=(w, _batch(s, 8)),
                                     options=jaxdist.RunOptions(donate_argnums=(0,)))
    assert plain.alias_bytes == 0 and donated.alias_bytes == D * H * 4
    data = lambda r: r.total_bytes - r.generated_code_bytes  # noqa: E731
    assert data(donated) == data(plain) - D * H * 4


def _trainer(strategy, k=4):
    with strategy.scope():
        model = CNN((8, 8, 1), [16, 32], 10, rngs=nnx.Rngs(0))
        return jaxdist.Trainer(model, optax.adam(1e-3), global_batch_size=128,
                               steps_per_execution=k, strategy=strategy, progress_bar="never")


@needs_libtpu
@pytest.mark.parametrize("name", TOPOLOGIES)
def test_trainer_step_compiles_for_topology(name):
    x, y = np.zeros((4, 8, 8, 1), np.float32), np.zeros((4,), np.int32)
    trainer = _trainer(jaxdist.TPUStrategy(topology=name))
    report = trainer.experimental_compile(x, y)
    assert report.topology == name and report.flops > 0 and report.total_bytes > 0
    # the input block is in the arguments: 4 steps x 32 rows per replica of x, y and weights
    assert report.argument_bytes > 4 * 32 * (64 * 4 + 4 + 4)
    assert "Trainer step (4 step(s) of 128 rows)" in str(report)
    with pytest.raises(CompileOnlyError):
        trainer.fit((np.zeros((256, 8, 8, 1), np.float32), np.zeros((256,), np.int32)),
                    steps=2, verbose=0)


@pytest.mark.devices(4)
def test_trainer_experimental_compile_on_cpu_devices(devices):
    x, y = np.zeros((4, 8, 8, 1), np.float32), np.zeros((4,), np.int32)
    small = _trainer(jaxdist.TPUStrategy(devices=devices[:4]), k=1).experimental_compile(x, y)
    assert small.flops > 0 and small.unit == "device"


@needs_libtpu
@pytest.mark.parametrize("name", TOPOLOGIES)
def test_keras_fit_step_compiles_for_topology(name):
    os.environ.setdefault("KERAS_BACKEND", "jax")  # before keras is first imported
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip(f"keras runs on the {keras.backend.backend()} backend, not jax")
    import jaxdist.keras

    s = jaxdist.TPUStrategy(topology=name)
    x, y = np.zeros((16, 32), np.float32), np.zeros((16,), np.int32)
    with s.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(128),
                                  keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
    report = jaxdist.keras.compile_fit_step(model, x, y, batch_size=128)
    assert report.topology == name and report.num_replicas == 4
    # forward of 32 rows per chip through both layers is at least 2*32*(32*128 + 128*10) flops
    assert report.flops >= 2 * 32 * (32 * 128 + 128 * 10)
    assert report.alias_bytes > 0  # Keras donates its state, as in fit
    with pytest.raises(CompileOnlyError, match="make_train_function"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


@needs_libtpu
def test_cli_compile_only_prints_memory_and_flops(capsys):
    from jaxdist.train.__main__ import main

    assert main(["--config", "configs/tpu.yaml", "--compile-only", "--topology",
                 "v5e:2x2"]) == 0
    out = capsys.readouterr().out
    assert "compiled for TPU v5 lite v5e:2x2" in out
    assert "per chip: memory" in out and "FLOPs" in out
    assert main(["--config", "configs/tpu.yaml", "--topology", "v5e:2x2"]) == 2
    assert "add --compile-only" in capsys.readouterr().err
    assert main(["--config", "configs/tpu.yaml", "--compile-only", "--topology",
                 "v5e:3x3"]) == 2
    assert "libtpu does not know" in capsys.readouterr().err
