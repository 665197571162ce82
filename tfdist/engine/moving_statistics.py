"""BatchNormalization's moving statistics: advanced once per step, equal on every replica.

A `BatchNormalization` layer moves its moving mean and variance each time it
runs in training. Run once per microbatch they would move `microbatches` times
per step; under `tf.distribute` each replica moves its own copy with its own
examples, and the copies drift apart (Keras 3 creates them without cross-replica
aggregation, and reads replica 0's).

Here, every microbatch's forward starts from the statistics the step started
with; the step ends with their mean over every microbatch of every replica,
weighted by its rows (empty ones count for nothing), on every replica. With
equal microbatches that is one device's update of the moving *mean* with the
whole global batch; the moving variance is the mean of the microbatches'
(as in data parallelism without synchronized BatchNormalization; each
microbatch normalises with its own batch statistics, or the global batch's with
`BatchNormalization(synchronized=True)`).
"""

import keras
import tensorflow as tf

from tfdist._compat.keras_functional import nested_sublayers
from tfdist._compat.tf_distribute import summed_across_replicas


class MovingStatistics:
    """The moving statistics of a model's BatchNormalization layers over one step.

    Args:
        layers: the layers whose BatchNormalization statistics to follow
            (nested ones included), e.g. `[model]`; other operations (a
            functional model's `x + y`) are skipped.

    Example:

    ```python
    moving = MovingStatistics([model])
    start = moving.start()
    for part in microbatches:
        moving.reset(start)                 # before the microbatch's forward
        ...                                 # forward, loss, gradients
        totals = moving.add(totals, part.size)
    moving.finish(start, totals)            # in replica context
    ```
    """

    def __init__(self, layers):
        found = [sub for layer in layers if isinstance(layer, keras.layers.Layer)
                 for sub in [layer, *nested_sublayers(layer)]]
        self.variables = [
            v for layer in found if isinstance(layer, keras.layers.BatchNormalization)
            for v in (layer.moving_mean, layer.moving_variance)]

    def start(self):
        """The statistics at the start of the step (None if there are none)."""
        return [tf.identity(v.value) for v in self.variables] or None

    def reset(self, start):
        """Sets the statistics back to where the step started."""
        for v, value in zip(self.variables, start or ()):
            v.assign(value)

    def add(self, totals, rows):
        """`totals` plus the statistics now, weighted by `rows`: a list of the
        weighted sums, then the rows (a float scalar)."""
        rows = tf.cast(rows, tf.float32)
        now = [tf.where(rows > 0, v.value * rows, tf.zeros_like(v.value)) for v in self.variables]
        if totals is None:
            return [*now, rows]
        return [t + n for t, n in zip(totals, [*now, rows])]

    def finish(self, start, totals):
        """Sets the statistics to the row-weighted mean of `totals` over every
        replica (unchanged if no replica had a row)."""
        if start is None:
            return
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            totals = summed_across_replicas(totals)
        *sums, rows = totals
        for v, old, total in zip(self.variables, start, sums):
            v.assign(tf.where(rows > 0, total / tf.maximum(rows, 1.0), old))
