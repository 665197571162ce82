"""Shard layouts: how one variable's value is split across a strategy's replicas.

Every layout has the same interface, which `ShardedStorage` relies on:

- `shape`: the full variable's shape;
- `shard_shape`: the shape of each replica's shard (the same on every replica);
- `shard(value, index)`: the shard of a full `value` that replica `index`
  holds (an int, or a scalar tensor for `ShardLayout`);
- `unshard(shards)`: the full value from every replica's shard, stacked in
  replica order;
- `rows_piece(rows, start, index)`: the elements of replica `index`'s shard
  that rows `start` to `start + len(rows)` of the full value give, flat and
  in the shard's order: concatenated over consecutive row blocks, they are
  the shard (`tfdist.sharding.storage` builds a new layout's shards so,
  never holding the whole value).

The layouts:

- `ShardLayout` (ZeRO): the variable is flattened (row-major) and zero-padded
  to `N * shard_size` elements, `shard_size = ceil(size / N)`; replica r owns
  elements `[r * shard_size, (r + 1) * shard_size)`. Every shard has the same
  shape, so the shards of one variable (or of many, concatenated) cross
  devices in one collective, and a large variable is split across every
  replica whatever its shape. The padding (fewer than N elements per
  variable) is zeros and never leaves the shards: `unshard` cuts it off.
- `AxisLayout` (tensor parallelism): t equal slices along one axis; replica r
  holds rank `r % t`'s slice (see `tfdist.tensor.TensorMesh`), so every data
  group holds one full copy of the weight.
- `MeshShardLayout` (ZeRO on a data x tensor mesh): each tensor rank's part of
  a weight (its `AxisLayout` slice, or all of it) split by `ShardLayout`
  across the replicas of its data group.

Example:

>>> layout = AxisLayout((4, 6), axis=1, parts=2)
>>> full = tf.reshape(tf.range(24), (4, 6))
>>> shards = tf.stack([layout.shard(full, r) for r in range(2)])
>>> bool(tf.reduce_all(layout.unshard(shards) == full))
True
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
        """Shard `index` (an int or a scalar tensor) of `value`.

        For a `tf.IndexedSlices` value (slices of rows of `shape`), the
        elements of its slices that fall in the shard, one slice per element,
        as `tf.IndexedSlices` of shape `[shard_size]`: a row cut by a shard
        boundary gives its part to each side, a row looked up twice stays two
        slices (so an optimizer squaring each slice sees what it would see on
        the whole variable).

        Example:

        >>> layout = ShardLayout((3, 2), num_shards=2)   # shards of 3 elements
        >>> rows = tf.IndexedSlices(tf.constant([[1., 2.], [3., 4.]]),
        ...                         tf.constant([1, 1]), tf.constant([3, 2]))
        >>> part = layout.shard(rows, 1)
        >>> part.values.numpy(), part.indices.numpy()
        (array([2., 4.], dtype=float32), array([0, 0]))
        """
        if isinstance(value, tf.IndexedSlices):
            return self._shard_slices(value, index)
        return self.rows(value)[index]

    def _shard_slices(self, slices, index):
        row_size = self.shape[1:].num_elements()  # elements per slice
        start = tf.cast(index, tf.int64) * self.shard_size
        first = tf.cast(slices.indices, tf.int64) * row_size  # each slice's first element
        near = tf.logical_and(first < start + self.shard_size, first + row_size > start)
        values = tf.reshape(tf.boolean_mask(slices.values, near), [-1])
        positions = tf.reshape(
            tf.boolean_mask(first, near)[:, tf.newaxis]
            + tf.range(row_size, dtype=tf.int64)[tf.newaxis, :], [-1]) - start
        inside = tf.logical_and(positions >= 0, positions < self.shard_size)
        return tf.IndexedSlices(tf.boolean_mask(values, inside),
                                tf.boolean_mask(positions, inside),
                                tf.constant([self.shard_size], tf.int64))

    def rows_piece(self, rows, start, index):
        """The elements of shard `index` in `rows`, rows `start` on of the
        full value, flat.

        Example:

        >>> layout = ShardLayout((3, 2), num_shards=2)   # shards of 3 elements
        >>> layout.rows_piece(tf.constant([[2, 3], [4, 5]]), 1, 1).numpy()
        array([3, 4, 5], dtype=int32)
        """
        first, size = self._elements(start, rows.shape[0])
        low, high = self._in_shard(first, size, index)
        return tf.reshape(rows, [-1])[low - first:high - first]

    def shard_in_rows(self, shard, start, count, index):
        """Shard `index`'s elements among rows `start` to `start + count` of
        the full value, in their places there and zeros elsewhere, flat: the
        sum over every shard is those rows (`rows_piece`'s inverse).

        Example:

        >>> layout = ShardLayout((3, 2), num_shards=2)   # shards of 3 elements
        >>> layout.shard_in_rows(tf.constant([3, 4, 5]), 1, 2, 1).numpy()
        array([0, 3, 4, 5], dtype=int32)
        """
        first, size = self._elements(start, count)
        low, high = self._in_shard(first, size, index)
        if low == high:
            return tf.zeros([size], shard.dtype)
        begin = index * self.shard_size
        return tf.pad(shard[low - begin:high - begin], [[low - first, first + size - high]])

    def _elements(self, start, count):
        """The first flat element of row `start` and the elements of `count` rows."""
        row = self.shape[1:].num_elements()
        return start * row, count * row

    def _in_shard(self, first, size, index):
        """The flat elements `[low, high)` both in `[first, first + size)` and in shard `index`."""
        return _overlap(first, first + size, index * self.shard_size,
                        (index + 1) * self.shard_size)

    def unshard(self, rows):
        """The full value from all shards (`(num_shards, shard_size)` or flat)."""
        flat = tf.reshape(rows, [-1])
        if self.padding:
            flat = flat[: self.size]
        return tf.reshape(flat, self.shape)


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
        """The slice of `value` that replica `index` holds (rank `index % parts`);
        only that slice is made (`tf.split` would make every rank's: along a
        later axis each is a copy, together the whole value again)."""
        begin = [0] * len(self.shard_shape)
        begin[self.axis] = index % self.parts * self.shard_shape[self.axis]
        return tf.slice(value, begin, self.shard_shape)

    def unshard(self, shards):
        """The full value from every replica's shard, stacked in replica order."""
        return tf.concat([shards[rank] for rank in range(self.parts)], axis=self.axis)

    def rows_of_slice(self, rows, start, index):
        """Replica `index`'s slice of `rows` (rows `start` on of the full
        value), and the row of its slice the first of them is.

        Example:

        >>> layout = AxisLayout((4, 2), axis=0, parts=2)   # rank 1: rows 2 and 3
        >>> rows, first = layout.rows_of_slice(tf.constant([[2, 3], [4, 5]]), 1, 1)
        >>> rows.numpy().tolist(), first
        ([[4, 5]], 0)
        """
        rank = index % self.parts
        if self.axis:
            begin, size = [0] * len(self.shard_shape), [-1] * len(self.shard_shape)
            begin[self.axis] = rank * self.shard_shape[self.axis]
            size[self.axis] = self.shard_shape[self.axis]
            return tf.slice(rows, begin, size), start
        first = rank * self.shard_shape[0]
        low, high = _overlap(start, start + rows.shape[0], first, first + self.shard_shape[0])
        return rows[low - start:high - start], low - first

    def rows_piece(self, rows, start, index):
        """Replica `index`'s slice of `rows`, flat (`rows_of_slice`).

        Example:

        >>> layout = AxisLayout((4, 6), axis=1, parts=2)
        >>> layout.rows_piece(tf.reshape(tf.range(12), (2, 6)), 0, 1).numpy()
        array([ 3,  4,  5,  9, 10, 11], dtype=int32)
        """
        return tf.reshape(self.rows_of_slice(rows, start, index)[0], [-1])


class MeshShardLayout:
    """ZeRO's element shards of a weight on a data x tensor mesh.

    Each tensor rank's part of the weight (its slice when the weight is split,
    `split` its `AxisLayout`; the whole weight when it is
    replicated) is split element by element (`ShardLayout`) across the `data`
    replicas of that rank's data group: replica r holds element shard
    `r // tensor` of rank `r % tensor`'s part. With tensor=1 this is `ShardLayout` over the
    replicas. `ShardedStorage` uses it for optimizer state under `zero`.

    Example:

    >>> split = AxisLayout((4, 6), axis=1, parts=2)
    >>> layout = MeshShardLayout((4, 6), tensor=2, data=2, split=split)
    >>> layout.shard_shape       # rank 1's (4, 3) slice, half of its 12 elements
    [6]
    >>> full = tf.reshape(tf.range(24), (4, 6))
    >>> layout.shard(full, 3).numpy()  # replica 3: rank 1, second data shard
    array([15, 16, 17, 21, 22, 23], dtype=int32)
    """

    def __init__(self, shape, tensor: int, data: int, split=None):
        self.shape = tf.TensorShape(shape)
        self.tensor = tensor
        self.split = split
        part = self.shape if split is None else split.shard_shape
        self.part = ShardLayout(part, data)
        self.shard_shape = self.part.shard_shape

    def shard(self, value, index):
        """The element shard that replica `index` (an int) holds."""
        part = value if self.split is None else self.split.shard(value, index)
        return self.part.shard(part, index // self.tensor)

    def rows_piece(self, rows, start, index):
        """The elements of replica `index`'s shard in `rows`, rows `start` on
        of the full value, flat.

        Example:

        >>> layout = MeshShardLayout((4, 6), tensor=2, data=2,
        ...                          split=AxisLayout((4, 6), axis=1, parts=2))
        >>> layout.rows_piece(tf.reshape(tf.range(12, 24), (2, 6)), 2, 3).numpy()
        array([15, 16, 17, 21, 22, 23], dtype=int32)
        """
        if self.split is not None:
            rows, start = self.split.rows_of_slice(rows, start, index)
        return self.part.rows_piece(rows, start, index // self.tensor)

    def unshard(self, shards):
        """The full value from every replica's shard, stacked in replica order."""
        parts = [self.part.unshard(shards[rank::self.tensor]) for rank in range(self.tensor)]
        return parts[0] if self.split is None else self.split.unshard(parts)

    def __eq__(self, other):
        """Equal layouts put the same elements on each replica."""
        return isinstance(other, MeshShardLayout) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def _key(self):
        split = None if self.split is None else (self.split.axis, self.split.parts)
        return tuple(self.shape.as_list()), self.tensor, self.part.num_shards, split


def _overlap(begin, end, other_begin, other_end):
    """`[begin, end)` within `[other_begin, other_end)`, as `(low, high)`
    inside `[begin, end]` (`low == high` when they do not meet).

    >>> _overlap(4, 8, 6, 10), _overlap(4, 8, 9, 10)
    ((6, 8), (8, 8))
    """
    low = min(max(begin, other_begin), end)
    return low, max(low, min(end, other_end))
