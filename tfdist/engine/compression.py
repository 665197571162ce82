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

"topk:<fraction>" sparsifies instead (`TopKCompression`): each replica adds
its error-feedback residual to each gradient, sends only the largest
`fraction` of its elements (values and their indices: 2 x fraction of the
bytes), and keeps the rest as its next residual, so that nothing is dropped,
only delayed (Stich et al. 2018, "Sparsified SGD with memory"; Lin et al.
2018, "Deep Gradient Compression"). The residuals are the step's
`ReplicaState`, saved by `tfdist.checkpoint.ShardedCheckpoint`.

Example:

```python
strategy = tfdist.Strategy(data=4, compression="bf16")
strategy = tfdist.Strategy(data=4, compression="topk:0.01")
```
"""

import math

import tensorflow as tf

from tfdist import sparse_gradients
from tfdist.sharding.collectives import all_gather
from tfdist.sharding.replica_state import ReplicaState

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


class TopKCompression:
    """A reduce part whose gradients cross devices as each replica's Top-K
    elements, the rest kept as its error-feedback residual.

    Every floating gradient (an Embedding's slices made dense) plus the
    replica's residual for it is flattened; its `ceil(fraction * size)`
    elements of largest magnitude are sent, the others become the new
    residual. All the gradients' values go in one all-gather and their
    indices (into the concatenation of the gradients) in another; each
    replica sums what every replica sent into the dense reduced gradients.
    The metric states are summed by `inner` (in their own collective).

    Args:
        inner: the reduce part it stands for (`AllReduce`): it sums the
            metric states and any gradient that is not floating.
        fraction: the share of each gradient's elements sent, in (0, 1).
        mesh: the strategy's `replica_mesh` (the gather is over its data group).

    Example:

    ```python
    reduce = TopKCompression(AllReduce(), 0.01, strategy.replica_mesh)
    reduce.init(state_of(model), model.trainable_weights)   # the residuals
    reduced = reduce(grads)   # in replica context: dense, summed
    ```
    """

    def __init__(self, inner, fraction: float, mesh, error_feedback: bool = True):
        self.inner = inner
        self.fraction = fraction
        self.mesh = mesh
        self.error_feedback = error_feedback
        self.shapes = self.residuals = None

    def init(self, state: ReplicaState, weights):
        """Creates a zero residual per floating weight (aligned with the
        gradients, `weights` being the model's trainable ones) in `state`;
        none without error feedback."""
        self.shapes = [tf.TensorShape(w.shape) for w in weights]
        self.residuals = [
            state.add(f"topk_residual/{i}", w.shape, w.dtype)
            if self.error_feedback and tf.as_dtype(w.dtype).is_floating else None
            for i, w in enumerate(weights)]

    def __call__(self, grads):
        return self.with_states(grads, [])[0]

    def with_states(self, grads, states):
        """(the summed `grads`, dense, from every replica's Top-K; `states`
        summed by the inner part)."""
        if self.residuals is None:
            raise RuntimeError("Call `TopKCompression.init` before the step: it "
                               "creates the residuals.")
        sent = [k for k, g in enumerate(grads)
                if g is not None and sparse_gradients.values(g).dtype.is_floating]
        others = [k for k, g in enumerate(grads) if g is not None and k not in sent]
        out = list(grads)
        if sent:
            with tf.name_scope("topk"):
                for k, reduced in zip(sent, self._sum_of_top_k(
                        [grads[k] for k in sent], [self.shapes[k] for k in sent],
                        [self.residuals[k] for k in sent])):
                    out[k] = reduced
        reduced, states = self.inner.with_states([grads[k] for k in others], states)
        for k, g in zip(others, reduced):
            out[k] = g
        return out, states

    def _sum_of_top_k(self, grads, shapes, residuals):
        """The dense sums over the data group of every replica's Top-K of
        `grads` (of `shapes`; plus `residuals`, which keep what was not sent)."""
        sizes = [shape.num_elements() for shape in shapes]
        index_dtype = tf.int32 if sum(sizes) < 2 ** 31 else tf.int64
        values, indices, offset = [], [], 0
        for grad, residual, size in zip(grads, residuals, sizes):
            flat = tf.reshape(tf.convert_to_tensor(grad), [-1])  # (slices made dense)
            if residual is not None:
                flat += tf.reshape(ReplicaState.own(residual), [-1])
            k = max(1, math.ceil(self.fraction * size))
            _, top = tf.math.top_k(tf.abs(flat), k, sorted=False)
            chosen = tf.gather(flat, top)
            if residual is not None:
                ReplicaState.assign_own(residual, tf.tensor_scatter_nd_update(
                    flat, top[:, tf.newaxis], tf.zeros_like(chosen)))
            values.append(tf.cast(chosen, tf.float32))
            indices.append(tf.cast(top, index_dtype) + offset)
            offset += size
        launcher = self.mesh.data_launcher()
        every_value = all_gather(tf.concat(values, 0), launcher)
        every_index = all_gather(tf.concat(indices, 0), launcher)
        dense = tf.scatter_nd(tf.reshape(every_index, [-1, 1]), tf.reshape(every_value, [-1]),
                              tf.constant([offset], index_dtype))
        return [tf.cast(tf.reshape(part, shape), sparse_gradients.values(grad).dtype)
                for part, shape, grad in zip(tf.split(dense, sizes), shapes, grads)]


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
