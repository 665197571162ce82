"""Parity for batches that do not split evenly over the replicas.

A last partial batch (13, 29 or 1 examples on 4 replicas) and global batch
sizes the replicas do not divide (18 or 2 on 4, 128 on 3) train to the
single-device numbers in every mode: each replica's loss is weighted by its
share of the global batch (empty replicas included) and the reported metrics
come from every replica's examples.

Microbatches: a batch size known before training must divide into them
(`ValueError` otherwise, see tests/unit/test_usage_errors.py); a size known
only at run time (the last batch, or per-replica batches of unequal sizes) is
cut as evenly as possible, empty microbatches included, and weighted exactly.
"""

import keras
import pytest

import tfdist
from helpers import (
    assert_parity,
    data,
    devices,
    make_model,
    strategy_on_its_devices,
    train,
    trained_reference,
)

# name: (examples, batch size) -> the batch that does not split evenly
CASES = {
    "last13of4": (61, 16),    # 3 x 16, then 13 = 4 + 3 + 3 + 3
    "last29of4": (61, 32),    # 32, then 29 = 8 + 7 + 7 + 7
    "last1of4": (33, 16),     # 2 x 16, then 1 = 1 + 0 + 0 + 0
    "global18of4": (72, 18),  # 18 = 5 + 5 + 4 + 4, four times
    "global2of4": (8, 2),     # 2 = 1 + 1 + 0 + 0, four times
    "global128of3": (256, 128),  # 128 = 43 + 43 + 42, twice
}


def adam():
    return keras.optimizers.Adam(0.01)


def make_adam_model():
    return make_model(optimizer=adam())


def check(case, **config):
    n, batch = CASES[case]
    x, y = data(n)
    reference = trained_reference(make=make_adam_model, x=x, y=y, batch_size=batch)
    result = train(strategy_on_its_devices(**config), make=make_adam_model, x=x, y=y,
                   batch_size=batch)
    assert len(result[0]) == -(-n // batch)
    assert_parity(result, reference, steps=len(result[0]))


@pytest.mark.parametrize("case", [c for c in CASES if c != "global128of3"])
def test_data4(case):
    check(case, data=4)


def test_data3_global128():
    check("global128of3", data=3)


@pytest.mark.parametrize("case, k", [("last13of4", 2), ("global18of4", 3), ("global2of4", 2)])
def test_microbatches(case, k):
    # 13 -> 4, 3, 3, 3 rows: 2 microbatches split 3 rows 1 + 2; 18 -> 5, 5, 4, 4
    # with 3 microbatches; 2 -> 1, 1, 0, 0: empty microbatches.
    check(case, data=4, microbatches=k)


@pytest.mark.parametrize("case, zero", [("last13of4", 2), ("global2of4", 1)])
def test_zero(case, zero):
    check(case, data=4, zero=zero)


def test_zero_data3_global128():
    check("global128of3", data=3, zero=2)


@pytest.mark.parametrize("case", ["last13of4", "global2of4"])
def test_pipeline(case):
    check(case, data=4, pipeline=2, microbatches=2)


def test_pipeline_data3_global128():
    check("global128of3", data=3, pipeline=2, microbatches=2)


@pytest.mark.parametrize("case", ["last13of4", "global18of4", "global2of4"])
def test_tensor(case):
    # A tensor group (2 replicas) computes on its replicas' rows together:
    # groups of 7 and 6 rows, of 10 and 8, of 2 and 0.
    check(case, data=2, tensor=2)


def test_tensor_microbatches():
    # Groups of 8 rows cut into 2 + 3 + 3, then of 7 and 6 rows.
    check("last13of4", data=2, tensor=2, microbatches=3)


def test_reduce_cuts_batches_to_common_rows_and_reads_each_variable_as_itself():
    """`Strategy.reduce` of a batch whose replicas differ in rows keeps the
    rows every replica has; a sync-on-read variable (tf_keras's moving
    statistics) read across replicas is its own mean, not another's."""
    import numpy as np
    import tensorflow as tf

    strategy = tfdist.Strategy(devices=devices(2))
    batch = next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.range(3).map(lambda i: tf.cast(i, tf.float32)).batch(3))))
    np.testing.assert_array_equal(  # replicas hold [0, 1] and [2]: row 0 of each
        strategy.reduce("SUM", {"x": batch, "y": batch}, axis=None)["x"], [2.0])
    with strategy.scope():
        on_read = [tf.Variable(value, synchronization=tf.VariableSynchronization.ON_READ,
                               aggregation=tf.VariableAggregation.MEAN)
                   for value in ([1.0, 2.0], [3.0, 4.0], [5.0, 6.0])]
    for variable, value in zip(on_read, ([1.0, 2.0], [3.0, 4.0], [5.0, 6.0])):
        np.testing.assert_array_equal(tf.convert_to_tensor(variable), value)
