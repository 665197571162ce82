"""Parity for ragged inputs (`tf.RaggedTensor`): token id lists of different lengths.

An `Embedding` then a pooling that takes ragged tensors, fed ragged arrays or a
dataset of ragged batches, trains to the single-device numbers: over 2
replicas with batches they do not split evenly (15 = 8 + 7; the last, 1 = 1 +
0), with microbatches, ZeRO-3's units, the embedding split by vocabulary
(`tensor`: the group exchanges its ragged rows) and a pipeline stage boundary
that a ragged activation crosses.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from helpers import assert_parity, devices, strategy_on_its_devices, train

VOCABULARY, CLASSES = 50, 3
EXAMPLES, BATCH = 61, 15  # 4 x 15, then 1


def ragged_data():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 7, size=EXAMPLES)
    ids = tf.ragged.constant([rng.integers(0, VOCABULARY, size=n) for n in lengths],
                             dtype="int32")
    return ids, (lengths % CLASSES).astype("int32")


X, Y = ragged_data()


def make_ragged_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((None,), ragged=True, dtype="int32"),
        keras.layers.Embedding(VOCABULARY, 8),
        keras.layers.GlobalAveragePooling1D(name="pool"),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(CLASSES),
    ])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


@pytest.fixture(scope="module")
def reference():
    return train(make=make_ragged_model, x=X, y=Y, batch_size=BATCH)


def train_ragged(**config):
    return train(strategy_on_its_devices(**config), make=make_ragged_model, x=X, y=Y,
                 batch_size=BATCH)


def test_arrays_data2(reference):
    result = train_ragged(data=2)
    assert_parity(result, reference, steps=len(result[0]))
    model, reference_model = result[2], reference[2]
    np.testing.assert_allclose(model.evaluate(X, Y, batch_size=BATCH, verbose=0),
                               reference_model.evaluate(X, Y, batch_size=BATCH, verbose=0),
                               rtol=1e-5)


def test_dataset_data2(reference):
    strategy = tfdist.Strategy(devices=devices(2), data=2)
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH)
    result = train(strategy, make=make_ragged_model, x=dataset, batch_size=None)
    assert_parity(result, reference, steps=len(result[0]))


@pytest.mark.parametrize("config", [
    dict(data=2, microbatches=2),
    dict(data=2, zero=3),
    dict(data=2, tensor=2),
    dict(data=2, pipeline=2, microbatches=2, stage_boundaries=["pool"]),
], ids=["microbatches", "zero3", "tensor", "pipeline"])
def test_modes(reference, config):
    result = train_ragged(**config)
    assert_parity(result, reference, steps=len(result[0]))
