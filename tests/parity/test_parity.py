"""Parity: every data-parallel configuration trains to the single-device numbers."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from helpers import assert_parity, data, devices, make_model, train, trained_reference

# With Grappler on, as a user's job runs (conftest.py): the data-parallel steps.
pytestmark = pytest.mark.grappler


@pytest.fixture(scope="module")
def reference():
    return trained_reference()


def test_data4_matches_one_device(reference):
    result = train(tfdist.Strategy(data=4, devices=devices(4)))
    assert_parity(result, reference)


def test_data4_microbatches4_matches_one_device(reference):
    strategy = tfdist.Strategy(data=4, microbatches=4, devices=devices(4))
    assert_parity(train(strategy), reference)


def test_data2_on_a_two_device_subset(reference):
    # A 2-device strategy on devices 2 and 3 of the 8, after 4-device ones ran.
    strategy = tfdist.Strategy(data=2, devices=devices(4)[2:])
    assert_parity(train(strategy), reference)


def test_adam_with_sample_weights_and_microbatches():
    x, y = data()
    weights = np.linspace(0.1, 2.0, len(x)).astype("float32")
    kwargs = dict(make=make_model, x=x, y=y,
                  fit_kwargs={"sample_weight": weights},
                  optimizer=None)
    reference = train(**{**kwargs, "optimizer": keras.optimizers.Adam(1e-2)})
    strategy = tfdist.Strategy(data=4, microbatches=2, devices=devices(4))
    with strategy.scope():
        optimizer = keras.optimizers.Adam(1e-2)
    result = train(strategy, **{**kwargs, "optimizer": optimizer})
    assert_parity(result, reference)


def test_partial_last_batch_with_microbatches_matches_microbatches1():
    # 650 examples, batch 32: the last batch has 10 examples, so some replicas
    # get batches the 4 microbatches do not divide (and empty microbatches).
    x, y = data(650)
    plain = train(tfdist.Strategy(data=4, devices=devices(4)), x=x, y=y)
    micro = train(tfdist.Strategy(data=4, microbatches=4, devices=devices(4)), x=x, y=y)
    # Reduction order differs between the two (sums over microbatches): 1e-5.
    assert_parity(micro, plain, rtol=1e-5)


def _train_under_global_policy(policy, strategy=None):
    keras.config.set_dtype_policy(policy)
    try:
        return train(strategy)
    finally:
        keras.config.set_dtype_policy("float32")


def test_mixed_float16_data4_matches_one_device_mixed_float16():
    reference = _train_under_global_policy("mixed_float16")
    strategy = tfdist.Strategy(data=4, precision="mixed_float16", devices=devices(4))
    result = train(strategy)
    assert result[2].dtype_policy.name == "mixed_float16"
    assert isinstance(result[2].optimizer, keras.optimizers.LossScaleOptimizer)
    # float16 compute (11-bit mantissa): each replica's 8-row matmuls round
    # differently from one device's 32-row ones; after 20 momentum steps the
    # weights (of size ~0.3) differ by a few 1e-4, hence rtol 1e-3, atol 1e-3.
    assert_parity(result, reference, rtol=1e-3, atol=1e-3)
    # Against Keras's own MirroredStrategy on the same 4 devices (the same
    # per-replica arithmetic), the engine agrees far more tightly.
    mirrored = _train_under_global_policy(
        "mixed_float16", tf.distribute.MirroredStrategy(devices(4)))
    assert_parity(result, mirrored, rtol=1e-5, atol=1e-6)


def test_mixed_bfloat16_and_xla_train_to_parity():
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        reference = train()
    finally:
        keras.config.set_dtype_policy("float32")
    strategy = tfdist.Strategy(data=4, precision="mixed_bfloat16", xla=True,
                               microbatches=2, devices=devices(4))
    # bfloat16 has 8 bits of mantissa: microbatch partial sums round differently.
    assert_parity(train(strategy), reference, rtol=2e-2, atol=2e-3)
