"""What conftest.py does between tests so that one test's leftovers do not
stall another: the tf.data iterators a test makes are counted, a test that
made any ends with a garbage collection, and one whose iterator with tf.data
autotuning outlives it fails."""

import sys

import numpy as np
import tensorflow as tf

from tfdist.input_options import without_autotuning


def test_a_test_that_makes_an_iterator_is_counted_for_its_garbage_collection():
    # Counted through OwnedIterator, which every kind of iterator is or holds.
    iterators = sys.modules["conftest"]._Iterators
    before = iterators.made
    np.testing.assert_array_equal(next(iter(tf.data.Dataset.range(3).batch(3))), [0, 1, 2])
    assert iterators.made == before + 1


def test_iterators_with_autotuning_are_the_ones_watched_for_outliving_their_test():
    iterators = sys.modules["conftest"]._Iterators
    tuned = iter(tf.data.Dataset.range(3))  # TensorFlow's default options: autotuning on
    untuned = iter(without_autotuning(tf.data.Dataset.range(3)))
    assert iterators.autotuning[tuned] == iterators.made - 1
    assert untuned not in iterators.autotuning
