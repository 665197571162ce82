"""Tensor parallelism composed with microbatches and mixed precision: parity
with one device, and the same loss-scaling decision on every replica."""

import keras
import numpy as np
import pytest

import tfdist
from helpers import (
    FEATURES,
    assert_parity,
    devices,
    step_ops,
    traced_train_function,
    train,
    trained_reference,
)
from test_tensor_transformer import lm_data, make_lm


def train_lm(strategy=None, policy="float32"):
    """The Transformer LM of test_tensor_transformer, built under `policy`
    (the strategy's scope sets it; without a strategy, the global policy)."""
    x, y = lm_data()
    keras.config.set_dtype_policy(policy)
    try:
        if strategy is None:
            return trained_reference(make=make_lm, x=x, y=y, batch_size=16)
        return train(strategy, make=make_lm, x=x, y=y, batch_size=16)
    finally:
        keras.config.set_dtype_policy("float32")


@pytest.mark.parametrize("data_size, tensor, microbatches", [(2, 2, 2), (1, 2, 4)])
def test_microbatches_match_one_device(data_size, tensor, microbatches):
    strategy = tfdist.Strategy(data=data_size, tensor=tensor, microbatches=microbatches,
                               devices=devices(data_size * tensor))
    # Each tensor group splits its batch into microbatches (every rank the
    # same rows) and all-reduces activations per microbatch: sums in another
    # order than one device, so the design bar 1e-4 holds.
    assert_parity(train_lm(strategy), train_lm())


@pytest.mark.parametrize("policy, rtol, atol", [
    # float16 (11-bit mantissa): the tensor group all-reduces float16
    # partial products, rounded once per rank before the sum, where one
    # device rounds the whole product once; after 20 momentum steps the
    # weights (up to ~1 in size) differ by up to a few 1e-3.
    ("mixed_float16", 1e-3, 5e-3),
    # bfloat16 (8-bit mantissa): the same, 8x coarser.
    ("mixed_bfloat16", 2e-2, 2e-2),
])
def test_mixed_precision_matches_one_device_mixed_precision(policy, rtol, atol):
    strategy = tfdist.Strategy(data=2, tensor=2, precision=policy, devices=devices(4))
    result = train_lm(strategy, policy)
    assert result[2].dtype_policy.name == policy
    assert_parity(result, train_lm(policy=policy), rtol=rtol, atol=atol)


def make_overflowing_head():
    """A split classifier whose kernel gradient overflows float16 on rank 1 only.

    Inputs are all 8 x data, the kernel starts at zero and every label is
    class 3: the logits' gradient is 0.25 for classes 0-2 and -0.75 for class
    3, so at the initial loss scale 2**15 (divided by Keras by the 2 x data
    replicas) the kernel gradient is 8 x 0.25 x 2**14 = 32,768 on rank 0
    (classes 0, 1), finite in float16, and 8 x 0.75 x 2**14 = 98,304 > 65,504
    on rank 1.
    """
    model = keras.Sequential([
        keras.Input((FEATURES,)),
        tfdist.layers.ColumnParallelDense(4, gather_output=True, kernel_initializer="zeros"),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("data_size, zero", [(1, 0), (2, 0), (2, 1), (2, 2)])
def test_loss_scaling_skips_a_step_on_every_rank_when_one_rank_overflows(data_size, zero):
    n = 2 * data_size
    strategy = tfdist.Strategy(data=data_size, tensor=2, zero=zero,
                               precision="mixed_float16", devices=devices(n))
    with strategy.scope():
        model = make_overflowing_head()
    x = np.full((32, FEATURES), 8.0 * data_size, "float32")
    y = np.full((32,), 3, "int32")
    model.fit(x, y, batch_size=32, verbose=0)  # one step
    optimizer = model.optimizer
    # Skipped on both ranks: no shard moved, the scale halved on every device.
    for shard in model.layers[0].kernel.value.values:
        np.testing.assert_array_equal(shard.numpy(), np.zeros((FEATURES, 2)))
    assert [v.numpy() for v in optimizer.dynamic_scale.value.values] == [2.0 ** 14] * n
    assert optimizer.iterations.numpy() == 0
    # At 2**14, 49,152 is finite: the next step applies on both ranks.
    model.fit(x, y, batch_size=32, verbose=0)
    assert all(np.abs(shard.numpy()).max() > 0
               for shard in model.layers[0].kernel.value.values)
    assert [v.numpy() for v in optimizer.dynamic_scale.value.values] == [2.0 ** 14] * n
    assert optimizer.iterations.numpy() == 1


def make_uint8_mlp():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,), dtype="uint8")
    x = keras.layers.Rescaling(1 / 255)(inputs)
    x = keras.layers.Dense(32, activation="relu")(x)
    x = keras.layers.Dense(16)(x)
    model = keras.Model(inputs, keras.layers.Dense(4)(x))
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("label_dtype", ["uint8", "bool"])
@pytest.mark.grappler  # tensor groups' step as a user's job runs it (conftest.py)
def test_uint8_inputs_and_small_labels_match_one_device(label_dtype):
    # The tensor group exchanges its batch in a dtype TensorFlow's collectives
    # gather (uint8 and bool as int64) and back: inputs and labels as the
    # columns of one int64 matrix, so each replica gathers once, not once per
    # tensor (the trace counts the slices' rows, 16 / 4: no rank's row count
    # is exchanged).
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(64, FEATURES)).astype("uint8")
    y = (x[:, 0] > 127).astype(label_dtype)
    reference = trained_reference(make=make_uint8_mlp, x=x, y=y, batch_size=16)
    result = train(tfdist.Strategy(data=2, tensor=2, devices=devices(4)),
                   make=make_uint8_mlp, x=x, y=y, batch_size=16)
    assert_parity(result, reference, steps=4)
    (step,) = traced_train_function(result[2])._list_all_concrete_functions()
    gathers = [op for op in step_ops(step.graph, scope="group_batch")
               if op.type == "CollectiveGatherV2"]
    assert len(gathers) == 1 * 4  # 4 replicas
