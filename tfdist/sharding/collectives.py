"""Reduce-scatter and all-gather for the replica running this code.

`tf.distribute`'s replica context offers all-reduce and a merge-call based
all-gather, but no reduce-scatter, and TensorFlow's reduce-scatter collective
has no CPU implementation. These functions issue collectives directly with the
strategy's own group and instance keys (its `CollectiveAllReduce` launcher for
this replica), so they order with the strategy's other collectives and work the
same on one host and across workers:

- `reduce_scatter`: one all-to-all (each replica sends shard r to replica r) and
  a local sum of the N shards received: each replica ends up with only its own
  reduced shard; no replica ever holds another replica's reduced shard. Rows
  that would receive more than `PIECE_BYTES` go in pieces of columns, one
  all-to-all after the other's sum, so the received buffer stays small.
- `all_gather`: one gather of equal-shaped shards along a new leading axis.
- `packed_reduce_scatter`, `packed_all_gather`: the same for many values of
  shard layouts (ZeRO's gradients and parameters), one collective per dtype
  for the weights under `ALONE_BYTES`, one per weight for larger ones
  (packing copies a weight in and out: at the step's peak, two copies of a
  unit).

Both take an optional `launcher`: a subgroup's launcher for this replica (a
`TensorMesh` data group), in place of the strategy's all-replica one.
"""

import math

import tensorflow as tf

from tfdist._compat import tf_collectives
from tfdist._compat.tf_distribute import current_local_replica_id
from tfdist.sharding.wire import Wire

# A weight of at least this many bytes (whole: as gathered, or its gradient)
# is gathered or reduce-scattered in a collective of its own; smaller ones
# are packed per dtype (packing copies them into the pack and out of it;
# every collective a step runs costs TensorFlow a little memory for good).
ALONE_BYTES = 16 << 20
# A reduce-scatter receives at most about this many bytes per all-to-all: the
# rows of a larger one are sent in pieces of columns, one after another.
PIECE_BYTES = 16 << 20
# A piece's columns are a multiple of this (and of the wire's block).
PIECE_COLUMNS = 4096


def replica_launcher():
    """The strategy's collective launcher of the current replica; in a trace
    the replicas share (`ReplicaSharedFunction`), one whose keys and ordering
    token each caller gives.

    Example:

    ```python
    summed = replica_launcher().batch_all_reduce([grads])   # inside strategy.run
    ```
    """
    context = tf.distribute.get_replica_context()
    if context is None:
        raise RuntimeError("tfdist collectives run in replica context (inside strategy.run).")

    def own():
        return tf_collectives.strategy_launcher(context.strategy.extended,
                                                current_local_replica_id())

    return tf_collectives.own_or_caller_launcher("data/stage0", own)


def reduce_scatter(rows, launcher=None, wire=None):
    """Sums `rows` (shape `(N, m)`, N replicas) across replicas; returns this
    replica's row of the sum, shape `(m,)` (with a subgroup's `launcher`: N
    is the group's size, the row the replica's place in it). With a `wire`
    (`tfdist.sharding.wire`), the rows travel as it encodes them and are
    summed decoded.

    Example (in replica context, 4 replicas):

    ```python
    rows = tf.reshape(padded_flat_gradient, (4, -1))
    my_shard = reduce_scatter(rows)   # sum over replicas of rows[my_replica_id]
    ```
    """
    launcher = launcher or replica_launcher()
    wire = wire or Wire()
    columns = _piece_columns(rows, wire)  # None: all at once
    sums = []
    with tf.device(tf_collectives.launcher_device(launcher)):
        for start in [0] if columns is None else range(0, rows.shape[1], columns):
            # One piece at a time: each waits for the sum before it.
            with tf.control_dependencies(sums[-1:]):
                piece = rows if columns is None else rows[:, start:start + columns]
                received = [tf_collectives.all_to_all(launcher, part)
                            for part in wire.encode(piece)]
                sums.append(tf.reduce_sum(wire.decode(received, piece.shape[1], rows.dtype),
                                          axis=0))
    return _concat(sums, 0)


