"""`ShardedStorage`: a variable whose elements are split across the replicas.

Each replica's device holds one variable of `layout.shard_shape`, its own
shard, and nothing else, as its layout (any of `tfdist.sharding.layout`) says:
an element shard of ZeRO (`ShardLayout`, `MeshShardLayout`) or a slice along
one axis for tensor parallelism (`AxisLayout`). It is a `tf.distribute`
on-read variable, so inside a replica (in `strategy.run`) reading or assigning
it reads or assigns that replica's shard: Keras's own optimizer code, which
reads and assigns its slot variables, runs unchanged on a shard. Outside
replicas (saving, loading, `numpy()`) it behaves as one variable of the full,
unsharded shape: reads gather every shard, assigns scatter a full value, and a
checkpoint holds the full tensor, exactly what an unsharded variable saves.
Loading into any number of replicas reshards.

`shard_keras_variable` moves an existing Keras variable's storage into shards in
place: the Keras object (its identity, path, shape and place in its optimizer)
is unchanged.
"""

import contextlib

import tensorflow as tf

from tfdist._compat import tf_variables
from tfdist._compat.tf_distribute import current_local_replica_id, replica_id_in_sync_group
from tfdist.cluster.watchdog import process_watchdog
from tfdist.sharding.layout import AxisLayout, MeshShardLayout, ShardLayout


