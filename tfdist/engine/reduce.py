"""Reduce parts: a replica's local gradients in, what its update needs out.

The second of a step's three parts (`TrainStep` = update(reduce(compute(batch)))).
Each is called in replica context with the replica's gradients (aligned with
`model.trainable_weights`, None where a weight has none) and crosses devices
once per step, whatever the number of microbatches:

- `AllReduce`: one packed all-reduce (sum) over every replica (or one per
  bucket of `bucket_bytes`); the full reduced gradients.
- `DataGroupAllReduce`: with tensor parallelism, one packed all-reduce over the
  replica's data group (the replicas holding the same shards); under loss
  scaling, a non-finite gradient on any rank of the tensor group is made
  non-finite on all of them, so every replica skips the same steps.
- `ShardedReduce`: ZeRO's: each replica gets only its element shard of every
  reduced gradient, by all-reduce then slicing (`zero=1`) or by
  reduce-scatter (`zero=2`), over every replica or the data group.
- `AlreadyReduced`: `zero=3`'s compute reduce-scatters each unit's gradients
  as soon as its backward makes them (`tfdist.optim.zero3`): nothing is left.

Each part's `with_states(grads, states)` also sums the replicas' metric states
over the global batch (`tfdist.engine.metrics`): in the gradients' own
all-reduce where the part has one (a step then crosses devices once, metrics
included), else in a collective of their own.

Sparse gradients (`tf.IndexedSlices`, an Embedding's) are never summed: their
slices are gathered, as `tf.distribute`'s own all-reduce does, so the
optimizer sees the global batch's slices (`tfdist.sparse_gradients`); under ZeRO
(either stage) each replica then keeps the parts of the slices inside its
shard.

Ops are named `tfdist/reduce/...`.
"""

import tensorflow as tf

from tfdist import sparse_gradients
from tfdist._compat import tf_collectives
from tfdist._compat.tf_distribute import summed_across_replicas
from tfdist._compat.tf_function import ReplicaSharedFunction, sharing_a_trace
from tfdist.sharding.collectives import non_finite_count, packed_reduce_scatter, replica_launcher


class AllReduce:
    """Sum of every replica's gradients: one packed all-reduce.

    Args:
        bucket_bytes: > 0: one packed all-reduce per bucket of consecutive
            gradients of at most this many bytes (`buckets`).

    Example:

    ```python
    reduced = AllReduce()(grads)   # in replica context
    ```
    """

    def __init__(self, bucket_bytes: int = 0):
        self.bucket_bytes = bucket_bytes

    def __call__(self, grads):
        return self.with_states(grads, [])[0]

    def with_states(self, grads, states):
        """(the reduced `grads`, `states` summed over every replica): one
        packed all-reduce when they share a dtype."""
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return grads, states
        if sharing_a_trace():  # (no merge call in a function: the launcher's collectives)
            launcher = replica_launcher()
            sum_ = lambda values: data_group_sum(values, launcher, self.bucket_bytes)  # noqa: E731
        else:
            sum_ = lambda values: strategy_sum(values, self.bucket_bytes)  # noqa: E731
        present, states = _summed_together(sum_, [g for g in grads if g is not None], states)
        reduced = iter(present)
        return [None if g is None else next(reduced) for g in grads], states


