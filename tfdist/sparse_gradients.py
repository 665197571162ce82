"""Sparse gradients: `tf.IndexedSlices` kept slice by slice, as one device has them.

The gradient of a lookup (`tf.gather`, an Embedding) is a `tf.IndexedSlices`
with one slice per looked-up position of the batch: a token that occurs three
times has three slices. Keras's optimizers apply some functions slice by slice
before the slices of a row are summed (Adam's and RMSprop's `ops.square`
squares each slice, so the second moment of a row gets the sum of the squares,
not the square of the sum). For the update to be one device's, the optimizer
must see the whole batch's slices, so tfdist never sums them:

- `add`: the running sum of two gradients; two `IndexedSlices` are
  concatenated (microbatches in order, so the result holds exactly the whole
  batch's slices), anything else is added densely.
- `map_values`: a function of a gradient's values (scaling, unscaling),
  leaving its indices.
- `values`: the tensor holding a gradient's numbers (checks of finiteness).

One kind of lookup is the exception: a lookup whose indices do not depend on
the batch (the position embedding of keras-io's `TokenAndPositionEmbedding`,
an Embedding of `arange(length)`) gives one device one slice per position,
summed over the batch, while every replica and microbatch has the same
positions again. `sum_fixed_lookups` makes such a gradient dense where it is
computed, so the parts add up to one device's sum (exact when the fixed
indices are distinct, as a range's are).

Across replicas the slices are gathered, not summed (`tf.distribute`'s
all-reduce does this; `tfdist.engine.reduce.DataGroupAllReduce` too), and ZeRO
gives each replica the parts of the slices inside its element shard
(`tfdist.sharding.layout.ShardLayout.shard`).

Example:

>>> a = tf.IndexedSlices(tf.ones((1, 2)), tf.constant([3]), tf.constant([5, 2]))
>>> b = tf.IndexedSlices(tf.ones((2, 2)), tf.constant([3, 0]), tf.constant([5, 2]))
>>> add(a, b).indices.numpy()
array([3, 3, 0], dtype=int32)
"""

import tensorflow as tf

# Ops a fixed lookup's indices may come from: constants, and the shapes of
# tensors (a sequence length, a table's size: the same in every part).
_FIXED_SOURCES = frozenset({"Const", "Shape", "ShapeN", "Size", "Rank"})


def is_sparse(gradient) -> bool:
    """Whether `gradient` is a `tf.IndexedSlices`.

    Example:

    >>> is_sparse(tf.ones(2))
    False
    """
    return isinstance(gradient, tf.IndexedSlices)


def add(a, b):
    """`a + b` for gradients, None meaning no gradient: two `IndexedSlices` are
    concatenated (`a`'s slices first), otherwise the sum is dense.

    Example:

    >>> add(None, tf.ones(2)).numpy()
    array([1., 1.], dtype=float32)
    >>> s = tf.IndexedSlices(tf.ones((1, 2)), tf.constant([1]), tf.constant([3, 2]))
    >>> add(s, s).values.shape, add(s, tf.ones((3, 2))).numpy()[1]
    (TensorShape([2, 2]), array([2., 2.], dtype=float32))
    """
    if a is None:
        return b
    if b is None:
        return a
    if is_sparse(a) and is_sparse(b):
        return tf.IndexedSlices(tf.concat([a.values, b.values], 0),
                                tf.concat([a.indices, b.indices], 0), a.dense_shape)
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


def map_values(gradient, fn):
    """`fn(gradient)`, or for `IndexedSlices` the same slices with `fn(values)`.

    `fn` must be elementwise (scaling by a scalar, adding NaN).

    Example:

    >>> s = tf.IndexedSlices(tf.ones((1, 2)), tf.constant([1]), tf.constant([3, 2]))
    >>> map_values(s, lambda v: v * 4.0).values.numpy()
    array([[4., 4.]], dtype=float32)
    """
    if is_sparse(gradient):
        return tf.IndexedSlices(fn(gradient.values), gradient.indices, gradient.dense_shape)
    return fn(gradient)


def values(gradient):
    """The tensor of a gradient's numbers: its values for `IndexedSlices`.

    Example:

    >>> s = tf.IndexedSlices(tf.ones((1, 2)), tf.constant([1]), tf.constant([3, 2]))
    >>> values(s).shape
    TensorShape([1, 2])
    """
    return gradient.values if is_sparse(gradient) else gradient


def sum_fixed_lookups(gradients: list) -> list:
    """`gradients` with each `IndexedSlices` whose indices do not depend on the
    batch made dense (its duplicate rows summed); the others unchanged.

    Indices are fixed when every op they are computed from is stateless and
    starts from constants and shapes: a lookup of `arange(length)`, not of
    token ids, a random draw or a variable's value. Eager tensors (no graph
    to read) are left as they are.

    Example:

    >>> words, positions = tf.Variable(tf.ones((4, 2))), tf.Variable(tf.ones((2, 2)))
    >>> @tf.function
    ... def grads(tokens):
    ...     with tf.GradientTape() as tape:
    ...         y = tf.gather(words, tokens) + tf.gather(positions, tf.range(2))
    ...     return sum_fixed_lookups(tape.gradient(y, [words, positions]))
    >>> [is_sparse(g) for g in grads(tf.constant([3, 3]))]
    [True, False]
    """
    return [tf.convert_to_tensor(g) if is_sparse(g) and _is_fixed(g.indices) else g
            for g in gradients]


def _is_fixed(indices) -> bool:
    if not hasattr(indices, "graph") or tf.executing_eagerly():
        return False
    pending, seen = [indices.op], set()
    while pending:
        op = pending.pop()
        if op.name in seen or op.type in _FIXED_SOURCES:
            continue
        seen.add(op.name)
        if op.op_def.is_stateful or not op.inputs:
            return False  # a placeholder (the batch, a variable), a draw, a read
        pending.extend(t.op for t in op.inputs)
    return True
