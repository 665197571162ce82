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

"int8" quantises each block of 256 elements to int8 with its own scale
(`Int8Compression`): about a quarter of the bytes. "topk:<fraction>"
sparsifies (`TopKCompression`): each replica adds its error-feedback residual
to each gradient, sends only the largest `fraction` of its elements (values
and their indices: 2 x fraction of the bytes), and keeps the rest as its next
residual, so that nothing is dropped, only delayed (Stich et al. 2018,
"Sparsified SGD with memory"; Lin et al. 2018, "Deep Gradient
Compression"). "powersgd:<rank>" sends each matrix gradient as two
rank-`rank` factors (`PowerSGDCompression`, Vogels et al. 2019), with error
feedback and a warm-started power iteration. Their state (residuals, Q's) is
the step's `ReplicaState`, saved by `tfdist.checkpoint.ShardedCheckpoint`.

Example:

```python
strategy = tfdist.Strategy(data=4, compression="bf16")
strategy = tfdist.Strategy(data=4, compression="int8")
strategy = tfdist.Strategy(data=4, compression="topk:0.01")
strategy = tfdist.Strategy(data=4, compression="powersgd:4")
```
"""

import math

import tensorflow as tf

from tfdist import sparse_gradients
from tfdist.engine.reduce import data_group_sum
from tfdist.sharding.collectives import all_gather
from tfdist.sharding.replica_state import ReplicaState
from tfdist.sharding.wire import Int8Wire, packed_bfloat16, summed_rows, unpacked_bfloat16

# The dtype each cast compression sends.
CAST_DTYPES = {"bf16": tf.bfloat16, "fp16": tf.float16}


class CastCompression:
    """A reduce part whose floating gradients cross devices as `dtype`,
    the slices of sparse ones too (gathered, not summed: bfloat16 values
    travel as pairs packed in float32, bit for bit, TensorFlow's gather
    having no bfloat16 kernel on CPU).

    Args:
        inner: the reduce part it wraps (`AllReduce`, `DataGroupAllReduce`):
            what it returns for each gradient is cast back to that
            gradient's dtype.
        dtype: the dtype sent, narrower than the gradients'.

    Example:

    ```python
    reduce = CastCompression(AllReduce(), tf.bfloat16)
    reduced = reduce(grads)   # in replica context: float32 again
    ```
    """

    def __init__(self, inner, dtype):
        self.inner = inner
        self.dtype = tf.as_dtype(dtype)

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
        values = tf.cast(grad.values, self.dtype)
        if self.dtype == tf.bfloat16:
            values = packed_bfloat16(values)
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)

    def _widen(self, reduced, grad):
        """`reduced` (the inner part's result for `grad`) in `grad`'s dtype."""
        if reduced is None or not sparse_gradients.values(grad).dtype.is_floating:
            return reduced
        if self.dtype == tf.bfloat16 and sparse_gradients.is_sparse(grad):
            reduced = tf.IndexedSlices(
                unpacked_bfloat16(reduced.values, grad.values.shape[-1]),
                reduced.indices, reduced.dense_shape)
        return sparse_gradients.map_values(
            reduced, lambda v: tf.cast(v, sparse_gradients.values(grad).dtype))


class GatheredCompression:
    """The base of the reduce parts whose gradients cross devices in a form
    no collective can sum on the way (each replica's Top-K picks its own
    elements, each int8 block has its own scale): every replica all-gathers
    what every other sent, and sums it itself.

    Every floating gradient (an Embedding's slices made dense) is flattened;
    `encode` turns this replica's flat gradients into a few 1-D tensors of
    the same shapes on every replica (one all-gather each, whatever the
    number of gradients), and `decode` turns the gathered ones (N rows, one
    per replica of the data group) into the flat dense sum of every
    gradient, concatenated (`Int8Compression`, which also keeps slices as
    slices, gives its own `_gathered_sum` instead). The metric states, and
    gradients that are not floating, are summed by `inner`.

    Args:
        inner: the reduce part it stands for (`AllReduce`).
        mesh: the strategy's `replica_mesh` (the gathers are over its data group).

    Example:

    ```python
    reduce = Int8Compression(AllReduce(), strategy.replica_mesh)
    reduce.init(state_of(model), model.trainable_weights)
    reduced = reduce(grads)   # in replica context: summed
    ```
    """

    name = "gathered"

    def __init__(self, inner, mesh):
        self.inner = inner
        self.mesh = mesh
        self.shapes = None

    def init(self, state: ReplicaState, weights):
        """Takes the gradients' shapes (aligned with `weights`, the model's
        trainable ones); a subclass also makes the state it keeps in `state`."""
        self.shapes = [tf.TensorShape(w.shape) for w in weights]

    def __call__(self, grads):
        return self.with_states(grads, [])[0]

    def with_states(self, grads, states):
        """(the summed `grads`, aligned with the model's trainable weights;
        `states` summed by the inner part)."""
        if self.shapes is None:
            raise RuntimeError(f"Call `{type(self).__name__}.init` before the step.")
        sent = [k for k, g in enumerate(grads)
                if g is not None and sparse_gradients.values(g).dtype.is_floating]
        return _compressed(grads, states, sent, self._gathered_sum, self.inner, self.name)

    def _gathered_sum(self, grads, positions):
        """The dense sums of `grads` (at `positions`) over the data group."""
        shapes = [self.shapes[k] for k in positions]
        sizes = [shape.num_elements() for shape in shapes]
        # (an Embedding's slices made dense have no static shape)
        flats = [tf.reshape(tf.convert_to_tensor(g), [size]) for g, size in zip(grads, sizes)]
        launcher = self.mesh.data_launcher()
        gathered = [all_gather(t, launcher) for t in self.encode(flats, positions)]
        dense = self.decode(gathered, sizes, positions)
        return [tf.cast(tf.reshape(part, shape), sparse_gradients.values(g).dtype)
                for part, shape, g in zip(tf.split(dense, sizes), shapes, grads)]

    def _residuals(self, state: ReplicaState, weights, prefix: str) -> list:
        """A zero residual in `state` per floating weight of `weights`
        (`prefix/<position>`), None for the others."""
        return [state.add(f"{prefix}/{i}", w.shape, w.dtype)
                if tf.as_dtype(w.dtype).is_floating else None for i, w in enumerate(weights)]

    def encode(self, flats, positions) -> list:
        """What this replica sends of its flat gradients `flats` (at
        `positions` among the model's trainable weights): 1-D tensors."""
        raise NotImplementedError

    def decode(self, gathered, sizes, positions):
        """The flat float32 sum of what every replica sent (`gathered`: each
        sent tensor's (N, m) rows): the gradients at `positions`, of `sizes`
        elements, concatenated."""
        raise NotImplementedError


class TopKCompression(GatheredCompression):
    """A reduce part whose gradients cross devices as each replica's Top-K
    elements, the rest kept as its error-feedback residual.

    Every floating gradient plus the replica's residual for it is flattened;
    its `ceil(fraction * size)` elements of largest magnitude are sent, the
    others become the new residual. All the gradients' values go in one
    all-gather (float32) and their indices (into the concatenation of the
    gradients, int32) in another; each replica sums what every replica sent
    into the dense reduced gradients (`GatheredCompression`).

    Args:
        inner: the reduce part it stands for (`AllReduce`).
        fraction: the share of each gradient's elements sent, in (0, 1).
        mesh: the strategy's `replica_mesh`.
        error_feedback: keep what was not sent as a residual (without it,
            it is dropped).

    Example:

    ```python
    reduce = TopKCompression(AllReduce(), 0.01, strategy.replica_mesh)
    reduce.init(state_of(model), model.trainable_weights)   # the residuals
    reduced = reduce(grads)   # in replica context: dense, summed
    ```
    """

    name = "topk"

    def __init__(self, inner, fraction: float, mesh, error_feedback: bool = True):
        super().__init__(inner, mesh)
        self.fraction = fraction
        self.error_feedback = error_feedback
        self.residuals = None

    def init(self, state: ReplicaState, weights):
        """Also creates a zero residual per floating weight in `state`; none
        without error feedback."""
        super().init(state, weights)
        self.residuals = (self._residuals(state, weights, "topk_residual")
                          if self.error_feedback else [None] * len(weights))

    def encode(self, flats, positions):
        """[values (float32), indices into the concatenated gradients]."""
        index_dtype = tf.int32 if sum(f.shape[0] for f in flats) < 2 ** 31 else tf.int64
        values, indices, offset = [], [], 0
        for flat, k in zip(flats, positions):
            residual = self.residuals[k]
            if residual is not None:
                flat += tf.reshape(ReplicaState.own(residual), [-1])
            size = flat.shape[0]
            _, top = tf.math.top_k(tf.abs(flat), max(1, math.ceil(self.fraction * size)),
                                   sorted=False)
            chosen = tf.gather(flat, top)
            if residual is not None:
                ReplicaState.assign_own(residual, tf.tensor_scatter_nd_update(
                    flat, top[:, tf.newaxis], tf.zeros_like(chosen)))
            values.append(tf.cast(chosen, tf.float32))
            indices.append(tf.cast(top, index_dtype) + offset)
            offset += size
        return [tf.concat(values, 0), tf.concat(indices, 0)]

    def decode(self, gathered, sizes, positions):
        values, indices = gathered
        return tf.scatter_nd(tf.reshape(indices, [-1, 1]), tf.reshape(values, [-1]),
                             tf.constant([sum(sizes)], indices.dtype))


class Int8Compression(GatheredCompression):
    """A reduce part whose gradients cross devices as int8, each block of
    `block` elements scaled by its largest magnitude (blockwise absmax
    quantisation, as ZeRO++'s qgZ): a quarter of the bytes, plus one float32
    scale per block.

    The replica's floating gradients are concatenated in float32 and cut into
    blocks; each element is rounded to the nearest of 255 levels of its
    block's scale, `max |x| / 127` (error at most half a level). The int8
    values travel packed four to an int32 (TensorFlow's gather has no int8
    kernel), the scales in float32; each replica sums every replica's
    dequantised blocks in float32. An Embedding's gradient of fewer rows than
    its table stays slices: its rows' values are quantised with the rest and
    their indices gathered beside them (one more all-gather, int32), so a
    step sends the rows it looked up, not the table.

    Args:
        inner: the reduce part it stands for (`AllReduce`).
        mesh: the strategy's `replica_mesh`.
        block: elements per scale (a multiple of 4).

    Example:

    ```python
    reduce = Int8Compression(AllReduce(), strategy.replica_mesh)
    reduce.init(state_of(model), model.trainable_weights)
    reduced = reduce(grads)   # in replica context
    ```
    """

    name = "int8"

    def __init__(self, inner, mesh, block: int = 256):
        super().__init__(inner, mesh)
        self.wire = Int8Wire(block)

    def _gathered_sum(self, grads, positions):
        """The dense sums of `grads` (at `positions`) over the data group;
        of slices that `_sends_rows`, every replica's rows."""
        shapes = [self.shapes[k] for k in positions]
        sliced = [_sends_rows(g, shape) for g, shape in zip(grads, shapes)]
        sizes = [g.indices.shape[0] * shape[1:].num_elements() if rows else shape.num_elements()
                 for g, rows, shape in zip(grads, sliced, shapes)]
        flats = [tf.reshape(g.values if rows else tf.convert_to_tensor(g), [size])
                 for g, rows, size in zip(grads, sliced, sizes)]
        sent = self.wire.encode(tf.concat([tf.cast(f, tf.float32) for f in flats], 0))
        indices = [g.indices for g, rows in zip(grads, sliced) if rows]
        if indices:
            sent.append(tf.concat([tf.cast(i, tf.int32) for i in indices], 0))
        launcher = self.mesh.data_launcher()
        gathered = [all_gather(t, launcher) for t in sent]
        rows_of = iter(tf.split(gathered[2], [i.shape[0] for i in indices], axis=1)
                       if indices else [])
        kept = [[] for _ in sizes]  # each slices' values, replica by replica

        def replica(r):  # its every element decoded; the dense parts summed
            parts = tf.split(self.wire.decode([t[r] for t in gathered[:2]], sum(sizes),
                                              tf.float32), sizes)
            for part, rows, values in zip(parts, sliced, kept):
                if rows:
                    values.append(part)
            return [part for part, rows in zip(parts, sliced) if not rows]

        dense = iter(summed_rows(self.mesh.data, replica))
        out = []
        for g, rows, shape, values in zip(grads, sliced, shapes, kept):
            dtype = sparse_gradients.values(g).dtype
            if rows:
                out.append(tf.IndexedSlices(
                    tf.cast(tf.reshape(tf.concat(values, 0), [-1, *shape[1:]]), dtype),
                    tf.reshape(next(rows_of), [-1]), g.dense_shape))
            else:
                out.append(tf.cast(tf.reshape(next(dense), shape), dtype))
        return out


class PowerSGDCompression:
    """A reduce part whose matrix gradients cross devices as rank-`rank`
    factors (PowerSGD: Vogels et al. 2019), with error feedback and warm start.

    Each floating gradient of rank >= 2, seen as a matrix M (n x m, its
    leading axes by its trailing ones: `matrix_view`), plus the replica's
    residual: P = M Q is all-reduced
    (Q, m x rank, the same on every replica), orthonormalised (QR), then
    Q = M^T P all-reduced, and P Q^T is the summed gradient's rank-`rank`
    approximation. Each replica keeps M minus its share of it (1/N of the
    sum) as its next residual, and Q as the next step's start (one power
    iteration per step, warm-started). The P's of every matrix go in one
    packed all-reduce, their Q's in a second; gradients of rank <= 1 (biases,
    norms), matrices that would not shrink (rank x (n + m) >= n x m) and an
    Embedding's slices (a low-rank view of a table of which a step touches a
    few rows loses most of them) are summed by `inner` as they are, with the
    metric states.

    Args:
        inner: the reduce part it stands for (`AllReduce`).
        rank: the factors' rank (>= 1).
        mesh: the strategy's `replica_mesh` (N: its data group's size).

    Example:

    ```python
    reduce = PowerSGDCompression(AllReduce(), 4, strategy.replica_mesh)
    reduce.init(state_of(model), model.trainable_weights)   # residuals, Q's
    reduced = reduce(grads)   # in replica context
    ```
    """

    name = "powersgd"

    def __init__(self, inner, rank: int, mesh):
        self.inner = inner
        self.rank = rank
        self.mesh = mesh
        self.factors = None  # position -> (residual, Q) of each compressed matrix

    def init(self, state: ReplicaState, weights):
        """Creates each compressed matrix's zero residual and its first Q
        (normal, seeded by its position: the same on every replica)."""
        self.factors = {}
        for i, w in enumerate(weights):
            shape = tf.TensorShape(w.shape)
            if shape.rank < 2 or not tf.as_dtype(w.dtype).is_floating:
                continue
            n, m = matrix_view(shape)
            if self.rank * (n + m) >= n * m:
                continue
            self.factors[i] = (
                state.add(f"powersgd_residual/{i}", shape, w.dtype),
                state.add(f"powersgd_q/{i}", (m, self.rank), "float32",
                          initial=tf.random.stateless_normal((m, self.rank), seed=[0, i])))

    def __call__(self, grads):
        return self.with_states(grads, [])[0]

    def with_states(self, grads, states):
        """(the summed `grads`, matrices as their rank-`rank` approximation;
        `states` summed by the inner part with the other gradients)."""
        if self.factors is None:
            raise RuntimeError("Call `PowerSGDCompression.init` before the step.")
        matrices = [k for k, g in enumerate(grads) if g is not None and k in self.factors
                    and not sparse_gradients.is_sparse(g)]
        return _compressed(grads, states, matrices, self._approximations, self.inner,
                           self.name)

    def _approximations(self, grads, positions):
        """The summed gradients' low-rank approximations (dense, each its
        gradient's shape and dtype) of `grads` (at `positions`); updates the
        residuals and Q's."""
        factors = [self.factors[k] for k in positions]
        launcher = self.mesh.data_launcher()  # (no merge call: it also runs in a cond)
        summed = lambda tensors: data_group_sum(tensors, launcher)  # noqa: E731
        ms, qs = [], []
        for grad, (residual, q) in zip(grads, factors):
            shape = residual.layout.shape[1:]
            matrix = tf.reshape(grad, shape) + ReplicaState.own(residual)
            ms.append(tf.reshape(tf.cast(matrix, tf.float32), [-1, q.layout.shape[1]]))  # (n, m)
            qs.append(ReplicaState.own(q))
        ps = [tf.linalg.qr(p).q for p in summed([tf.matmul(m, q) for m, q in zip(ms, qs)])]
        qs = summed([tf.matmul(m, p, transpose_a=True) for m, p in zip(ms, ps)])
        replicas = tf.cast(self.mesh.data, tf.float32)
        approximations = []
        for grad, (residual, q), matrix, p, new_q in zip(grads, factors, ms, ps, qs):
            approx = tf.matmul(p, new_q, transpose_b=True)
            ReplicaState.assign_own(residual, tf.cast(
                tf.reshape(matrix - approx / replicas, residual.layout.shape[1:]),
                residual.dtype))
            ReplicaState.assign_own(q, new_q)
            approximations.append(tf.cast(tf.reshape(approx, residual.layout.shape[1:]),
                                          sparse_gradients.values(grad).dtype))
        return approximations


def matrix_view(shape):
    """(n, m): the matrix a gradient of `shape` is seen as, its leading axes
    by its trailing ones, cut where the two sides are closest in size: a
    convolution's kernel (3, 3, 32, 64) is 288 x 64 (positions and input
    channels by output channels), an attention projection's (64, 4, 16)
    is 64 x 64 (input by heads and their width).

    Example:

    >>> matrix_view(tf.TensorShape([3, 3, 32, 64])), matrix_view(tf.TensorShape([64, 4, 16]))
    ((288, 64), (64, 64))
    """
    dims = shape.as_list()
    cuts = [(math.prod(dims[:i]), math.prod(dims[i:])) for i in range(1, len(dims))]
    return max(cuts, key=lambda nm: min(nm) / max(nm))


class WarmUp:
    """A reduce part that sums the gradients whole while `warming_up()`
    holds, and hands them to `compressed` after: compressing from the first
    step, while the gradients change fastest, costs the most (PyTorch's
    `start_powerSGD_iter`, Deep Gradient Compression's warm-up, 1-bit
    Adam's). Both phases are branches of one `tf.cond`; a sparse gradient
    (an Embedding's) comes out of both as slices, as the optimizer has it
    uncompressed (Keras's Adam squares the slices one by one). The metric
    states are summed before it, by `compressed.inner`, in a collective of
    their own.

    Args:
        compressed: the compressing reduce part (`TopKCompression`,
            `PowerSGDCompression`, `OneBitReduce`), its `init` called.
        warming_up: returns whether the coming step is a warm-up one (a
            boolean tensor), such as `lambda: optimizer.iterations < 100`.
        mesh: the strategy's `replica_mesh` (the sums are over its data group).

    Example:

    ```python
    reduce = WarmUp(TopKCompression(AllReduce(), 0.01, mesh),
                    lambda: model.optimizer.iterations < 100, mesh)
    ```
    """

    def __init__(self, compressed, warming_up, mesh):
        self.compressed = compressed
        self.warming_up = warming_up
        self.mesh = mesh

    def __call__(self, grads):
        return self.with_states(grads, [])[0]

    def with_states(self, grads, states):
        """(the summed `grads`, an Embedding's as slices; `states` summed)."""
        _, states = self.compressed.inner.with_states([], states)
        present = [k for k, g in enumerate(grads) if g is not None]
        launcher = self.mesh.data_launcher()  # (a merge call cannot run in a cond)

        def whole():
            return data_group_sum([grads[k] for k in present], launcher)

        def compressed():
            reduced, _ = self.compressed.with_states(grads, [])
            return [_as_slices_of(reduced[k], grads[k]) for k in present]

        out = [None] * len(grads)
        for k, g in zip(present, tf.cond(self.warming_up(), whole, compressed)):
            out[k] = g
        return out, states


def _as_slices_of(reduced, grad):
    """`reduced`, if dense where `grad` is slices, as slices of every row
    (both branches of a `tf.cond` give one structure); else as it is."""
    if sparse_gradients.is_sparse(reduced) or not sparse_gradients.is_sparse(grad):
        return reduced
    rows = tf.range(tf.shape(reduced, out_type=grad.indices.dtype)[0])
    return tf.IndexedSlices(reduced, rows, tf.cast(tf.shape(reduced), grad.dense_shape.dtype))


def _compressed(grads, states, chosen, compress, inner, name):
    """(`grads` with those at positions `chosen` replaced by what
    `compress(those, chosen)` gives, in name scope `name`, the other present
    ones reduced by `inner`; `states` summed by `inner`)."""
    out = list(grads)
    if chosen:
        with tf.name_scope(name):
            for k, g in zip(chosen, compress([grads[k] for k in chosen], chosen)):
                out[k] = g
    others = [k for k, g in enumerate(grads) if g is not None and k not in chosen]
    reduced, states = inner.with_states([grads[k] for k in others], states)
    for k, g in zip(others, reduced):
        out[k] = g
    return out, states


def _sends_rows(grad, shape) -> bool:
    """Whether `grad` (of a weight of `shape`) is slices of fewer rows than
    the weight whose number the trace knows (each replica's then have the
    same: all-gathered as they are)."""
    return (sparse_gradients.is_sparse(grad) and grad.indices.shape.is_fully_defined()
            and grad.indices.shape[0] < shape[0])
