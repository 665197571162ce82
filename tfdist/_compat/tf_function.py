"""tf.function internals: variables made while a function is first traced,
without making the function trace itself again.

A `tf.function` whose first trace creates variables traces itself a second
time (the first trace's graph may initialise them; the second, which must
not create any, is the one it runs): the whole step's tracing, twice. It
notices them through a variable creator it puts on the graph it traces
(`variable_capturing_scope` in TensorFlow's polymorphic_function.py), which
every `tf.Variable` made during the trace passes through, even under
`tf.init_scope()`. tfdist readies a step's state (tensor slices, optimizer
shards) when the first trace reaches it, eagerly: that creator is set aside
there, so the function keeps its one trace.
"""

import contextlib

import tensorflow as tf

# The name of the creator a tf.function's first trace installs.
_CAPTURING_CREATOR = "variable_capturing_scope"


@contextlib.contextmanager
def eagerly_outside_the_trace():
    """`tf.init_scope()`, and variables made in it not counted as the
    enclosing `tf.function` trace's own.

    Example:

    ```python
    with eagerly_outside_the_trace():   # inside a first trace
        slot = tf.Variable(tf.zeros([4]))  # eager; no second trace
    ```
    """
    graph = tf.compat.v1.get_default_graph()
    stack = graph._variable_creator_stack
    kept = [(p, c) for p, c in stack if getattr(c, "__name__", "") != _CAPTURING_CREATOR]
    graph._variable_creator_stack = kept
    try:
        with tf.init_scope():
            yield
    finally:
        graph._variable_creator_stack = stack
