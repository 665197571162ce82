"""conftest.py turns TensorFlow's graph optimiser off but for tests marked `grappler`."""

import pytest
import tensorflow as tf


def test_the_graph_optimizer_is_off_in_an_unmarked_test():
    assert tf.config.optimizer.get_experimental_options()["disable_meta_optimizer"] is True


@pytest.mark.grappler
def test_the_graph_optimizer_is_on_in_a_marked_test():
    assert tf.config.optimizer.get_experimental_options()["disable_meta_optimizer"] is False
