"""Keras's Adafactor update on element shards, exact, with two small all-reduces.

Adafactor is not elementwise (`keras/src/optimizers/adafactor.py`): its step
size scales with the RMS of the whole variable, its update is clipped by the
RMS of the whole update `u`, and for a variable of rank >= 2 (shape
`(..., R, C)`) the second moment is factored: `r` (shape `(..., R)`) and `c`
(shape `(..., C)`) are moving averages of the row and column means of
`g**2 + epsilon_1`, and `v = r / mean(r) (outer) c`.

On a replica holding flat shard p of every variable (`ShardLayout`: a shard
may start and end in the middle of a row, and spans any columns), one step is:

1. each replica sums over its shard: the squares of the (decayed) variable,
   and `g**2 + epsilon_1` by row and by column (`unsorted_segment_sum` into
   vectors of the full `(..., R)` and `(..., C)` sizes: a row cut by a shard
   boundary gets a partial sum from each side). One packed all-reduce of these
   scalars and vectors gives every replica the whole-variable sums;
2. every replica updates the whole `r` and `c` (small, replicated: each
   replica keeps a full copy, identical everywhere) and its shard of `v` and
   `u`, and sums the squares of its `u`: a second packed all-reduce, one
   scalar per variable;
3. each replica finishes its shard of the variable.

The arithmetic is Keras's, element for element; only the order in which the
sums are added differs (rtol ~1e-7). Everything is computed first and
returned as assignments, so a caller may commit them conditionally (under
loss scaling, only if the gradients are finite) while the collectives stay
outside the condition.

Example (what `ShardedUpdate` does per step, in replica context):

```python
state, new_values = adafactor.updates(optimizer, gradient_shards, parameter_shards,
                                      layouts, indices, lr)
for variable, value in state:
    variable.assign(value)
```
"""

import tensorflow as tf
from keras import ops

from tfdist import sparse_gradients
from tfdist._compat import keras_optimizer
from tfdist._compat.tf_distribute import summed_across_replicas


def replicated_state(optimizer):
    """The variables every replica keeps whole: `r` and `c` of each variable
    (scalar placeholders for variables of rank < 2)."""
    return [s for s in keras_optimizer.adafactor_row_and_column_factors(optimizer)
            if s is not None]


def updates(optimizer, gradients, values, layouts, indices, learning_rate):
    """Keras's `Adafactor.update_step` for every variable, on this replica's shards.

    `gradients[k]` and `values[k]` (the replica's shard of the parameter,
    weight decay already applied) belong to variable `indices[k]`, laid out
    by `layouts[k]`. Returns `(state, new_values)`: the (optimizer variable,
    new value) pairs to assign, and the new parameter shards.
    """
    context = tf.distribute.get_replica_context()
    replica = context.replica_id_in_sync_group
    steps = [_Step(optimizer, g, value, layout, i, replica, learning_rate)
             for g, value, layout, i in zip(gradients, values, layouts, indices)]
    sums = summed_across_replicas([t for step in steps for t in step.partial_sums()])
    for step in steps:
        sums = step.second_moment(sums)
    update_sums = summed_across_replicas(tf.stack([step.update_square_sum for step in steps]))
    new_values = [step.finish(update_sums[k]) for k, step in enumerate(steps)]
    return [pair for step in steps for pair in step.state], new_values


