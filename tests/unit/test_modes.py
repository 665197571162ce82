"""The table of modes: which modes a config turns on, and the order of their preparation."""

import keras
import pytest

import tfdist
from helpers import devices
from tfdist.config import ParallelConfig
from tfdist.engine import modes
from tfdist.engine.compute import LocalCompute
from tfdist.engine.reduce import AllReduce
from tfdist.engine.update import KerasApply


@pytest.mark.parametrize("field, value", [("microbatches", 2), ("xla", True), ("pipeline", 2),
                                          ("zero", 1), ("tensor", 2)])
def test_each_step_level_field_turns_on_its_own_mode(field, value):
    off = {mode.name for mode in modes.active(ParallelConfig())}
    on = {mode.name for mode in modes.active(ParallelConfig(**{field: value}))}
    assert off == {"data", "precision"}
    assert field in on - off
    # Every mode is a config field's, but the one an optimizer turns on.
    assert [mode.name for mode in modes.MODES
            if mode.name not in ParallelConfig.__dataclass_fields__] == ["one_bit_adam"]


def test_one_bit_adam_is_the_mode_its_optimizer_turns_on():
    optimizer = tfdist.optim.OneBitAdam()
    assert [mode.name for mode in modes.active(ParallelConfig(), optimizer)] == [
        "data", "precision", "one_bit_adam"]
    scaled = keras.optimizers.LossScaleOptimizer(optimizer)  # on, to be refused by its check
    assert "one_bit_adam" in {mode.name for mode in modes.active(ParallelConfig(), scaled)}
    assert "one_bit_adam" not in {mode.name for mode in modes.active(
        ParallelConfig(), keras.optimizers.Adam())}


def test_preparation_runs_every_place_then_every_split_then_every_shard(monkeypatch):
    calls = []

    class Recording(modes.Mode):
        def __init__(self, name):
            self.name = name

        def on(self, config, optimizer=None):
            return True

        def place(self, plan):
            calls.append(("place", self.name))

        def split(self, plan):
            calls.append(("split", self.name))

        def shard(self, plan):
            calls.append(("shard", self.name))

    monkeypatch.setattr(modes, "MODES", (Recording("a"), Recording("b")))
    strategy = tfdist.Strategy(devices=devices(1))
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
    compute, reduce, update = modes.assemble(model, strategy.config)
    assert calls == [("place", "a"), ("place", "b"), ("split", "a"), ("split", "b"),
                     ("shard", "a"), ("shard", "b")]
    # What no mode contributed is the default part.
    assert (type(compute), type(reduce), type(update)) == (LocalCompute, AllReduce, KerasApply)