class DataGroupAllReduce:
    """The data-parallel reduction on a data x tensor mesh (None kept).

    Every replica of a tensor group differentiates its group's batch loss,
    scaled by Keras by 1/N (N replicas): summing over the d replicas of the
    data group gives 1/t of the gradient of the global batch, for a shard as
    for a replicated weight (identical on the t ranks), so the sum is
    multiplied by t. One packed collective per step.

    Args:
        mesh: the strategy's `TensorMesh`.
        share_non_finite: make the gradients non-finite on every rank of the
            tensor group if they are on any (under loss scaling, so that the
            optimizer skips the step everywhere).
        bucket_bytes: as `AllReduce`'s.

    Example:

    ```python
    reduced = DataGroupAllReduce(strategy.tensor_mesh)(grads)
    ```
    """

    def __init__(self, mesh, share_non_finite=False, bucket_bytes=0):
        self.mesh = mesh
        self.share_non_finite = share_non_finite
        self.bucket_bytes = bucket_bytes
        self._one_replica_per_group = mesh.data == 1  # (nothing to sum)
        # Traced once for every replica (each gives its groups' launchers).
        self._shared = ReplicaSharedFunction(self._with_states)

    def __call__(self, grads):
        return self.with_states(grads, [])[0]

    def with_states(self, grads, states):
        """(the reduced `grads`, `states` summed over the data group, which
        together holds every example once: a tensor group's ranks compute on
        the same examples)."""
        return self._shared(grads, states)

    def _with_states(self, grads, states):
        mesh = self.mesh
        present = [g for g in grads if g is not None]
        if not self._one_replica_per_group:
            launcher = mesh.data_launcher()
            present, states = _summed_together(
                lambda values: data_group_sum(values, launcher, self.bucket_bytes),
                present, states)
        present = [sparse_gradients.map_values(g, lambda v: v * tf.cast(mesh.tensor, v.dtype))
                   for g in present]
        if self.share_non_finite and present:
            # The ranks hold the gradients of different shards, so one may
            # overflow alone: add NaN to every rank's first dense gradient
            # (slices may be none) if any rank's are not finite.
            count = mesh.reduce(tf.reshape(
                non_finite_count([sparse_gradients.values(g) for g in present]), [1]))[0]
            poison = tf.where(count > 0, float("nan"), 0.0)
            k = next((k for k, g in enumerate(present) if not sparse_gradients.is_sparse(g)), 0)
            present[k] = sparse_gradients.map_values(
                present[k], lambda v: v + tf.cast(poison, v.dtype))
        reduced = iter(present)
        return [None if g is None else next(reduced) for g in grads], states


class AlreadyReduced:
    """The reduce part of `zero=3`, whose compute part already gives this
    replica's shard of every reduced gradient: they pass through.

    Args:
        whole: the reduce part that sums the metric states over the global
            batch (`AllReduce`, or with tensor groups `DataGroupAllReduce`).

    Example:

    >>> AlreadyReduced(AllReduce())([None])
    [None]
    """

    def __init__(self, whole):
        self._sum = whole

    def __call__(self, grads):
        return grads

    def with_states(self, grads, states):
        """(`grads`, `states` summed in a collective of their own)."""
        return grads, self._sum.with_states([], states)[1]


def _summed_together(sum_, present, states):
    """`sum_` of `present` and of `states`, in one call when their dense
    tensors share one dtype (a packed collective concatenates them), else in
    two: `(summed present, summed states)`."""
    if not states or not present:
        return (sum_(present) if present else []), (sum_(states) if states else [])
    dtypes = {t.dtype for t in present + states if not sparse_gradients.is_sparse(t)}
    if len(dtypes) > 1:
        return sum_(present), sum_(states)
    summed = list(sum_(present + states))
    return summed[:len(present)], summed[len(present):]


def buckets(tensors, bucket_bytes: int) -> list[list]:
    """`tensors` in consecutive buckets of at most `bucket_bytes` bytes (a
    larger tensor, or one of unknown size, a bucket of its own); all in one
    when `bucket_bytes` is 0.

    Example:

    >>> [len(b) for b in buckets([tf.zeros(64), tf.zeros(64), tf.zeros(512)], 512)]
    [2, 1]
    """
    if not bucket_bytes:
        return [list(tensors)] if tensors else []
    found, size = [], 0
    for tensor in tensors:
        elements = (None if sparse_gradients.is_sparse(tensor) else
                    tensor.shape.num_elements())
        nbytes = bucket_bytes + 1 if elements is None else elements * tensor.dtype.size
        if not found or size + nbytes > bucket_bytes:
            found.append([])
            size = 0
        found[-1].append(tensor)
        size += nbytes
    return found


