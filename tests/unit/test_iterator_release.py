"""A dropped iterator of a tfdist strategy's distributed dataset is released on
the "tfdist-iterator-release" thread: TensorFlow's C++ waits there, up to a
minute, for the input pipeline's autotuning thread (tfdist/_compat/tf_input.py),
not in the thread that dropped it (Keras's, at every epoch's start, or the one a
garbage collection runs in)."""

import threading
import time
import weakref

import pytest
import tensorflow as tf

import tfdist
from helpers import devices


def distributed(strategy, how):
    if how == "dataset":
        dataset = tf.data.Dataset.range(64).batch(8).prefetch(tf.data.AUTOTUNE)
        return strategy.experimental_distribute_dataset(dataset)
    return strategy.distribute_datasets_from_function(
        lambda context: tf.data.Dataset.range(64).batch(4).prefetch(tf.data.AUTOTUNE))


def dropping_threads(strategy, how):
    """The names of the threads that drop the devices' iterators of one
    iterator, first read once, then dropped here."""
    iterator = iter(distributed(strategy, how))
    next(iterator)
    names = []
    for worker in iterator._iterators:
        weakref.finalize(worker._iterator,
                         lambda: names.append(threading.current_thread().name))
    del iterator, worker
    deadline = time.monotonic() + 60
    while not names and time.monotonic() < deadline:
        time.sleep(0.01)
    return names


@pytest.mark.parametrize("how", ["dataset", "function"])
def test_a_dropped_iterator_is_released_on_the_release_thread(how):
    strategy = tfdist.Strategy(data=2, devices=devices(2))
    assert dropping_threads(strategy, how) == ["tfdist-iterator-release"]
    # tf.distribute's own: the thread that drops the iterator waits.
    mirrored = tf.distribute.MirroredStrategy(devices(2))
    assert dropping_threads(mirrored, how) == [threading.main_thread().name]
