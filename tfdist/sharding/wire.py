"""How values cross devices in ZeRO's collectives: as they are, cast to a
narrower dtype, or as int8 blocks.

`packed_reduce_scatter` and `packed_all_gather` (ZeRO's gradients and
parameters) take a wire: `encode` turns the rows a replica sends into the
tensors that travel, `decode` turns what arrived back into rows of values.
`CastWire` sends floating values as bfloat16 or float16; `Int8Wire` sends
each block of `block` elements as int8 with its own float32 scale (absmax /
127), four levels packed in an int32: ZeRO++'s quantised weight all-gather
(qwZ) and quantised gradient reduce-scatter (qgZ, whose all-to-all sends
each replica its rows quantised and each replica sums what it received in
float32).

Example:

```python
shards = packed_reduce_scatter(grads, layouts, launcher, wire=Int8Wire())
full = packed_all_gather(shards, layouts, launcher, wire=CastWire(tf.bfloat16))
```
"""

import tensorflow as tf


class Wire:
    """Values sent as they are (the default wire).

    Example:

    >>> Wire().decode(Wire().encode(tf.ones((2, 3))), 3, tf.float32).shape
    TensorShape([2, 3])
    """

    # Elements encoded together: rows cut into pieces of columns encode as
    # the whole rows would when each piece's width is a multiple of it.
    block = 1

    def encode(self, rows) -> list:
        """The tensors that carry `rows` (shape `(..., m)`), each with the
        same leading axes."""
        return [rows]

    def decode(self, parts, width: int, dtype):
        """The rows (`(..., width)`, `dtype`) carried by `parts`, which
        `encode` made (gathered or exchanged along the leading axes)."""
        return parts[0]


class CastWire(Wire):
    """Floating values sent as `dtype` (narrower), decoded to the values'
    dtype: sums of what arrived are taken there. bfloat16 travels as pairs
    packed in float32, bit for bit (TensorFlow's gather has no bfloat16
    kernel on CPU).

    Example:

    >>> wire = CastWire(tf.float16)
    >>> wire.encode(tf.ones((2,)))[0].dtype
    tf.float16
    >>> CastWire(tf.bfloat16).encode(tf.ones((4,)))[0].shape   # two pairs
    TensorShape([2])
    >>> half = tf.constant([1.5, -2.0], tf.float16)   # no narrower: as it is
    >>> CastWire(tf.bfloat16).decode(CastWire(tf.bfloat16).encode(half), 2,
    ...                              tf.float16).numpy().tolist()
    [1.5, -2.0]
    """

    def __init__(self, dtype):
        self.dtype = tf.as_dtype(dtype)

    def _narrows(self, dtype) -> bool:
        """Whether values of `dtype` are sent cast (floating and wider)."""
        return dtype.is_floating and dtype.size > self.dtype.size

    def encode(self, rows):
        if not self._narrows(rows.dtype):
            return [rows]
        sent = tf.cast(rows, self.dtype)
        return [packed_bfloat16(sent) if self.dtype == tf.bfloat16 else sent]

    def decode(self, parts, width, dtype):
        if not self._narrows(tf.as_dtype(dtype)):
            return parts[0]
        received = parts[0]
        if self.dtype == tf.bfloat16:
            received = unpacked_bfloat16(received, width)
        return tf.cast(received, dtype)


class Int8Wire(Wire):
    """Floating values sent as int8, each block of `block` elements scaled
    by its largest magnitude: about a quarter of float32's bytes.

    Args:
        block: elements per scale (a multiple of 4).

    Example:

    >>> wire = Int8Wire(block=4)
    >>> parts = wire.encode(tf.constant([[1.0, -0.5, 0.25, 0.0, 2.0]]))
    >>> [p.dtype.name for p in parts]
    ['int32', 'float32']
    >>> wire.decode(parts, 5, tf.float32).numpy().round(2).tolist()
    [[1.0, -0.5, 0.25, 0.0, 2.0]]
    """

    def __init__(self, block: int = 256):
        if block % 4:
            raise ValueError(f"`block` must be a multiple of 4, got {block}.")
        self.block = block

    def encode(self, rows):
        """[the int8 levels packed four to an int32, each block's float32 scale]."""
        if not rows.dtype.is_floating:
            return [rows]
        lead, width = rows.shape[:-1], rows.shape[-1]
        padded = tf.pad(tf.cast(rows, tf.float32),
                        [[0, 0]] * len(lead) + [[0, -width % self.block]])
        blocks = tf.reshape(padded, [*lead, -1, self.block])
        scales = tf.reduce_max(tf.abs(blocks), axis=-1) / 127.0
        safe = tf.where(scales > 0, scales, tf.ones_like(scales))
        levels = tf.cast(tf.round(blocks / safe[..., tf.newaxis]), tf.int8)
        packed = tf.bitcast(tf.reshape(levels, [*lead, -1, 4]), tf.int32)
        return [packed, scales]

    def decode(self, parts, width, dtype):
        if len(parts) == 1:
            return parts[0]
        packed, scales = parts  # (..., levels / 4), (..., blocks)
        levels = tf.cast(tf.bitcast(packed, tf.int8), tf.float32)  # (..., levels / 4, 4)
        lead = tf.shape(scales)[:-1]
        blocks = tf.reshape(levels, tf.concat([lead, [-1, self.block]], 0))
        values = tf.reshape(blocks * scales[..., tf.newaxis], tf.concat([lead, [-1]], 0))
        return tf.cast(values[..., :width], dtype)


def summed_rows(count: int, row):
    """`row(0) + ... + row(count - 1)` (tensors, or lists of tensors summed
    item by item), each row made only once the sum before it exists: what
    every replica sent, decoded and summed one replica at a time, holds two
    rows at once, not `count` (TensorFlow would otherwise decode them all
    at once).

    Example:

    >>> summed_rows(3, lambda r: tf.fill([2], float(r))).numpy().tolist()
    [3.0, 3.0]
    """
    total = row(0)
    for r in range(1, count):
        with tf.control_dependencies(tf.nest.flatten(total)):
            total = tf.nest.map_structure(tf.add, total, row(r))
    return total


def packed_bfloat16(values):
    """bfloat16 `values` [..., d] as float32 [..., ceil(d / 2)]: each pair's
    bits (gathered as they are: a gather copies, it never computes).

    Example:

    >>> v = tf.constant([[1.0, -2.0, 3.5]], tf.bfloat16)
    >>> unpacked_bfloat16(packed_bfloat16(v), 3).numpy().tolist()
    [[1.0, -2.0, 3.5]]
    """
    if values.shape[-1] % 2:
        values = tf.pad(values, [[0, 0]] * (values.shape.rank - 1) + [[0, 1]])
    pairs = tf.reshape(values, tf.concat([tf.shape(values)[:-1], [-1, 2]], 0))
    return tf.bitcast(pairs, tf.float32)


def unpacked_bfloat16(packed, width):
    """The bfloat16 values `packed_bfloat16` made, `width` of them per row."""
    halves = tf.bitcast(packed, tf.bfloat16)
    flat = tf.reshape(halves, tf.concat([tf.shape(halves)[:-2], [-1]], 0))
    return flat[..., :width]