def strategy_sum(grads, bucket_bytes=0):
    """The sum of `grads` over every replica, outside a trace the replicas
    share: dense ones by the strategy's packed all-reduce (a merge call), one
    per bucket of `bucket_bytes` if given (`buckets`); the slices of sparse
    ones gathered by the replica's own launcher (`all_gather_slices`).

    Example:

    ```python
    summed = strategy_sum(grads)   # in replica context
    ```
    """
    summed = []
    for bucket in buckets(grads, bucket_bytes):
        dense = [g for g in bucket if not sparse_gradients.is_sparse(g)]
        summed += _slices_gathered(bucket, summed_across_replicas(dense) if dense else [],
                                   replica_launcher)
    return summed


def data_group_sum(grads, launcher, bucket_bytes=0):
    """The sum of `grads` over a data group (`launcher`'s): dense ones in one
    packed all-reduce (one per bucket of `bucket_bytes` if given: `buckets`),
    the slices of sparse ones gathered (as `tf.distribute` does). No merge
    call: it also runs inside a `tf.cond`'s branch.

    Example:

    ```python
    summed = data_group_sum(grads, strategy.replica_mesh.data_launcher())
    ```
    """
    dense = [g for g in grads if not sparse_gradients.is_sparse(g)]
    summed = launcher.batch_all_reduce(buckets(dense, bucket_bytes)) if dense else []
    return _slices_gathered(grads, summed, lambda: launcher)


def _slices_gathered(grads, dense_sums, launcher):
    """`grads` reduced: each sparse one's slices gathered by `launcher()`
    (`all_gather_slices`), each dense one the next of `dense_sums`, in order."""
    dense_sums = iter(dense_sums)
    return [tf_collectives.all_gather_slices(launcher(), g) if sparse_gradients.is_sparse(g)
            else next(dense_sums) for g in grads]


class ShardedReduce:
    """ZeRO's reduction: this replica's shard of every reduced gradient.

    Args:
        layouts: each trainable weight's shard layout (aligned with
            `model.trainable_weights`): how a replica's part of the weight
            is cut into element shards over its data group.
        zero: 1 (all-reduce, then keep this replica's shard) or 2
            (reduce-scatter: no replica ever holds another's reduced shard).
        mesh: the strategy's `replica_mesh`: the reduction is over each data
            group (every replica without tensor groups).
        whole: the reduce part for what is reduced whole (every gradient
            under `zero=1`, sparse ones, the metric states): `AllReduce`, or
            with tensor groups `DataGroupAllReduce`.
        wire: how the reduce-scatter's gradients travel (a
            `tfdist.sharding.wire.Wire`; as they are if None).

    Example:

    ```python
    shards = ShardedReduce(update.layouts, 2, strategy.replica_mesh, AllReduce())(grads)
    ```
    """

    def __init__(self, layouts, zero: int, mesh, whole, wire=None):
        self.layouts = layouts
        self.zero = zero
        self.mesh = mesh
        self._full = whole
        self.wire = wire

    def __call__(self, grads):
        return self.with_states(grads, [])[0]

    def with_states(self, grads, states):
        """(this replica's shards of the reduced `grads`, `states` summed over
        the global batch: in the all-reduce of the gradients reduced whole
        under `zero=1`)."""
        mesh = self.mesh
        positions = [i for i, g in enumerate(grads) if g is not None]
        if not positions:
            raise ValueError("No gradients provided for any variable.")
        index = mesh.data_index()  # this replica's shard: its place in its data group
        # Sparse gradients are gathered whole (their slices, as tf.distribute
        # does), and each replica keeps the parts inside its shard.
        gathered = [i for i in positions
                    if self.zero == 1 or sparse_gradients.is_sparse(grads[i])]
        scattered = [i for i in positions if i not in gathered]
        shards = {}
        full, states = self._full.with_states(
            [g if i in gathered else None for i, g in enumerate(grads)], states)
        for i in gathered:
            shards[i] = self.layouts[i].shard(full[i], index)
        if scattered:
            parts = packed_reduce_scatter([grads[i] for i in scattered],
                                          [self.layouts[i] for i in scattered],
                                          mesh.data_launcher(), self.wire)
            for i, g in zip(scattered, parts):  # times t: see DataGroupAllReduce
                shards[i] = g * tf.cast(mesh.tensor, g.dtype)
        return [shards.get(i) for i in range(len(grads))], states