class ShardedStorage(tf_variables.SyncOnReadVariable):
    """One shard per replica device; the full value when read across replicas.

    Build one with `ShardedStorage.create`.

    Example:

    ```python
    layout = ShardLayout((1000, 64), strategy.num_replicas_in_sync)
    with strategy.scope():
        storage = ShardedStorage.create(strategy, layout, None, "m", "float32")
    storage.numpy().shape          # (1000, 64): gathered
    [c.shape for c in storage.values]  # one (16000,) shard per device (4 replicas)
    ```
    """

    @classmethod
    def create(cls, strategy, layout: ShardLayout, initial, name: str, dtype,
               trainable=False, devices=None):
        """Creates the shards of `initial` (a full-shape value, or None for
        zeros) on `devices` (one per local replica; default the replicas'
        own); the shard index of a device is its replica's id in the sync
        group. `trainable` shards are watched by gradient tapes (a partitioned
        model weight)."""
        with tf.init_scope():
            if initial is not None:
                initial = tf.convert_to_tensor(initial, dtype=dtype)
            return cls._of_shards(
                strategy, layout, name, trainable, devices,
                lambda local, index: tf.zeros(layout.shard_shape, dtype) if initial is None
                else own_copy(layout.shard(initial, index)))

    @classmethod
    def _of_shards(cls, strategy, layout, name, trainable, devices, shard_of):
        """Storage whose shard on each of `devices` (default the replicas'
        own) is `shard_of(local, index)`, made there: `local` is the
        replica's position on this task, `index` its id in the sync group."""
        extended = strategy.extended
        components = []
        for local, device in enumerate(devices or extended.worker_devices):
            index = replica_id_in_sync_group(extended, local)
            with tf.device(device):
                # ResourceVariable directly: the strategy's variable creator
                # (which would mirror it) is bypassed.
                components.append(tf_variables.ResourceVariable(
                    shard_of(local, index), trainable=trainable, name=f"{name}/shard_{index}"))
        return cls(strategy, components, layout)

    @classmethod
    def agreed(cls, strategy, layout, value, name, trainable=False, devices=None):
        """`create` with the first replica's `value` on every task, each task
        passing its own (under `MultiWorkerMirroredStrategy` the chief's is
        the one, as `tf.distribute` makes it for any variable): sent in
        blocks of rows (`_from_rows`), so no task receives it whole. Every
        task must make the same variables in the same order.

        Example:

        ```python
        storage = ShardedStorage.agreed(strategy, layout, tf.random.normal((4096, 4096)), "kernel")
        ```
        """
        def first_only(index, rows):  # the first replica's rows, zeros elsewhere
            return tf.zeros_like(rows) if index else rows

        shape = value.shape
        if not shape.rank and not _local(strategy):  # a scalar: summed whole
            value = _sum_across_replicas(strategy, tuple(
                first_only(replica_id_in_sync_group(strategy.extended, local), value)
                for local in range(len(strategy.extended.worker_devices))))
        if not shape.rank or _local(strategy):
            return cls.create(strategy, layout, value, name, value.dtype, trainable, devices)

        def part(start, count, local, index):
            return first_only(index, tf.reshape(value[start:start + count], [-1]))

        return cls._from_rows(strategy, layout, shape, value.dtype, name, trainable,
                              devices or strategy.extended.worker_devices, part,
                              "agreeing on a variable's initial value")

    def resharded(self, layout, name, trainable):
        """This storage's value in `layout`, as new storage on the same
        devices, when this one holds element shards of the whole value
        (`holds_element_shards`): summed from every replica's shard one block
        of rows at a time (`_from_rows`), so no task holds the whole value.
        Every task must reshard the same variables in the same order.

        Example:

        ```python
        split = storage.resharded(AxisLayout(storage.shape, 1, 2), "kernel", True)
        ```
        """
        source = self._element_layout()

        def part(start, count, local, index):
            return source.shard_in_rows(self._values[local], start, count, index)

        return self._from_rows(self._distribute_strategy, layout, source.shape, self.dtype,
                               name, trainable, [c.device for c in self._values], part,
                               "resharding a variable")

    @classmethod
    def _from_rows(cls, strategy, layout, shape, dtype, name, trainable, devices, part, what):
        """Storage in `layout` of a value of `shape` that no task holds
        whole: for each block of its rows (at most `RESHARD_BLOCK_BYTES`, a
        row at least) the block is the sum over every replica of
        `part(start, count, local, index)` (that replica's contribution to
        rows `start` to `start + count`, flat, zeros where it has none), and
        each local replica keeps its shard's piece of it (`rows_piece`),
        concatenated into its shard."""
        extended = strategy.extended
        indices = [replica_id_in_sync_group(extended, local) for local in range(len(devices))]
        step = max(1, RESHARD_BLOCK_BYTES // (shape[1:].num_elements() * dtype.size))
        pieces = [[] for _ in devices]
        with tf.init_scope(), _bounded(strategy, what):
            for start in range(0, shape[0], step):
                count = min(step, shape[0] - start)
                parts = []
                for local, (device, index) in enumerate(zip(devices, indices)):
                    with tf.device(device):
                        parts.append(part(start, count, local, index))
                rows = tf.reshape(_sum_across_replicas(strategy, tuple(parts)),
                                  [count, *shape[1:]])
                for held, device, index in zip(pieces, devices, indices):
                    with tf.device(device):  # a piece of its own: no block kept alive
                        held.append(own_copy(layout.rows_piece(rows, start, index)))
            size = tf.TensorShape(layout.shard_shape).num_elements()

            def shard_of(local, index):
                held = pieces[local]
                flat = held[0] if len(held) == 1 else tf.concat(held, 0)
                held.clear()
                return tf.reshape(tf.pad(flat, [[0, size - flat.shape[0]]]), layout.shard_shape)

            return cls._of_shards(strategy, layout, name, trainable, devices, shard_of)

    def holds_element_shards(self):
        """Whether each replica holds an element shard of the whole value
        (what `resharded` starts from).

        Example:

        ```python
        storage_of(kernel).holds_element_shards()   # True as created under tensor=2
        ```
        """
        return self._element_layout() is not None

    def _element_layout(self):
        """The `ShardLayout` over every replica this storage's layout is
        (element shards of a value of rank 1 or more), else None."""
        layout = self._layout
        if isinstance(layout, MeshShardLayout):
            layout = layout.part if layout.tensor == 1 and layout.split is None else None
        if (isinstance(layout, ShardLayout) and layout.shape.rank > 0
                and layout.num_shards == self._distribute_strategy.num_replicas_in_sync):
            return layout
        return None

    def __init__(self, strategy, components, layout: ShardLayout):
        super().__init__(strategy, components, tf.VariableAggregation.NONE)
        self._layout = layout

    @property
    def layout(self) -> ShardLayout:
        return self._layout

    @property
    def shape(self):
        """The full shape across replicas (what reads give there); inside a
        replica, its shard's."""
        return self._layout.shape if self._cross_replica() else super().shape

    def get_shape(self):
        return self.shape

    def _cross_replica(self):
        return tf_variables.in_cross_replica_context(self._distribute_strategy)

    def _get_cross_replica(self):
        """The full value: every replica's shard, gathered and unpadded."""
        shards = [v.read_value() for v in self._values]
        strategy = self._distribute_strategy
        if _local(strategy):
            with tf.device(self._values[0].device):
                return self._layout.unshard(tf.stack(shards))
        # Other workers hold the other shards: a cross-worker gather, which
        # every worker must take part in (as in any multi-worker save); read
        # eagerly (a save), it is bounded as a step is.
        with _bounded(strategy, "gathering a sharded variable"):
            gathered = _gather_across_workers(strategy, tuple(shard[tf.newaxis]
                                                              for shard in shards))
        return self._layout.unshard(gathered)

    def assign(self, value, use_locking=False, name=None, read_value=True):
        """In a replica: assigns its shard. Across replicas: scatters a full value."""
        if not self._cross_replica():
            return super().assign(value, use_locking, name, read_value)
        value = tf.convert_to_tensor(value, dtype=self.dtype)
        extended = self._distribute_strategy.extended
        for local, component in enumerate(self._values):
            index = replica_id_in_sync_group(extended, local)
            with tf.device(component.device):
                component.assign(own_copy(self._layout.shard(value, index)), use_locking)
        return self if read_value else None

    def assign_add(self, value, use_locking=False, name=None, read_value=True):
        if not self._cross_replica():
            return super().assign_add(value, use_locking, name, read_value)
        return self.assign(self._get_cross_replica() + value, use_locking, name, read_value)

    def assign_sub(self, value, use_locking=False, name=None, read_value=True):
        if not self._cross_replica():
            return super().assign_sub(value, use_locking, name, read_value)
        return self.assign(self._get_cross_replica() - value, use_locking, name, read_value)

    def scatter_add(self, sparse_delta, use_locking=False, name=None):
        """In a replica: adds `tf.IndexedSlices` (of its shard) to its shard."""
        return self._own_shard("scatter_add").scatter_add(sparse_delta, use_locking, name)

    def scatter_sub(self, sparse_delta, use_locking=False, name=None):
        """In a replica: subtracts `tf.IndexedSlices` (of its shard) from its shard."""
        return self._own_shard("scatter_sub").scatter_sub(sparse_delta, use_locking, name)

    def scatter_update(self, sparse_delta, use_locking=False, name=None):
        """In a replica: assigns `tf.IndexedSlices` (of its shard) to its shard."""
        return self._own_shard("scatter_update").scatter_update(sparse_delta, use_locking, name)

    def _own_shard(self, operation):
        """The running replica's shard, for a sparse update of it."""
        if self._cross_replica():
            raise NotImplementedError(
                f"`{operation}` of sharded storage runs in a replica, on its shard "
                f"(a sparse update of the full value across replicas is not supported).")
        return self.values[current_local_replica_id()]

    def _serialize_to_tensors(self):
        return {"VARIABLE_VALUE": self._get_cross_replica()}

    def _restore_from_tensors(self, restored_tensors):
        return self.assign(restored_tensors["VARIABLE_VALUE"])


# The most bytes of a variable's whole value `ShardedStorage.resharded`
# assembles at once.
RESHARD_BLOCK_BYTES = 16 * 2**20


def _bounded(strategy, what):
    """A deadline of `strategy.timeout_seconds` on `what`, a collective
    every task must join (a save, a reshard), when run eagerly with replicas
    on other tasks."""
    if _local(strategy) or not tf.executing_eagerly():
        return contextlib.nullcontext()
    return process_watchdog().deadline(
        strategy.timeout_seconds, what,
        "every task must read and reshard sharded state together (each save, "
        "the first step's split), as tfdist.callbacks.BackupAndRestore does.")


def _local(strategy):
    """Whether every replica of `strategy` is on this task."""
    return len(strategy.extended.worker_devices) == strategy.num_replicas_in_sync


def _gather_across_workers(strategy, shards):
    """`strategy.gather` of this task's `shards` (one per local replica,
    stacked on a new first axis) with every other task's, along axis 0."""
    return _traced(strategy, "gather", lambda shards: strategy.gather(
        tf_variables.PerReplica(shards), axis=0))(shards)


def _sum_across_replicas(strategy, values):
    """The sum of this task's `values` (one per local replica) and every
    other task's; added here when every replica is on this task (a
    collective per block was a third of the first step's split in one
    process)."""
    if _local(strategy):
        return tf.add_n(list(values))
    return _traced(strategy, "sum", lambda values: strategy.reduce(
        tf.distribute.ReduceOp.SUM, tf_variables.PerReplica(values), axis=None))(values)


def _traced(strategy, name, collective):
    """`collective` traced once per strategy (shapes left general after its
    first retrace) when called eagerly.

    Called eagerly, `tf.distribute`'s multi-worker collectives trace a new
    function at every call, and each traced graph holds the call's tensors in
    reference cycles until Python's cyclic collector runs: splitting a model
    over tensor groups, which read each weight whole, kept what it gathered
    alive (64 MiB on each of 4 workers of an 8 x Dense(4096) model under
    tensor=4). One traced function per strategy leaves nothing behind.
    """
    if not tf.executing_eagerly():
        return collective
    functions = vars(strategy).setdefault(_TRACED_COLLECTIVES, {})
    if name not in functions:
        functions[name] = tf.function(collective, reduce_retracing=True, autograph=False)
    return functions[name]


# The strategy attribute holding its traced collectives, by name.
_TRACED_COLLECTIVES = "_tfdist_traced_collectives"


def own_copy(shard):
    """`shard` in a buffer of its own. A slice of a tensor (`ShardLayout`'s
    rows, `tf.split` along the first axis) can share the whole tensor's
    buffer, and a variable assigned it would then keep the whole value alive:
    the memory sharding exists to save.

    Example:

    >>> rows = tf.reshape(tf.range(8.0), (2, 4))
    >>> own_copy(rows[1]).numpy()
    array([4., 5., 6., 7.], dtype=float32)
    """
    return tf.raw_ops.DeepCopy(x=shard)


def shard_keras_variable(variable, layout, strategy):
    """Moves a Keras variable's storage into `ShardedStorage`, keeping its value.

    The Keras variable keeps its shape, path and identity; only how its
    elements are split changes: each replica's shard goes to the device that
    held that replica's copy (a pipeline stage's device, say). `layout` is a
    layout object (`ShardLayout`, `AxisLayout`, `MeshShardLayout`) or an int:
    that many element shards. Returns the new storage.

    Example:

    ```python
    with strategy.scope():
        slot = keras.Variable(tf.zeros((1000, 64)))
    storage = shard_keras_variable(slot, 4, strategy)
    slot.numpy().shape   # (1000, 64), now held as four shards of 16,000
    ```
    """
    if isinstance(layout, int):
        layout = ShardLayout(variable.shape, layout)
    held = tf_variables.storage_of(variable)
    if storage_layout(variable) == layout:  # created as these shards
        return held
    if isinstance(held, ShardedStorage) and held.holds_element_shards():
        storage = held.resharded(layout, variable.name, variable.trainable)
    else:
        storage = ShardedStorage.create(
            strategy, layout, variable.value, name=variable.name, dtype=variable.dtype,
            trainable=variable.trainable, devices=copy_devices(variable, strategy))
    tf_variables.set_storage(variable, storage)
    return storage


def storage_layout(variable):
    """The layout of a Keras variable held in `ShardedStorage`, else None.

    Example:

    ```python
    storage_layout(model.layers[0].kernel)   # AxisLayout under tensor parallelism
    ```
    """
    storage = tf_variables.storage_of(variable)
    return storage.layout if isinstance(storage, ShardedStorage) else None


def copy_devices(variable, strategy):
    """The device of each local replica's copy of a Keras variable (None if
    it is not one copy per replica: then the replicas' own devices).

    Example:

    ```python
    copy_devices(model.layers[-1].kernel, strategy)   # stage devices when pipelined
    ```
    """
    copies = getattr(tf_variables.storage_of(variable), "values", ())
    if len(copies) != len(strategy.extended.worker_devices):
        return None
    return [copy.device for copy in copies]


def axis_layout(variable):
    """The `AxisLayout` of a Keras variable split across a tensor group (held
    as those slices, or under `zero` as element shards of them), else None.

    Example:

    ```python
    axis_layout(model.layers[0].kernel)   # AxisLayout((8, 16), axis=1, parts=2)
    axis_layout(model.optimizer.variables[2])  # None: a ZeRO shard of a whole one
    ```
    """
    layout = storage_layout(variable)
    return getattr(layout, "split", None) if isinstance(layout, MeshShardLayout) else (
        layout if isinstance(layout, AxisLayout) else None)
