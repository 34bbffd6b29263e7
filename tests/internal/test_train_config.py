"""Job configs: every shipped config validates; bad configs give one clear ConfigError."""

import pathlib

import jax
import pytest

from jaxdist._src.job import strategy_registry
from jaxdist._src.job.config import ConfigError, Field, check_replicas, load_config, schema_help

CONFIGS = sorted((pathlib.Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
TRAIN_CONFIGS = [p for p in CONFIGS
                 if p.stem in ("default", "one_device", "mirrored", "central_storage", "tpu")]


def test_the_five_configs_exist():
    assert {p.stem for p in TRAIN_CONFIGS} == {
        "default", "one_device", "mirrored", "central_storage", "tpu"}


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: p.stem)
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert cfg["strategy"]["name"] in strategy_registry.registered_strategies()
    assert cfg["train"]["global_batch_size"] % 8 == 0  # fits 1, 2, 4 and 8 devices


def test_defaults_and_overrides():
    cfg = load_config(raw={}, overrides=["train.epochs=3", "optimizer.learning_rate=1e-2",
                                         "model.hidden_sizes=[8, 8]", "checkpoint.dir=null",
                                         "strategy.name=one_device", "strategy.device=/cpu:0"])
    assert cfg["train"]["epochs"] == 3
    assert cfg["optimizer"]["learning_rate"] == pytest.approx(0.01)  # "1e-2" read as a number
    assert cfg["model"]["hidden_sizes"] == [8, 8]
    assert cfg["checkpoint"]["dir"] is None
    assert cfg["strategy"] == {"name": "one_device", "device": "/cpu:0"}
    assert cfg["data"]["name"] == "digits"


@pytest.mark.parametrize("raw, overrides, message", [
    ({"train": {"epoch": 3}}, [], "train.epoch: unknown key; valid keys: .*epochs"),
    ({"trian": {}}, [], "trian: unknown key; valid keys: callbacks, checkpoint, data"),
    ({}, ["train.epochs=three"], r"train.epochs: 'three' \(str\) is not an int"),
    ({}, ["train.epochs=0"], r"train.epochs: 0 is too small; expected >= 1"),
    ({}, ["train.halt_on_nan=maybe"], "train.halt_on_nan: 'maybe' .* expected true or false"),
    ({}, ["strategy.name=mirored"],
     "strategy.name: 'mirored' is not a known strategy; expected one of: central_storage, "
     "mirrored, .*one_device, parameter_server, parameter_server_coordinator, tpu"),
    ({}, ["strategy.name=one_device", "strategy.devices=[/cpu:0]"],
     "strategy.devices: unknown key for strategy 'one_device'; valid keys: device, name"),
    ({}, ["model.name=resnet"], "model.name: 'resnet' is not valid; expected one of: mlp, cnn"),
    ({}, ["optimizer.learning_rate=fast"], "optimizer.learning_rate: 'fast' .* not a number"),
    ({}, ["data.name=npz"], "data.path: null is not allowed when data.name is 'npz'"),
    ({}, ["optimizer.schedule=cosine"],
     "optimizer.decay_steps: null is not allowed when optimizer.schedule is 'cosine'"),
    ({}, ["optimizer.schedule=warmup_cosine", "optimizer.decay_steps=10",
          "optimizer.warmup_steps=10"], "optimizer.warmup_steps: 10 is not valid; expected "
     "fewer than decay_steps"),
    ({}, ["optimizer.schedule=onecycle"], "optimizer.schedule: 'onecycle' is not valid"),
    ({}, ["train.epochs"], "expected section.key=value"),
    ({}, ["train.epochs.x=1"], r"train.epochs: {'x': 1} \(dict\) is not an int"),
    ({"train": {"epochs": 2}}, ["train.epochs.x=1"], "train.epochs is a value, not a section"),
    ({"train": [1, 2]}, [], r"train: \[1, 2\] \(list\) is not a mapping"),
])
def test_bad_configs(raw, overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(raw=raw, overrides=overrides)
    assert "\n" not in str(info.value)


def test_batch_must_divide_across_replicas():
    cfg = load_config(raw={"train": {"global_batch_size": 30}})
    with pytest.raises(ConfigError, match="train.global_batch_size: 30 does not divide across "
                                          "the 4 replicas.*multiple of 4 .e.g. 28 or 32"):
        check_replicas(cfg, 4)
    check_replicas(cfg, 3)


def test_register_strategy_plugs_in_a_new_name():
    import jaxdist

    built = []
    strategy_registry.register_strategy(
        jaxdist.MirroredStrategy, "test_plugin",
        lambda section: built.append(dict(section)) or "strategy",
        {"workers": Field(int, 2, "how many", minimum=1)}, help="a test strategy")
    try:
        cfg = load_config(raw={"strategy": {"name": "test_plugin", "workers": 3}})
        assert strategy_registry.config_for("test_plugin").build(cfg["strategy"]) == "strategy"
        assert built == [{"name": "test_plugin", "workers": 3}]
        assert "test_plugin" in schema_help()
        assert strategy_registry.config_for("test_plugin").strategy_class is \
            jaxdist.MirroredStrategy
        with pytest.raises(ConfigError, match="strategy.workers: 0 is too small"):
            load_config(raw={"strategy": {"name": "test_plugin", "workers": 0}})
        with pytest.raises(ValueError, match="'test_plugin' is already registered for "
                                             "MirroredStrategy"):
            strategy_registry.register_strategy(jaxdist.OneDeviceStrategy, "test_plugin",
                                                lambda section: None)
    finally:
        strategy_registry.unregister_strategy("test_plugin")
    assert "test_plugin" not in strategy_registry.registered_strategies()


def test_registry_is_keyed_by_class_and_every_default_is_in_the_schema():
    """One hook per strategy class (SyncHook for the synchronous ones); the library's
    defaults of the Trainer's options (its config dataclasses, ``fit``) are the schema's, and
    a job's Trainer arguments come from the schema."""
    import dataclasses
    import inspect

    import jaxdist
    from jaxdist._src.job import schema
    from jaxdist._src.train import hooks, options
    from jaxdist._src.train.hook_registry import hook_for
    from jaxdist._src.train.parameter_server.between_graph import ParameterServerHook
    from jaxdist._src.train.trainer import Trainer

    one_device = jaxdist.OneDeviceStrategy(jax.devices()[0])
    assert type(hook_for(one_device)) is hooks.SyncHook
    assert isinstance(hook_for(jaxdist.ParameterServerStrategy()), ParameterServerHook)
    assert {s.name for s in strategy_registry._REGISTRY[jaxdist.ParameterServerStrategy]
            .configs.values()} == {"parameter_server", "parameter_server_coordinator"}
    groups = {"config": options.TrainConfig(), "checkpoint": options.CheckpointConfig(),
              "logging": options.LoggingConfig()}
    init, fit = (inspect.signature(m).parameters for m in (Trainer.__init__, Trainer.fit))
    for name, default in schema.trainer_defaults().items():
        owner, _, field = name.rpartition(".")
        if owner in groups:
            library = getattr(groups[owner], field)
        else:
            library = (fit if owner == "fit" else init)[field].default
        assert library == default, name
    cfg = load_config(raw={"checkpoint": {"keep": 7}, "seed": 3, "train": {"steps": 5}})
    kwargs = schema.trainer_options(cfg)
    assert kwargs["checkpoint"].keep == 7 and kwargs["config"].seed == 3
    assert kwargs["loss"] == "sparse_categorical_crossentropy"
    assert set(kwargs) <= set(init)
    assert dataclasses.asdict(kwargs["logging"])["dir"] == "runs/default"
    assert schema.fit_kwargs(cfg) == {"epochs": None, "steps": 5, "validation_freq": 1,
                                      "verbose": 1}


@pytest.mark.parametrize("schedule, extra, rates", [
    ("constant", [], [0.1, 0.1, 0.1]),
    ("cosine", ["optimizer.end_learning_rate=0.01"], [0.1, 0.055, 0.01]),
    ("warmup_cosine", ["optimizer.warmup_steps=5"], [0.0, 0.1, 0.0]),
    ("exponential", ["optimizer.decay_rate=0.1"], [0.1, 0.01 * 10 ** 0.5, 0.01]),
    ("linear", ["optimizer.end_learning_rate=0.02"], [0.1, 0.06, 0.02]),
])
def test_schedules_give_the_same_rates_locally_and_on_the_ps(schedule, extra, rates):
    """The sync optax optimizer and the ps spec evaluate the same schedule."""
    import jax.numpy as jnp
    import optax

    from jaxdist._src.job.job import optimizer_from_config
    from jaxdist._src.job.parameter_server import ps_optimizer_from_config

    cfg = load_config(raw={}, overrides=["optimizer.name=sgd", "optimizer.learning_rate=0.1",
                                         f"optimizer.schedule={schedule}",
                                         "optimizer.decay_steps=10", *extra])
    spec = ps_optimizer_from_config(cfg["optimizer"])
    for tx in (optimizer_from_config(cfg["optimizer"]), spec.build()):
        w = jnp.zeros(1)
        state = tx.init(w)
        got = {}
        for step in range(11):
            upd, state = tx.update(jnp.ones(1), state, w)
            got[step] = -float(upd[0])  # sgd: update = -lr(step) * grad
        for step, rate in zip((0, 5, 10), rates, strict=True):
            assert got[step] == pytest.approx(rate, rel=1e-5, abs=1e-7), (schedule, step)
    assert isinstance(optimizer_from_config(cfg["optimizer"]), optax.GradientTransformation)