def _piece_columns(rows, wire):
    """Columns of `rows` sent per all-to-all: as many as make at most
    `PIECE_BYTES` received, a multiple of `PIECE_COLUMNS` and of the elements `wire`
    encodes together (so the pieces encode as the whole rows would); None
    when the rows fit in one (or their width is unknown)."""
    width = rows.shape[1]
    per_column = rows.shape[0] * rows.dtype.size
    if width is None or width * per_column <= PIECE_BYTES:
        return None
    multiple = math.lcm(PIECE_COLUMNS, wire.block)
    return max(1, PIECE_BYTES // per_column // multiple) * multiple


def all_gather(row, launcher=None):
    """Gathers `row` (shape `(m,)`, the same shape on every replica) from every
    replica (of `launcher`'s group if given); returns shape `(N, m)`, row r
    from replica r.

    Example (in replica context):

    ```python
    shards = all_gather(my_updated_shard)   # (num_replicas, shard_size)
    ```
    """
    launcher = launcher or replica_launcher()
    return tf_collectives.all_gather(launcher, row[tf.newaxis],
                                     tf_collectives.launcher_options(launcher))


def packed_reduce_scatter(grads, layouts, launcher=None, wire=None):
    """Reduce-scatter of every gradient, one collective per dtype (over
    `launcher`'s group if given, else every replica; one per tensor `wire`
    encodes with).

    Example:

    ```python
    shards = packed_reduce_scatter(grads, layouts)   # in replica context
    ```
    """
    return _per_dtype(grads, layouts,
                      lambda rows: reduce_scatter(_concat(rows, 1), launcher, wire),
                      lambda layout, g: layout.rows(g), axis=0, whole_bytes=_bytes)


def packed_all_gather(shards, layouts, launcher=None, wire=None):
    """Every replica's shards (of `launcher`'s group if given), gathered into
    full values; one collective per dtype (per tensor `wire` encodes with:
    the shards travel as it encodes them).

    Example:

    ```python
    full = packed_all_gather(updated_shards, layouts)   # in replica context
    ```
    """
    wire = wire or Wire()
    launcher = launcher or replica_launcher()
    replicas = tf_collectives.launcher_group_size(launcher)

    def gather(parts):
        row = _concat(parts, 0)
        return wire.decode([all_gather(t, launcher) for t in wire.encode(row)],
                           row.shape[0], row.dtype)

    gathered = _per_dtype(shards, layouts, gather, lambda layout, s: s, axis=1,
                          whole_bytes=lambda shard: replicas * _bytes(shard))
    return [layout.unshard(rows) for layout, rows in zip(layouts, gathered)]


def _per_dtype(values, layouts, collective, prepare, axis, whole_bytes):
    """Runs `collective` once per dtype on the concatenated `prepare`d values
    and splits its result back (along `axis`) into per-value shard-size parts;
    a value whose weight is `ALONE_BYTES` or more (`whole_bytes(value)`) has a
    collective of its own, so that it is never copied into a pack and out of
    it (two transient copies of the largest weights, at the step's peak)."""
    results = [None] * len(values)
    groups = {}
    for position, value in enumerate(values):
        alone = whole_bytes(value) >= ALONE_BYTES
        groups.setdefault(position if alone else value.dtype, []).append(position)
    for positions in groups.values():
        out = collective([prepare(layouts[p], values[p]) for p in positions])
        sizes = [layouts[p].shard_size for p in positions]
        parts = [out] if len(positions) == 1 else tf.split(out, sizes, axis=axis)
        for p, part in zip(positions, parts):
            results[p] = part
    return results


def _bytes(tensor):
    """Bytes of `tensor` (0 when its shape is not known)."""
    return (tensor.shape.num_elements() or 0) * tensor.dtype.size


def _concat(values, axis):
    """`values` concatenated along `axis`; one value as it is (no copy)."""
    return values[0] if len(values) == 1 else tf.concat(values, axis)


def non_finite_count(tensors):
    """How many elements of `tensors` are not finite, as a float32 scalar:
    all-reduced, it makes one loss-scaling skip decision for replicas that
    hold different gradients (tensor ranks, ZeRO shards).

    Example:

    >>> float(non_finite_count([tf.constant([1.0, float("inf")]), tf.constant([float("nan")])]))
    2.0
    """
    return tf.add_n([tf.reduce_sum(tf.cast(~tf.math.is_finite(t), tf.float32))
                     for t in tensors])