class _Step:
    """One variable's Adafactor step on one shard, in the three phases above."""

    def __init__(self, optimizer, gradient, value, layout, index, replica, learning_rate):
        self.optimizer, self.value, self.layout = optimizer, value, layout
        self.r, self.c, self.v = keras_optimizer.adafactor_factors(optimizer, index)
        self.factored = len(layout.shape) >= 2
        self.state = []  # (optimizer variable, new value)
        dtype = value.dtype
        # As Keras: learning rate, step, relative step size, beta_2.
        lr = ops.cast(learning_rate, dtype)
        gradient = sparse_gradients.map_values(gradient, lambda g: ops.cast(g, dtype))
        self.gradient = tf.convert_to_tensor(gradient)
        self.slices = gradient if sparse_gradients.is_sparse(gradient) else None
        local_step = ops.cast(optimizer.iterations + 1, dtype)
        schedule = callable(keras_optimizer.learning_rate_setting(optimizer))
        if not schedule and optimizer.relative_step:
            lr = ops.minimum(lr, 1 / ops.sqrt(local_step))
        self.rho = ops.minimum(lr, 1 / ops.sqrt(local_step))
        self.beta = ops.subtract(1, ops.power(local_step, optimizer.beta_2_decay))
        # Flat positions of this shard's elements; padding (past the end) is masked.
        flat = replica * layout.shard_size + tf.range(layout.shard_size)
        self.valid = flat < layout.size
        flat = tf.minimum(flat, layout.size - 1)
        # Keras squares a sparse gradient slice by slice: each element gets
        # the sum of its slices' squares.
        squares = tf.convert_to_tensor(sparse_gradients.map_values(gradient, ops.square))
        self.square = tf.where(
            self.valid, ops.add(squares, optimizer.epsilon_1), tf.zeros_like(self.gradient))
        if self.factored:
            rows, cols = layout.shape[-2], layout.shape[-1]
            self.row = flat // cols                                   # index into r, flat
            self.col = flat // (rows * cols) * cols + flat % cols     # index into c, flat
            self.num_rows, self.num_cols = self.r.shape.num_elements(), self.c.shape.num_elements()

    def partial_sums(self):
        """This shard's part of: sum of squares of the variable, and (factored)
        the row and column sums of `g**2 + epsilon_1`."""
        sums = [tf.reshape(tf.reduce_sum(tf.square(self.value)), [1])]
        if self.factored:
            sums += [tf.math.unsorted_segment_sum(self.square, self.row, self.num_rows),
                     tf.math.unsorted_segment_sum(self.square, self.col, self.num_cols)]
        return sums

    def second_moment(self, sums):
        """New r, c (whole) and this shard of v (into `state`); this shard of `u`.
        Consumes this variable's entries of the all-reduced `sums`; returns the rest."""
        optimizer, size = self.optimizer, self.layout.size
        variable_square_sum, sums = sums[0][0], sums[1:]
        self.alpha = ops.maximum(ops.cast(optimizer.epsilon_2, self.value.dtype),
                                 ops.sqrt(variable_square_sum / size)) * self.rho
        beta = self.beta
        if self.factored:
            row_sums, col_sums, sums = sums[0], sums[1], sums[2:]
            rows, cols = self.layout.shape[-2], self.layout.shape[-1]
            row_means = tf.reshape(row_sums / cols, self.r.shape)
            col_means = tf.reshape(col_sums / rows, self.c.shape)
            r = ops.add(ops.multiply(beta, self.r), ops.multiply(ops.subtract(1, beta), row_means))
            c = ops.add(ops.multiply(beta, self.c), ops.multiply(ops.subtract(1, beta), col_means))
            self.state += [(self.r, r), (self.c, c)]
            r_normalised = tf.reshape(ops.divide(r, ops.mean(r, axis=-1, keepdims=True)), [-1])
            v = ops.multiply(tf.gather(r_normalised, self.row),
                             tf.gather(tf.reshape(c, [-1]), self.col))
        else:
            v = ops.add(ops.multiply(beta, self.v),
                        ops.multiply(ops.subtract(1, beta), self.square))
        v = tf.where(self.valid, v, tf.zeros_like(v))
        self.state.append((self.v, v))
        self.u = tf.where(self.valid, ops.divide(self.gradient, ops.sqrt(v)), tf.zeros_like(v))
        if self.slices is None:
            self.update_square_sum = tf.reduce_sum(tf.square(self.u))
        else:  # as Keras: the squares of each slice's update
            scale = tf.gather(ops.sqrt(v), self.slices.indices)
            self.update_square_sum = tf.reduce_sum(tf.square(self.slices.values / scale))
        return sums

    def finish(self, update_square_sum):
        """The new shard: `u` clipped by the RMS of the whole update, applied."""
        one = ops.cast(1.0, self.value.dtype)
        rms = ops.sqrt(update_square_sum / self.layout.size)
        u_hat = ops.divide(self.u, ops.maximum(one, ops.divide(rms, self.optimizer.clip_threshold)))
        return ops.subtract(self.value, ops.multiply(self.alpha, u_hat))
