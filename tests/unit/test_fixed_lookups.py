"""Which lookups' gradients `sum_fixed_lookups` makes dense: those whose
indices every part of a batch shares (positions), not per-example ones."""

import pytest
import tensorflow as tf

from tfdist.sparse_gradients import is_sparse, sum_fixed_lookups

TABLE = tf.Variable(tf.ones((8, 2)))
COUNTER = tf.Variable(3)


def lookup_gradient(indices_of):
    """The gradient of a lookup of `indices_of(tokens)`, through
    `sum_fixed_lookups` in a tf.function."""

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int32)])
    def step(tokens):
        with tf.GradientTape() as tape:
            y = tf.gather(TABLE, indices_of(tokens))
        return sum_fixed_lookups([tape.gradient(y, TABLE)])[0]

    return step(tf.constant([[1, 2, 3]]))


@pytest.mark.parametrize("indices_of", [
    lambda t: tf.range(3),                        # a constant length
    lambda t: tf.range(tf.shape(t)[-1]),          # the sequence length, unknown when traced
    lambda t: tf.constant([[0, 1], [2, 3]]),
], ids=["range", "range_of_sequence_length", "constant"])
def test_fixed_indices_give_a_dense_gradient_of_the_same_sum(indices_of):
    gradient = lookup_gradient(indices_of)
    assert not is_sparse(gradient)
    expected = tf.math.unsorted_segment_sum(
        tf.ones((tf.size(indices_of(tf.zeros((1, 3), tf.int32))), 2)),
        tf.reshape(indices_of(tf.zeros((1, 3), tf.int32)), [-1]), 8)
    assert (gradient.numpy() == expected.numpy()).all()


@pytest.mark.parametrize("indices_of", [
    lambda t: t,                                   # the tokens: per example
    lambda t: t + tf.range(tf.shape(t)[-1]),       # mixed with them
    lambda t: tf.random.uniform([3], 0, 8, tf.int32),      # a draw
    lambda t: tf.range(COUNTER.read_value()),      # a variable's value
], ids=["tokens", "tokens_plus_positions", "random", "variable"])
def test_batch_dependent_or_stateful_indices_stay_slices(indices_of):
    assert is_sparse(lookup_gradient(indices_of))


def test_eager_gradients_are_left_as_they_are():
    with tf.GradientTape() as tape:
        y = tf.gather(TABLE, tf.range(3))
    assert is_sparse(sum_fixed_lookups([tape.gradient(y, TABLE)])[0])
