"""Gradient compression: the step's gradient collective in fewer bytes.

`ParallelConfig(compression=...)` chooses what the gradients cross devices
as. "bf16" and "fp16" cast each floating gradient to that dtype before the
reduce part's collective (the data-parallel all-reduce, the data group's
under `tensor`, ZeRO 1/2's reduce-scatter, a sparse gradient's gathered
slices) and the reduced result back to the gradient's dtype after it, as
Horovod's fp16 compression and PyTorch DDP's fp16/bf16 communication hooks
do: half the bytes on the wire per step. The sum is computed in the
compressed dtype: bfloat16 keeps float32's range with 8 bits of mantissa,
float16 keeps 11 bits but overflows above 65,504 (under loss scaling an
overflow is a non-finite gradient, and the step is skipped as any other).
The metric states summed with the gradients stay in their own dtype (a
collective of their own).

Example:

```python
strategy = tfdist.Strategy(data=4, compression="bf16")
```
"""

import tensorflow as tf

from tfdist import sparse_gradients

# The dtype each cast compression sends.
CAST_DTYPES = {"bf16": tf.bfloat16, "fp16": tf.float16}


class CastCompression:
    """A reduce part whose floating gradients cross devices as `dtype`.

    Args:
        inner: the reduce part it wraps (`AllReduce`, `DataGroupAllReduce`,
            `ShardedReduce`): what it returns for each gradient is cast back
            to that gradient's dtype.
        dtype: the dtype sent, narrower than the gradients'.
        sparse: also the slices of sparse gradients (gathered, not summed:
            bfloat16 values travel as pairs packed in float32, bit for bit,
            TensorFlow's gather having no bfloat16 kernel on CPU). False for
            a part that hands them to an inner whole reduce compressing them
            itself (ZeRO's `ShardedReduce`, which keeps each replica's rows).

    Example:

    ```python
    reduce = CastCompression(AllReduce(), tf.bfloat16)
    reduced = reduce(grads)   # in replica context: float32 again
    ```
    """

    def __init__(self, inner, dtype, sparse=True):
        self.inner = inner
        self.dtype = tf.as_dtype(dtype)
        self.sparse = sparse

    def __call__(self, grads):
        return self.with_states(grads, [])[0]

    def with_states(self, grads, states):
        """The inner part's `with_states` on the cast gradients; `states`
        are summed as they are."""
        with tf.name_scope("compress"):
            sent = [self._narrow(g) for g in grads]
        reduced, states = self.inner.with_states(sent, states)
        with tf.name_scope("decompress"):
            return [self._widen(r, g) for r, g in zip(reduced, grads)], states

    def _narrow(self, grad):
        if grad is None or not sparse_gradients.values(grad).dtype.is_floating:
            return grad
        if not sparse_gradients.is_sparse(grad):
            return tf.cast(grad, self.dtype)
        if not self.sparse:
            return grad
        values = tf.cast(grad.values, self.dtype)
        if self.dtype == tf.bfloat16:
            values = _packed(values)
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)

    def _widen(self, reduced, grad):
        """`reduced` (the inner part's result for `grad`) in `grad`'s dtype."""
        if reduced is None or not sparse_gradients.values(grad).dtype.is_floating:
            return reduced
        if self.sparse and self.dtype == tf.bfloat16 and sparse_gradients.is_sparse(grad):
            reduced = tf.IndexedSlices(_unpacked(reduced.values, grad.values.shape[-1]),
                                       reduced.indices, reduced.dense_shape)
        return sparse_gradients.map_values(
            reduced, lambda v: tf.cast(v, sparse_gradients.values(grad).dtype))


def _packed(values):
    """bfloat16 `values` [..., d] as float32 [..., ceil(d / 2)]: each pair's
    bits (gathered as they are: a gather copies, it never computes).

    Example:

    >>> v = tf.constant([[1.0, -2.0, 3.5]], tf.bfloat16)
    >>> _unpacked(_packed(v), 3).numpy().tolist()
    [[1.0, -2.0, 3.5]]
    """
    if values.shape[-1] % 2:
        values = tf.pad(values, [[0, 0]] * (values.shape.rank - 1) + [[0, 1]])
    pairs = tf.reshape(values, tf.concat([tf.shape(values)[:-1], [-1, 2]], 0))
    return tf.bitcast(pairs, tf.float32)


def _unpacked(packed, width):
    """The bfloat16 values `_packed` made, `width` of them per row."""
    halves = tf.bitcast(packed, tf.bfloat16)
    flat = tf.reshape(halves, tf.concat([tf.shape(halves)[:-2], [-1]], 0))
    return flat[..., :width]
