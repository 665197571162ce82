"""Variables created as shards in a tfdist scope with `zero` (seconds, no training).

Where each variable lives right after it is built, before any step, and that
its value is the one a one-device build makes with the same seed.
"""

import gc
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist._compat.tf_variables import storage_of
from tfdist.sharding import storage as storage_module
from tfdist.sharding.creation import whole_where_not_kept
from tfdist.sharding.layout import AxisLayout, MeshShardLayout
from tfdist.sharding.storage import ShardedStorage, own_copy
from tfdist.tensor.layouts import Column, Row

DEVICES = [f"/device:CPU:{i}" for i in range(4)]


def _model():
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((10,)), keras.layers.Dense(7, "relu"),
                             keras.layers.BatchNormalization(), keras.layers.Dense(3)])


def _built(strategy):
    with strategy.scope():
        model = _model()
        model.compile(optimizer="adam", loss="mse")
        model.optimizer.build(model.trainable_variables)
    return model


def _slots(model):
    optimizer = model.optimizer
    return list(zip(model.trainable_variables, optimizer._momentums, optimizer._velocities))


def test_zero3_creates_each_weight_as_shards_of_a_one_device_build():
    reference = _model()
    model = _built(tfdist.Strategy(zero=3, devices=DEVICES))
    for variable, expected in zip(model.weights, reference.weights):
        storage = storage_of(variable)
        if not expected.trainable:  # BatchNormalization's moving statistics
            assert not isinstance(storage, ShardedStorage), variable.path
            continue
        assert isinstance(storage, ShardedStorage), variable.path
        assert storage.layout == MeshShardLayout(expected.shape, 1, 4)
        shard = -(-int(np.prod(expected.shape)) // 4)
        assert [c.shape.as_list() for c in storage.values] == [[shard]] * 4
        assert [c.device for c in storage.values] == list(
            model.distribute_strategy.extended.worker_devices)
        np.testing.assert_array_equal(variable.numpy(), expected.numpy())
    # The optimizer's slots: shards of their weight's layout, made as shards.
    for variable, momentum, velocity in _slots(model):
        for slot in (momentum, velocity):
            assert storage_of(slot).layout is storage_of(variable).layout
            np.testing.assert_array_equal(slot.numpy(), np.zeros(variable.shape))
    assert not isinstance(storage_of(model.optimizer.iterations), ShardedStorage)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_1_and_2_create_the_slots_as_shards_and_the_weights_whole(zero):
    model = _built(tfdist.Strategy(zero=zero, devices=DEVICES))
    for variable, momentum, velocity in _slots(model):
        assert not isinstance(storage_of(variable), ShardedStorage)
        for slot in (momentum, velocity):
            assert storage_of(slot).layout == MeshShardLayout(variable.shape, 1, 4)


def test_plain_data_parallelism_creates_nothing_as_shards():
    model = _built(tfdist.Strategy(devices=DEVICES))
    assert not any(isinstance(storage_of(v), ShardedStorage)
                   for v in model.weights + model.optimizer.variables)


@pytest.mark.parametrize("config", [dict(tensor=2), dict(pipeline=2, zero=1)])
def test_tensor_and_pipeline_hold_weights_as_shards_until_the_step_places_them(config):
    reference = _model()
    model = _built(tfdist.Strategy(devices=DEVICES, **config))
    for variable, expected in zip(model.weights, reference.weights):
        assert isinstance(storage_of(variable), ShardedStorage) == expected.trainable
    # What no split or stage takes (here: everything, no step has run) is
    # made whole again, slots too, values kept.
    whole_where_not_kept(model)
    for variable, expected in zip(model.weights, reference.weights):
        assert not isinstance(storage_of(variable), ShardedStorage), variable.path
        np.testing.assert_array_equal(variable.numpy(), expected.numpy())
    assert not any(isinstance(storage_of(v), ShardedStorage) for v in model.optimizer.variables)


def test_finding_what_to_make_whole_gathers_no_split_weight():
    # A split weight's storage answers a name it lacks by reading its value,
    # every shard gathered whole: the first step's check must not ask it.
    strategy = tfdist.Strategy(devices=DEVICES, tensor=2, zero=3)
    with strategy.scope():
        layer = keras.layers.Dense(1024)
        layer.build((None, 1024))
    Column().apply(layer, strategy.tensor_mesh)  # the split the first step makes
    tf.config.experimental.reset_memory_stats("CPU:0")
    start = tf.config.experimental.get_memory_info("CPU:0")["current"]
    whole_where_not_kept(layer, strategy)
    assert tf.config.experimental.get_memory_info("CPU:0")["peak"] - start < 4 * 1024 * 1024
    assert isinstance(storage_of(layer.kernel), ShardedStorage)


@pytest.mark.parametrize("split, axis", [(Column, 1), (Row, 0)])
def test_the_split_builds_each_shard_from_blocks_of_rows_never_the_whole_weight(
        monkeypatch, split, axis):
    # Splitting a weight held as element shards (tensor=2 x zero=3's layout)
    # sums one block of rows at a time from the shards: the allocator's peak
    # above what was held stays below the new shards plus one whole weight
    # (gathering it whole held the gathered shards, the whole and the slices).
    monkeypatch.setattr(storage_module, "RESHARD_BLOCK_BYTES", 64 * 1024)
    strategy = tfdist.Strategy(devices=DEVICES, tensor=2, zero=3)
    with strategy.scope():
        layer = keras.layers.Dense(1024, use_bias=False)
        layer.build((None, 1024))
    value = layer.kernel.numpy()
    gc.collect()
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    split().apply(layer, strategy.tensor_mesh)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
    whole = value.nbytes
    assert peak < 1.5 * whole, (peak, whole)  # new shards: 1.0 x, one shard's pieces: 0.25 x
    assert storage_of(layer.kernel).layout == MeshShardLayout(
        value.shape, 2, 2, AxisLayout(value.shape, axis, 2))
    np.testing.assert_array_equal(layer.kernel.numpy(), value)


def test_a_layer_frozen_after_creation_is_made_whole_again():
    model = _built(tfdist.Strategy(zero=3, devices=DEVICES))
    first = model.layers[0]
    value = first.kernel.numpy()
    first.trainable = False
    whole_where_not_kept(model)
    assert not isinstance(storage_of(first.kernel), ShardedStorage)
    assert len(storage_of(first.kernel).values) == 4
    np.testing.assert_array_equal(first.kernel.numpy(), value)
    assert isinstance(storage_of(model.layers[2].kernel), ShardedStorage)


def _rss_mib():
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise KeyError("VmRSS")


def test_a_stored_shard_does_not_keep_the_whole_value_alive():
    # A row of a reshaped tensor shares the whole tensor's buffer: a variable
    # holding it would keep all 64 MiB of each value (512 MiB here).
    gc.collect()
    before, kept = _rss_mib(), []
    for _ in range(8):
        whole = tf.random.uniform((4096, 4096))
        kept.append(tf.Variable(own_copy(tf.reshape(whole, (4, -1))[1])))
        del whole
    gc.collect()
    assert _rss_mib() - before < 300  # 8 x 16 MiB kept, plus the allocator's slack


def test_pipeline_holds_each_new_weight_on_the_stage_device_holding_least():
    # Until the first step places the stages, a replica's stage devices share
    # the weights (under ChiefStrategy they are other hosts): each weight,
    # whole for the one replica, on the device with the fewest bytes so far.
    reference = _model()
    model = _built(tfdist.Strategy(pipeline=2, devices=DEVICES[:2]))
    held = {device: 0 for device in DEVICES[:2]}
    for variable, expected in zip(model.trainable_weights, reference.trainable_weights):
        (component,) = storage_of(variable).values
        device = next(d for d in held if component.device.endswith(d[1:]))
        assert held[device] == min(held.values()), variable.path
        held[device] += expected.numpy().nbytes
        np.testing.assert_array_equal(variable.numpy(), expected.numpy())
    assert all(held.values())  # both devices hold some
    for weight, momentum, velocity in _slots(model):  # Adam's slots beside their weight
        devices = [c.device for c in storage_of(weight).values]
        assert [c.device for c in storage_of(momentum).values] == devices
        assert [c.device for c in storage_of(velocity).values] == devices


def test_zeros_are_made_shard_by_shard_and_other_values_computed_whole(monkeypatch):
    # Adam's slots and Dense biases start at zeros: made as zero shards, no
    # whole value computed (under MultiWorkerStrategy: nothing broadcast);
    # kernels, ones and Adagrad's 0.1 accumulators are computed whole and cut.
    from tfdist.sharding import creation

    whole = []
    computed = creation.initial_value
    monkeypatch.setattr(creation, "initial_value", lambda extended, **kwargs: whole.append(
        kwargs["name"]) or computed(extended, **kwargs))
    reference = _model()
    strategy = tfdist.Strategy(zero=3, devices=DEVICES)
    model = _built(strategy)
    assert sorted(whole) == ["gamma", "kernel", "kernel"]  # BatchNormalization's gamma: ones
    for variable, expected in zip(model.trainable_weights, reference.trainable_weights):
        assert isinstance(storage_of(variable), ShardedStorage), variable.path
        np.testing.assert_array_equal(variable.numpy(), expected.numpy())
    for variable, momentum, velocity in _slots(model):
        for slot in (momentum, velocity):
            assert storage_of(slot).layout is storage_of(variable).layout
            np.testing.assert_array_equal(slot.numpy(), np.zeros(variable.shape))
    del whole[:]
    with strategy.scope():
        adagrad = keras.optimizers.Adagrad(initial_accumulator_value=0.1)
        adagrad.build(model.trainable_variables)
    assert len(whole) == len(model.trainable_variables)
    for variable, accumulator in zip(model.trainable_variables, adagrad._accumulators):
        assert storage_of(accumulator).layout is storage_of(variable).layout
        np.testing.assert_allclose(accumulator.numpy(), np.full(variable.shape, 0.1))
