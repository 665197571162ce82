"""Graph internals: making ops already built wait for one built later.

A zero-bubble pipeline computes a stage's input and weight gradients in one
`tape.gradient` call (one backward pass, nothing computed twice) and runs the
weight-gradient part later. TensorFlow's public `tf.control_dependencies` only
applies to ops created inside it, so the ops of that part get their control
input afterwards (`Operation._add_control_input`, what `tf.function`'s
automatic control dependencies use), before the graph runs.
"""


def run_after(ops, trigger):
    """Makes every op of `ops` (built, not yet run) wait for the op `trigger`.

    Example:

    ```python
    start = tf.no_op()              # built when the deferred work may start
    run_after(deferred_ops, start)
    ```
    """
    for op in ops:
        op._add_control_input(trigger)
