"""What conftest.py does between tests so that one test's leftovers do not
stall another: the tf.data iterators a test makes are counted, and a test
that made any ends with a garbage collection."""

import sys

import numpy as np
import tensorflow as tf


def test_a_test_that_makes_an_iterator_is_counted_for_its_garbage_collection():
    # Counted through OwnedIterator, which every kind of iterator is or holds.
    conftest = sys.modules["conftest"]
    before = conftest._IteratorCount.made
    np.testing.assert_array_equal(next(iter(tf.data.Dataset.range(3).batch(3))), [0, 1, 2])
    assert conftest._IteratorCount.made == before + 1
