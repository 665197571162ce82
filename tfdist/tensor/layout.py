"""`AxisLayout`: a weight split along one axis across the t ranks of a tensor group.

Rank k holds the k-th of t equal slices along `axis`; replica r holds rank
`r % t`'s slice (see `TensorMesh`), so every data group holds one full copy of
the weight. `ShardedStorage` uses it as it uses `ShardLayout`: reads across
replicas concatenate ranks 0..t-1, assigns slice a full value.
"""

import tensorflow as tf


class AxisLayout:
    """The split of a weight of `shape` into `parts` slices along `axis`.

    Example:

    >>> layout = AxisLayout((4, 6), axis=1, parts=2)
    >>> layout.shard_shape
    [4, 3]
    >>> layout.shard(tf.reshape(tf.range(24), (4, 6)), 3).numpy()[0]  # replica 3: rank 1
    array([3, 4, 5], dtype=int32)
    """

    def __init__(self, shape, axis: int, parts: int):
        self.shape = tf.TensorShape(shape)
        self.axis = axis % self.shape.rank
        self.parts = parts
        if self.shape[self.axis] % parts:
            raise ValueError(
                f"Dimension {self.axis} of shape {tuple(self.shape)} is "
                f"{self.shape[self.axis]}, which {parts} shards do not divide.")
        self.shard_shape = self.shape.as_list()
        self.shard_shape[self.axis] //= parts

    def shard(self, value, index):
        """The slice of `value` that replica `index` holds (rank `index % parts`)."""
        return tf.split(value, self.parts, axis=self.axis)[index % self.parts]

    def unshard(self, shards):
        """The full value from every replica's shard, stacked in replica order."""
        return tf.concat([shards[rank] for rank in range(self.parts)], axis=self.axis)
