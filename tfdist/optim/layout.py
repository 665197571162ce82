"""`ShardLayout`: how one variable's elements are split across N replicas.

The variable is flattened (row-major) and zero-padded to `N * shard_size`
elements, `shard_size = ceil(size / N)`; replica r owns elements
`[r * shard_size, (r + 1) * shard_size)`. Every shard has the same shape, so the
shards of one variable (or of many, concatenated) cross devices in one
collective, and a large variable is split across every replica whatever its
shape. The padding (fewer than N elements per variable) is zeros and never
leaves the shards: `unshard` cuts it off.
"""

import math

import tensorflow as tf


class ShardLayout:
    """The element split of a variable of `shape` across `num_shards` replicas.

    Example:

    >>> layout = ShardLayout((3, 5), num_shards=4)   # 15 elements
    >>> layout.shard_size, layout.padding
    (4, 1)
    >>> layout.shard(tf.reshape(tf.range(15), (3, 5)), 3).numpy()
    array([12, 13, 14,  0], dtype=int32)
    """

    def __init__(self, shape, num_shards: int):
        self.shape = tf.TensorShape(shape)
        self.num_shards = num_shards
        self.size = self.shape.num_elements()
        self.shard_size = max(1, math.ceil(self.size / num_shards))
        self.padding = self.shard_size * num_shards - self.size
        self.shard_shape = [self.shard_size]

    def rows(self, value):
        """`value` (of `shape`) as a `(num_shards, shard_size)` tensor: row r is shard r."""
        flat = tf.reshape(value, [-1])
        if self.padding:
            flat = tf.pad(flat, [[0, self.padding]])
        return tf.reshape(flat, [self.num_shards, self.shard_size])

    def shard(self, value, index):
        """Shard `index` (an int or a scalar tensor) of `value`."""
        return self.rows(value)[index]

    def unshard(self, rows):
        """The full value from all shards (`(num_shards, shard_size)` or flat)."""
        flat = tf.reshape(rows, [-1])
        if self.padding:
            flat = flat[: self.size]
        return tf.reshape(flat, self.shape)
