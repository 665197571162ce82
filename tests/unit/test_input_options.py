"""Datasets distributed by tfdist's strategies run without tf.data's
autotuning thread unless asked for (see `tfdist.input_options`)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from helpers import devices


@pytest.fixture
def handed_to_tensorflow(monkeypatch):
    """The datasets tfdist's `Strategy` hands to `tf.distribute`."""
    seen = []
    parent = tf.distribute.MirroredStrategy
    for name in ("experimental_distribute_dataset", "distribute_datasets_from_function"):
        original = getattr(parent, name)

        def spy(self, source, options=None, original=original, name=name):
            if name == "experimental_distribute_dataset":
                seen.append(source)
                return original(self, source, options)
            return original(self, lambda c: seen.append(source(c)) or seen[-1], options)
        monkeypatch.setattr(parent, name, spy)
    return seen


def test_fit_distributes_its_data_without_autotuning(handed_to_tensorflow):
    strategy = tfdist.Strategy(data=2, devices=devices(2))
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, epochs=2, verbose=0)
    assert handed_to_tensorflow
    assert all(d.options().autotune.enabled is False for d in handed_to_tensorflow)


@pytest.mark.parametrize("enabled", [True, False])
def test_a_dataset_that_sets_autotuning_keeps_its_choice(handed_to_tensorflow, enabled):
    strategy = tfdist.Strategy(data=2, devices=devices(2))
    options = tf.data.Options()
    options.autotune.enabled = enabled
    dataset = tf.data.Dataset.range(8).batch(4).with_options(options)
    next(iter(strategy.experimental_distribute_dataset(dataset)))
    next(iter(strategy.distribute_datasets_from_function(lambda context: dataset)))
    assert [d.options().autotune.enabled for d in handed_to_tensorflow] == [enabled] * 2


def test_datasets_from_a_function_run_without_autotuning(handed_to_tensorflow):
    strategy = tfdist.Strategy(data=2, devices=devices(2))
    distributed = strategy.distribute_datasets_from_function(
        lambda context: tf.data.Dataset.range(8).batch(2).prefetch(tf.data.AUTOTUNE))
    assert next(iter(distributed)) is not None
    assert [d.options().autotune.enabled for d in handed_to_tensorflow] == [False]


def _device_datasets(distributed_iterator):
    """The datasets TensorFlow made for each device of `distributed_iterator`."""
    return [device_iterator._dataset
            for worker in distributed_iterator._iterators
            for device_iterator in worker._iterator._device_iterators]


@pytest.mark.parametrize("enabled", [True, None])
def test_the_datasets_made_for_each_device_run_without_autotuning(enabled):
    # Each device's own small dataset (a generator and a fixed prefetch
    # buffer) kept an autotuning thread that could sleep through the
    # iterator's destruction for up to a minute (tfdist/_compat/tf_data.py).
    strategy = tfdist.Strategy(data=2, devices=devices(2))
    dataset = tf.data.Dataset.range(8).batch(4)
    if enabled is not None:
        options = tf.data.Options()
        options.autotune.enabled = enabled
        dataset = dataset.with_options(options)
    for distributed in (strategy.experimental_distribute_dataset(dataset),
                        strategy.distribute_datasets_from_function(lambda context: dataset)):
        iterator = iter(distributed)
        next(iterator)
        made = _device_datasets(iterator)
        assert len(made) == 2
        assert [d.options().autotune.enabled for d in made] == [False, False]


def test_fit_and_evaluate_read_their_input_once_per_epoch():
    # Keras reads one batch before `fit`'s and `evaluate`'s first step, to
    # build the model, through a distributed iterator it drops at once; under
    # tfdist's strategies the model is built from the batch's spec.
    reads = []

    def read(index):
        reads.append(int(index))
        return index

    dataset = tf.data.Dataset.range(2).map(lambda i: tf.py_function(read, [i], tf.int64))
    dataset = dataset.map(lambda i: (tf.fill((4, 3), tf.cast(i, tf.float32)), tf.ones((4, 1))))
    strategy = tfdist.Strategy(data=2, devices=devices(2))
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    model.fit(dataset, epochs=2, verbose=0)
    model.evaluate(dataset, verbose=0)
    assert reads == [0, 1] * 3
