"""Sharded optimizer state (zero=1, zero=2): parity, placement, what a step holds."""

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from helpers import (
    FEATURES,
    assert_parity,
    data,
    devices,
    make_model,
    traced_train_function,
    train,
)
from tfdist.callbacks.metrics import optimizer_state_bytes


def _schedule():
    return keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=5, decay_rate=0.7)


def _excluding_bias(optimizer):
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


# Each with a learning-rate schedule or weight decay (with exclusions).
OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(
        _schedule(), momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda: _excluding_bias(keras.optimizers.Adam(_schedule(), weight_decay=1e-3)),
    "adamw": lambda: _excluding_bias(keras.optimizers.AdamW(1e-2, weight_decay=0.05)),
    "lion": lambda: keras.optimizers.Lion(
        keras.optimizers.schedules.CosineDecay(1e-3, decay_steps=20), weight_decay=1e-2),
    # Not elementwise: factored second moments, whole-variable RMS.
    "adafactor": lambda: _excluding_bias(keras.optimizers.Adafactor(
        _schedule(), weight_decay=1e-3, clip_threshold=0.5)),
}


def make_uneven_model(optimizer):
    """A small model whose variables do not split evenly into 4 shards: shards
    start mid-row (kernels (10, 7), (7, 4)), cross the leading axis of a rank-3
    kernel ((3, 4, 5)), and end in padding (biases of 5 and 7)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Reshape((4, 4)),
        keras.layers.Conv1D(5, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(7, activation="tanh"),
        keras.layers.Dense(4),
    ])
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def train_with(name, n=4, microbatches=1, make=make_model, **config):
    strategy = tfdist.Strategy(data=n, microbatches=microbatches, devices=devices(n), **config)
    return train(strategy, make=lambda: make(optimizer=OPTIMIZERS[name]()))


# Every optimizer; microbatches with one elementwise and the factored one.
@pytest.mark.parametrize("name, microbatches", [
    *((name, 1) for name in sorted(OPTIMIZERS)), ("adam", 2), ("adafactor", 2)])
def test_zero1_and_zero2_match_zero0_on_the_same_mesh(name, microbatches):
    reference = train_with(name, microbatches=microbatches, make=make_uneven_model)
    for zero in (1, 2):
        result = train_with(name, microbatches=microbatches, zero=zero, make=make_uneven_model)
        # The same arithmetic except the order of the gradient sum (zero=2
        # sums the replicas' shards after an all-to-all, not in a ring).
        assert_parity(result, reference, rtol=1e-5, atol=1e-6)
        optimizer = result[2].optimizer
        assert int(optimizer.iterations.numpy()) == len(reference[0]) == 20
        # The state reads back whole and equal to the unsharded run's.
        for sharded, plain in zip(optimizer.variables, reference[2].optimizer.variables):
            assert sharded.shape == plain.shape
            np.testing.assert_allclose(sharded.numpy(), plain.numpy(), rtol=1e-5, atol=1e-6)


def make_big_first_layer(optimizer):
    """The test MLP with one variable holding most parameters (8,192 of 10,756)."""
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(4),
    ])
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("n", [2, 4, 8])
def test_worst_device_holds_a_1_over_n_share_of_the_optimizer_state(n):
    strategy = tfdist.Strategy(data=n, zero=1, devices=devices(n))
    with strategy.scope():
        model = make_big_first_layer(keras.optimizers.Adam(1e-3))
    big = model.trainable_variables[0]
    assert big.shape.num_elements() * 2 > sum(
        v.shape.num_elements() for v in model.trainable_variables)
    model.fit(*data(64), batch_size=64, verbose=0)
    per_device = optimizer_state_bytes(model.optimizer)
    assert sorted(per_device) == [f"CPU:{i}" for i in range(n)]
    # Unsharded: two float32 slots per variable; scalars: iterations, learning rate.
    slots = sum(2 * 4 * v.shape.num_elements() for v in model.trainable_variables)
    scalars = 8 + 4
    assert max(per_device.values()) <= 1.02 * slots / n + scalars
    # Element granularity: the big variable's slots are split over all n devices.
    momentum = model.optimizer._momentums[0]
    components = momentum.value.values
    assert len(components) == n and {c.device for c in components} == {
        tf.DeviceSpec.from_string(d).to_string() for d in strategy.extended.worker_devices}
    assert all(c.shape.num_elements() == big.shape.num_elements() // n for c in components)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_adafactor_shards_its_velocity_and_keeps_row_and_column_statistics_whole(n):
    strategy = tfdist.Strategy(data=n, zero=1, devices=devices(n))
    with strategy.scope():
        model = make_big_first_layer(keras.optimizers.Adafactor())
    model.fit(*data(64), batch_size=64, verbose=0)
    per_device = optimizer_state_bytes(model.optimizer)
    assert sorted(per_device) == [f"CPU:{i}" for i in range(n)]
    # The velocity (one float32 per parameter) is split 1/n; r and c (one
    # float32 per row and per column of kernels (16, 512) and (512, 4)) are
    # replicated, as are the int32 placeholders of the two biases' r and c,
    # the iteration counter and the learning rate.
    velocity = 4 * sum(v.shape.num_elements() for v in model.trainable_variables)
    rows_and_columns = 4 * (16 + 512 + 512 + 4)
    scalars = 4 * 4 + 8 + 4
    assert max(per_device.values()) <= 1.02 * velocity / n + rows_and_columns + scalars
    assert min(per_device.values()) >= velocity / n + rows_and_columns + scalars


def _step_graph(model):
    """The graph of the per-step function `fit` traced (all replicas' ops)."""
    (concrete,) = traced_train_function(model)._list_all_concrete_functions()
    (step,) = [f for name, f in concrete.graph._functions.items() if "one_step_on_data" in name]
    return step.graph


def _largest_from(ops):
    """Largest tensor computed from the outputs of `ops`, up to (not through)
    the parameter all-gather: what a replica derives from its reduced gradients."""
    largest, seen, todo = 0, set(), list(ops)
    while todo:
        op = todo.pop()
        for tensor in op.outputs:
            largest = max(largest, tensor.shape.num_elements())
            for consumer in tensor.consumers():
                if consumer.type != "CollectiveGatherV2" and consumer.name not in seen:
                    seen.add(consumer.name)
                    todo.append(consumer)
    return largest


def test_zero2_never_materialises_a_reduced_full_gradient():
    graphs = {}
    for zero in (1, 2):
        strategy = tfdist.Strategy(data=4, zero=zero, devices=devices(4))
        with strategy.scope():
            model = make_big_first_layer(keras.optimizers.Adam(1e-3))
        model.fit(*data(64), batch_size=32, verbose=0)
        graphs[zero] = _step_graph(model)
    big = 16 * 512
    shards = 2689  # ceil(n / 4) summed over the 4 variables (10,756 elements)

    def ops(zero, kind):
        return [op for op in graphs[zero].get_operations() if op.type == kind]

    collectives = {zero: collections.Counter(
        op.type for op in g.get_operations() if op.type.startswith("Collective"))
        for zero, g in graphs.items()}
    # zero=1: one packed all-reduce (the gradients and the metric states) and
    # one parameter gather per replica; each replica holds the whole reduced
    # gradient (the check below can fail). Besides, per replica, an all-reduce
    # of the batch's row count in every mode, and under zero=2 (no gradient
    # all-reduce to join) one of the metric states.
    scalars = 2 * 4
    assert collectives[1] == {"CollectiveReduceV2": 4 + 4, "CollectiveGatherV2": 4}
    assert _largest_from(ops(1, "CollectiveReduceV2")) >= 10756
    # zero=2: no gradient all-reduce; the gradients cross devices only in one
    # all-to-all per replica (the reduce-scatter). What a replica receives is
    # the 4 replicas' contributions to its own shards, (4, 2689), consumed only
    # by their sum; that reduced result and everything computed from it before
    # the parameter gather is at most 2,689 elements: no replica ever holds a
    # reduced gradient of the 8,192-element kernel.
    assert collectives[2] == {"CollectiveAllToAllV2": 4, "CollectiveGatherV2": 4,
                              "CollectiveReduceV2": scalars}
    # The batch's row counts are all-reduced before the forward pass (they set
    # each replica's loss share, so every local gradient follows from them);
    # after the gradients, only the metric state's scalars are all-reduced.
    after = [op for op in ops(2, "CollectiveReduceV2") if "/split/count/" not in op.name]
    assert len(after) == 4 and _largest_from(after) <= 4  # scalars and what follows
    reduced = []
    for received in ops(2, "CollectiveAllToAllV2"):
        assert received.outputs[0].shape == (4, shards)
        (total,) = received.outputs[0].consumers()
        assert total.type == "Sum" and total.outputs[0].shape == (shards,)
        reduced.append(total)
    assert _largest_from(reduced) == shards < big


def test_zero_without_replicas_is_refused():
    with pytest.raises(ValueError, match=r"`zero=3` shards .* but `data=1`"):
        tfdist.Strategy(zero=3, devices=devices(1))
    with pytest.raises(ValueError, match=r"`zero=1` shards optimizer state .* but `data=1`"):
        tfdist.Strategy(zero=1, devices=devices(1))
    with pytest.raises(ValueError, match=r"`zero=2` .* `data=1`"):
        tfdist.ParallelConfig(data=1, zero=2)


def test_an_optimizer_not_known_to_be_elementwise_is_refused_before_training():
    strategy = tfdist.Strategy(data=2, zero=1, devices=devices(2))
    with strategy.scope():
        model = make_model(optimizer=keras.optimizers.Lamb(1e-3))
    with pytest.raises(ValueError, match=r"tfdist does not know keras.*Lamb to be\. "
                                         r"Supported: .*Adam.*@tfdist.optim.elementwise"):
        model.fit(*data(64), batch_size=32, verbose=0)
    assert model.optimizer.iterations.numpy() == 0


@tfdist.optim.elementwise
class SignSGD(keras.optimizers.Optimizer):
    """A custom optimizer declared elementwise."""

    def update_step(self, gradient, variable, learning_rate):
        lr = keras.ops.cast(learning_rate, variable.dtype)
        self.assign_sub(variable, lr * keras.ops.sign(gradient))


def test_a_declared_elementwise_optimizer_trains_to_parity():
    def make():
        return make_model(optimizer=SignSGD(learning_rate=1e-3))

    reference = train(tfdist.Strategy(data=4, devices=devices(4)), make=make)
    assert_parity(train(tfdist.Strategy(data=4, zero=1, devices=devices(4)), make=make),
                  reference, rtol=1e-5)


def test_mixed_float16_and_xla_match_zero0_on_the_same_mesh():
    # Adafactor: its all-reduces run before the skip-if-non-finite branch.
    for name, config in (("adam", {"precision": "mixed_float16"}),
                         ("adafactor", {"precision": "mixed_float16"}),
                         ("adam", {"xla": True, "microbatches": 2})):
        reference = train_with(name, **config)
        result = train_with(name, zero=2 if "precision" in config else 1, **config)
        # float16 compute, but the same per-replica arithmetic as the reference.
        assert_parity(result, reference, rtol=1e-5, atol=1e-6)
        if "precision" in config:
            scaler, ref_scaler = result[2].optimizer, reference[2].optimizer
            assert float(scaler.dynamic_scale.numpy()) == float(ref_scaler.dynamic_scale.numpy())
            assert int(scaler.step_counter.numpy()) == int(ref_scaler.step_counter.numpy())


def test_zero2_non_finite_gradient_on_one_replica_skips_the_step_everywhere():
    from test_engine import components

    strategy = tfdist.Strategy(data=4, zero=2, precision="mixed_float16", devices=devices(4))
    with strategy.scope():
        model = make_model(optimizer=keras.optimizers.Adam(1e-2))
    x, y = data(32)
    x[8:16] = 1e6  # replica 1's rows overflow float16
    before = components(model)
    scale = float(model.optimizer.scale_loss(1.0))
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    for path, values in components(model).items():
        for old, new in zip(before[path], values):
            np.testing.assert_array_equal(old, new, err_msg=path)
    assert float(model.optimizer.scale_loss(1.0)) == scale / 2
    assert int(model.optimizer.iterations.numpy()) == 0
    assert all(not v.numpy().any() for v in model.optimizer.inner_optimizer._momentums)
    model.fit(*data(32, seed=1), batch_size=32, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1
    kernel = components(model)[model.weights[0].path]
    assert not np.array_equal(kernel[0], before[model.weights[0].path][0])
    for value in kernel[1:]:
        np.testing.assert_array_equal(value, kernel[0])
