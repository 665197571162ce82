"""`TensorMesh`: the data x tensor mesh of a strategy's replicas, and its collectives.

Every device is one replica of the strategy (`num_replicas_in_sync` = N).
Replica r has tensor rank `r % t` and data index `r // t`: a *tensor group* is
t consecutive replicas (they hold the t shards of every partitioned weight and
work on the same examples); a *data group* is the d = N / t replicas of one
tensor rank (they hold the same shards and see different examples).

The collectives are TensorFlow's `CollectiveReduceV2` / `CollectiveGatherV2`
issued by one `CollectiveReplicaLauncher` per replica and group, with group keys
from the strategy's own key range, and the ordering token of the strategy's own
launcher on that device: every collective a device issues (tensor group, data
group, or the strategy's all-replica ones) is ordered by program order, which
is the same on every replica, so collectives of different groups never
deadlock.

With pipeline stages (data x pipeline x tensor), stage s of replica r runs on
a device of its own; the stage-s devices of a tensor group's replicas form
that stage's group, with launchers there (`stage`).

The two Megatron operators (Shoeybi et al., 2019) are `copy` ("f": identity
forward, all-reduce of the gradient backward) and `reduce` ("g": all-reduce
forward, identity backward); `take_slice` and `gather_last` move between a
tensor every rank holds whole and the ranks' slices of it.
"""

import contextlib
import threading

import tensorflow as tf

from tfdist._compat import tf_collectives, tf_distribute
from tfdist._compat.tf_collectives import group_launcher
from tfdist._compat.tf_function import ReplicaSharedFunction, caller_value


class _ReplicaMesh:
    """What both meshes share: the current replica (`replica`) and the
    pipeline stage its collectives are for (`stage`)."""

    @contextlib.contextmanager
    def stage(self, index: int):
        """Collectives of the current thread (replica) use pipeline stage
        `index`'s devices while in effect (the pipeline engine sets it around
        each unit of stage `index`).

        Example:

        ```python
        with mesh.stage(1):
            y = mesh.reduce(partial_sum)   # over the stage-1 devices of the group
        ```
        """
        previous = self._stage_index()
        self._stage.index = index
        try:
            yield
        finally:
            self._stage.index = previous

    def _stage_index(self):
        return getattr(self._stage, "index", 0)

    def data_index(self):
        """The current replica's place in its data group (the index of its
        shard of what its group shards), a scalar int32 tensor; in a trace
        the replicas share, one each caller gives.

        Example:

        ```python
        shard = layout.shard(full, mesh.data_index())   # inside strategy.run
        ```
        """
        def own():
            context = tf.distribute.get_replica_context()
            return context.replica_id_in_sync_group // self.tensor

        shared = caller_value("data_index", own, tf.int32)
        return own() if shared is None else shared

    def replica(self):
        """The current replica's id in the sync group (across workers), or
        None outside this mesh's replicas."""
        context = tf.distribute.get_replica_context()
        if context is None or context.strategy is not self.strategy:
            return None
        local = tf_distribute.current_local_replica_id()  # on this task
        return tf_distribute.replica_id_in_sync_group(self.strategy.extended, local)


class TensorMesh(_ReplicaMesh):
    """The data x tensor layout of a strategy's N replicas, t shards per group.

    Args:
        strategy: a `tfdist.Strategy` (its replicas, in order, form the mesh).
        tensor: the tensor-group size t, which divides N.
        stage_devices: with pipeline stages, `stage_devices[r][s]` is the
            device of replica r's stage s (`stage_devices[r][0]` its own):
            each stage's tensor group collectives run on its devices.

    Example:

    ```python
    strategy = tfdist.Strategy(data=2, tensor=2)   # 4 devices
    mesh = strategy.tensor_mesh
    mesh.tensor, mesh.data                 # (2, 2)
    # in replica context (inside strategy.run), replica 3:
    mesh.rank()                            # 1: its shard of every weight
    y = mesh.reduce(partial_sum)           # summed over replicas 2 and 3
    ```
    """

    def __init__(self, strategy, tensor: int, stage_devices=None):
        self.strategy = strategy
        self.tensor = tensor
        extended = strategy.extended
        devices = cluster_devices(extended)  # every replica's, in the cluster
        self.num_replicas = len(devices)
        self.data = self.num_replicas // tensor
        keys = tf_distribute.collective_keys(extended)

        def tensor_group(replica, on=devices):
            start = replica // tensor * tensor
            return on[start:start + tensor]

        def data_group(replica):
            return devices[replica % tensor::tensor]

        # Group keys are numbered in order of first use: every task names
        # every group in the same order, so all tasks agree on them.
        for replica in range(self.num_replicas):
            keys.get_group_key(tensor_group(replica))
            keys.get_group_key(data_group(replica))
        # Launchers of this task's replicas, by replica id;
        # _tensor_launchers[s][r]: replica r's for pipeline stage s's group.
        self._tensor_launchers = [{}]
        self._data_launchers = {}
        for local, device in enumerate(extended.worker_devices):
            replica = tf_distribute.replica_id_in_sync_group(extended, local)
            own = tf_collectives.strategy_launcher(extended, local)
            self._tensor_launchers[0][replica] = group_launcher(
                keys, tensor_group(replica), device, own)
            self._data_launchers[replica] = group_launcher(keys, data_group(replica), device, own)
        options = tf_collectives.launcher_options(tf_collectives.strategy_launcher(extended, 0))
        # Pipeline stages after the first run on devices of their own (one
        # host): each stage's tensor group gets launchers there, with their
        # own ordering token per device (only that stage's collectives run on it).
        for stage in range(1, len(stage_devices[0]) if stage_devices else 1):
            on_stage = [group[stage] for group in stage_devices]
            self._tensor_launchers.append({
                replica: group_launcher(keys, tensor_group(replica, on_stage), device,
                                        options=options)
                for replica, device in enumerate(on_stage)})
        self._stage = threading.local()
        # One trace for every replica (each gives its group's keys and rank).
        self._shared_group_batch = ReplicaSharedFunction(self._group_batch)

    def rank(self):
        """The current replica's tensor rank (its shard index), or None outside
        this mesh's replicas (then layers compute with full weights); in a
        trace the replicas share, a scalar int32 tensor each caller gives."""
        replica = self.replica()
        if replica is None:
            return None
        shared = caller_value("tensor_rank",
                              lambda: tf.constant(self.replica() % self.tensor, tf.int32),
                              tf.int32)
        return replica % self.tensor if shared is None else shared

    def _tensor_launcher(self):
        stage = self._stage_index()  # (a shared trace's callers resolve it later)
        return tf_collectives.own_or_caller_launcher(
            f"tensor/stage{stage}", lambda: self._tensor_launchers[stage][self.replica()])

    def eager_example_sum(self, context, x):
        """`x` summed over the replicas holding other examples, in eager
        replica `context` (a merge call over every replica; a tensor
        group's ranks hold the same examples: counted once).

        Example:

        ```python
        total = mesh.eager_example_sum(tf.distribute.get_replica_context(), count)
        ```
        """
        return context.all_reduce(tf.distribute.ReduceOp.SUM, x) / self.tensor

    def microbatch_runs(self, forward_backward, microbatches: int, xla: bool):
        """What runs each microbatch's `forward_backward` with tensor groups:
        one trace the replicas and microbatches share (each with its own
        variables and its own group's collective keys; with microbatches, its
        body one function each device instantiates once: `in_one_body`), or,
        under XLA (which compiles a collective with its keys), each replica's
        own compiled function.

        Example:

        ```python
        runs = mesh.microbatch_runs(compute._forward_backward, 2, xla=False)
        ```
        """
        if xla:
            return [tf.function(forward_backward, jit_compile=True, reduce_retracing=True,
                                autograph=False)] * microbatches
        shared = ReplicaSharedFunction(forward_backward, one_body=microbatches > 1)
        if microbatches == 1:
            return [shared]
        # Where the trace cannot be shared (a layer's collectives of its own),
        # the replicas are traced into one graph, in which TensorFlow chains
        # every stateful op without a resource (the loss's shape asserts) in
        # program order: replica 0's microbatch 1, which waits for its microbatch
        # 0's gradient all-reduce, would come before replica 1's microbatch 0 and
        # that all-reduce would never meet its peer. One function call per
        # microbatch keeps each replica's chain inside its own calls; one
        # function per microbatch gives each microbatch's tensor-group
        # collectives their own keys, so that they meet their peers whatever
        # order the ranks run the microbatches in (with microbatches of unequal
        # sizes, a shared function's collectives met another microbatch's).
        return [shared.with_unshared(tf.function(forward_backward, reduce_retracing=True,
                                                 autograph=False))
                for _ in range(microbatches)]

    def in_own_function(self, fn):
        """`fn`, a replica's part of the step (pipeline stages' actions), in
        a function of its own. Its actions all-reduce with the other
        replicas; traced into one graph, the replicas' stateful ops without a
        resource (such as a loss's shape assert) would be chained in trace
        order: replica 0's second loss before replica 1's first, which (1F1B)
        waits for a backward whose all-reduce needs replica 0's second
        forward, a cycle. One function call per replica keeps each replica's
        chain inside its own call.

        Example:

        ```python
        run = mesh.in_own_function(functools.partial(actions, local=0))
        ```
        """
        return tf.function(fn, autograph=False)

    def data_launcher(self):
        """The current replica's launcher of collectives over its data group
        (for `tfdist.sharding.collectives` and ZeRO's sharded update)."""
        return tf_collectives.own_or_caller_launcher(
            "data", lambda: self._data_launchers[self.replica()])

    def reduce(self, x):
        """Megatron's "g": sum over the tensor group forward, identity backward."""
        launcher = self._tensor_launcher()

        @tf.custom_gradient
        def reduce(x):
            return launcher.all_reduce(x), lambda dy: dy

        return reduce(x)

    def copy(self, x):
        """Megatron's "f": identity forward, gradient summed over the tensor group."""
        launcher = self._tensor_launcher()

        @tf.custom_gradient
        def copy(x):
            return tf.identity(x), launcher.all_reduce

        return copy(x)

    def gather_last(self, x):
        """Concatenates the tensor group's `x` along the last axis (rank order);
        backward, each rank keeps its own slice of the gradient."""
        launcher = self._tensor_launcher()
        rank = self.rank()

        @tf.custom_gradient
        def gather(x):
            def grad(dy):
                return _part(dy, self.tensor, -1, rank)

            return _concatenated(launcher, x, -1), grad

        return gather(x)

    def take_slice(self, x, axis):
        """This rank's slice of `x` (the same on every rank of the group) along
        `axis`; backward, the group's gradient slices concatenated (an
        all-gather): the converse of `gather_last`."""
        launcher = self._tensor_launcher()
        rank = self.rank()
        axis %= x.shape.rank

        @tf.custom_gradient
        def take(x):
            def grad(dy):
                return _concatenated(launcher, dy, axis)

            return _part(x, self.tensor, axis, rank), grad

        return take(x)

    def group_batch(self, data):
        """The tensor group's batches, concatenated in rank order, and where
        this replica's own rows are in them: `(data, (start, size))`.

        Each replica of a strategy receives its own slice of the global
        batch; the replicas of one tensor group must compute on the same
        examples, so they exchange their slices (sizes may differ).
        """
        return self._shared_group_batch(data)

    def _group_batch(self, data):
        flat = tf.nest.flatten(data)
        first = next(t for t in flat if t is not None)
        rank = self.rank()
        if first.shape[0] is not None and not any(isinstance(t, tf.RaggedTensor)
                                                  for t in flat):
            # The trace counts the slice's rows: the group's replicas read one
            # input spec, so every rank's slice has as many, and none is
            # exchanged or padded.
            rows = first.shape[0]
            return tf.nest.pack_sequence_as(data, self._gathered(flat)), (rank * rows, rows)
        sizes = self._group_sizes(tf.shape(first)[0])
        own = (tf.reduce_sum(sizes[:rank]), sizes[rank])
        return tf.nest.pack_sequence_as(data, self._gathered(flat, sizes)), own

    def _gathered(self, tensors, sizes=None):
        """Every rank's rows of each of `tensors` (None kept), rank i's
        `sizes[i]` of them, in rank order (None: as many on every rank, no
        `tf.RaggedTensor`). Tensors sent in one dtype whose rows have a known
        shape travel together, as the columns of one matrix (a batch's token
        ids, mask and labels: one collective, not three); a
        `tf.RaggedTensor` travels as its row lengths and its values."""
        longest = rows = None
        if sizes is not None:  # every rank's rows padded to the longest: where the real ones are
            longest = tf.reduce_max(sizes)
            rows = tf.concat([tf.range(i * longest, i * longest + sizes[i])
                              for i in range(self.tensor)], axis=0)
        gathered, together = list(tensors), {}
        for i, t in enumerate(tensors):
            if isinstance(t, tf.RaggedTensor):
                (values,) = self._gathered([t.values], self._group_sizes(tf.shape(t.values)[0]))
                (lengths,) = self._gathered([t.row_lengths()], sizes)
                gathered[i] = tf.RaggedTensor.from_row_lengths(values, lengths, validate=False)
            elif t is not None:
                known = t.shape.rank and t.shape[1:].is_fully_defined()
                together.setdefault(_gatherable(t.dtype)[2] if known else i, []).append(i)
        for positions in together.values():
            parts = [tensors[i] for i in positions]
            if len(parts) == 1:
                to, back, _ = _gatherable(parts[0].dtype)
                received = [back(self._gathered_rows(to(parts[0]), longest, rows))]
            else:
                received = _from_columns(
                    self._gathered_rows(_as_columns(parts), longest, rows), parts)
            for i, t, r in zip(positions, parts, received):
                gathered[i] = self._with_group_shape(r, t)
        return gathered

    def _with_group_shape(self, gathered, own):
        """`gathered`, every rank's rows of `own`, with its static shape: when
        `own`'s rows are counted in the trace, every rank's are that many,
        and the model's trace then knows its batch (no shape computed at run
        time where its layers reshape)."""
        rows = None if own.shape[0] is None else self.tensor * own.shape[0]
        gathered.set_shape([rows, *own.shape[1:]])
        return gathered

    def _gathered_rows(self, t, longest, rows):
        """Every rank's rows of `t`, in rank order: each rank's padded to
        `longest`, gathered, then only `rows` of the result kept (all of
        them as they are when `rows` is None)."""
        if rows is None:
            return tf_collectives.all_gather(self._tensor_launcher(), t)
        padding = [[0, longest - tf.shape(t)[0]]] + [[0, 0]] * (t.shape.rank - 1)
        return tf.gather(tf_collectives.all_gather(self._tensor_launcher(), tf.pad(t, padding)),
                         rows)

    def _group_sizes(self, rows):
        """Every rank's `rows` (a scalar), in rank order: shape (t,)."""
        return tf_collectives.all_gather(self._tensor_launcher(), rows[tf.newaxis])

    def on_group_batch(self, step, own_rows=False):
        """`step` (Keras's test or predict step) run on the tensor group's
        batch; with `own_rows`, its outputs cut to this replica's own rows.

        Example:

        ```python
        strategy.run(mesh.on_group_batch(model.predict_step, own_rows=True),
                     args=(batch,))
        ```
        """
        rows_only = own_rows

        def on_group_batch(data):
            data, (start, size) = self.group_batch(data)
            outputs = step(data)
            if rows_only:
                outputs = tf.nest.map_structure(lambda t: t[start:start + size], outputs)
            return outputs

        return on_group_batch


class DataOnlyMesh(_ReplicaMesh):
    """The mesh of a strategy without tensor parallelism: tensor groups of one
    replica, every replica in one data group.

    It answers what `TensorMesh` answers, so the step's parts take a mesh
    whatever the config: its tensor-group operators are the identity, its
    data group's launcher is the strategy's own, or under `stage(s)` (s > 0)
    one among the stage-s devices of every replica (made on first use; the
    replicas all of this process's).

    Args:
        strategy: a tfdist strategy.
        stage_devices: with pipeline stages, `stage_devices[r][s]` is the
            device of replica r's stage s.

    Example:

    >>> mesh = DataOnlyMesh(tfdist.Strategy(data=2, devices=["/cpu:0", "/cpu:1"]))
    >>> mesh.tensor, mesh.rank(), mesh.copy(3)
    (1, None, 3)
    """

    tensor = 1

    def __init__(self, strategy, stage_devices=None):
        self.strategy = strategy
        self._stage_devices = stage_devices
        self._stage = threading.local()
        self._stage_launchers = {}  # stage -> the local replicas' launchers
        self._lock = threading.Lock()

    @property
    def num_replicas(self):
        return self.strategy.num_replicas_in_sync

    @property
    def data(self):
        return self.num_replicas

    def rank(self):
        """0 in this strategy's replica context, else None."""
        return None if self.replica() is None else 0

    def microbatch_runs(self, forward_backward, microbatches: int, xla: bool):
        """What runs each microbatch's `forward_backward`: one trace every
        replica calls with its own variables (`ReplicaSharedFunction`),
        compiled under `xla`. Every microbatch calls it, on one device too (a
        worker of a multi-worker job on CPU): traced inline, each microbatch
        was one more trace of the model (GPT-2 82M at 4 microbatches: first
        step 19-24 -> 13-14 CPU s, peak 0.13-0.17 GiB lower). Without XLA the
        trace's body is one function each device instantiates once
        (`in_one_body`), not one inlined copy per microbatch.

        Example:

        ```python
        runs = mesh.microbatch_runs(compute._forward_backward, 2, xla=False)
        ```
        """
        several = microbatches > 1
        return [ReplicaSharedFunction(forward_backward, jit_compile=xla, one_copy_too=several,
                                      one_body=several and not xla)] * microbatches

    def in_own_function(self, fn):
        """`fn`, a replica's part of the step: called as it is (see `TensorMesh`'s)."""
        return fn

    def data_launcher(self):
        """The current replica's launcher of collectives over its data group
        on the current stage's devices (the strategy's own on stage 0)."""
        stage = self._stage_index()  # (a shared trace's callers resolve it later)
        return tf_collectives.own_or_caller_launcher(
            f"data/stage{stage}", lambda: self._own_data_launcher(stage))

    def _own_data_launcher(self, stage):
        local = tf_distribute.current_local_replica_id()
        extended = self.strategy.extended
        if stage == 0:
            return tf_collectives.strategy_launcher(extended, local)
        with self._lock:  # (replica threads trace at once)
            if stage not in self._stage_launchers:
                group = [devices[stage] for devices in self._stage_devices]
                options = tf_collectives.launcher_options(
                    tf_collectives.strategy_launcher(extended, 0))
                keys = tf_distribute.collective_keys(extended)
                self._stage_launchers[stage] = [
                    group_launcher(keys, group, device, options=options) for device in group]
        return self._stage_launchers[stage][local]

    def reduce(self, x):
        return x

    def eager_example_sum(self, context, x):
        return context.all_reduce(tf.distribute.ReduceOp.SUM, x)

    def copy(self, x):
        return x

    def gather_last(self, x):
        return x

    def take_slice(self, x, axis):
        del axis
        return x

    def on_group_batch(self, step, own_rows=False):
        """`step` itself: a replica's batch is its group's."""
        del own_rows
        return step

    def group_batch(self, data):
        """`(data, (0, its rows))`: a replica's batch is its group's."""
        tensors = [t for t in tf.nest.flatten(data) if t is not None]
        return data, (0, tf.shape(tensors[0])[0])


def _part(x, count: int, axis: int, index):
    """Part `index` (an int, or a scalar int32 tensor) of `x` split into
    `count` equal parts along `axis`."""
    if isinstance(index, int):
        return tf.split(x, count, axis=axis)[index]
    axis %= x.shape.rank
    shape = tf.shape(x)
    width = shape[axis] // count
    begin = tf.one_hot(axis, x.shape.rank, on_value=index * width, off_value=0, dtype=tf.int32)
    size = tf.tensor_scatter_nd_update(shape, [[axis]], [width])
    part = tf.slice(x, begin, size)
    static = x.shape.as_list()
    static[axis] = None if static[axis] is None else static[axis] // count
    part.set_shape(static)
    return part


def _concatenated(launcher, x, axis):
    """The group's `x` concatenated along `axis`, in rank order."""
    rank = x.shape.rank
    axis %= rank
    stacked = tf_collectives.all_gather(launcher, x[tf.newaxis])  # (t, ...)
    moved = tf.transpose(stacked, [*range(1, axis + 1), 0, *range(axis + 1, rank + 1)])
    shape = tf.concat([tf.shape(x)[:axis], [-1], tf.shape(x)[axis + 1:]], 0)
    return tf.reshape(moved, shape)


# TensorFlow's CPU collectives gather these dtypes; others travel as one of them.
_GATHERED = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)


def _gatherable(dtype):
    """(to, back, sent dtype): functions turning a tensor of `dtype` into one
    TensorFlow's collectives can gather, and back, losslessly (bfloat16 as
    float32, small integers and bools as int64, uint64 bit for bit)."""
    if dtype in _GATHERED:
        return tf.identity, tf.identity, dtype
    if dtype == tf.uint64:
        return (lambda t: tf.bitcast(t, tf.int64)), (lambda t: tf.bitcast(t, dtype)), tf.int64
    wide = tf.float32 if dtype == tf.bfloat16 else tf.int64
    if dtype == tf.bfloat16 or dtype.is_integer or dtype == tf.bool:
        return (lambda t: tf.cast(t, wide)), (lambda t: tf.cast(t, dtype)), wide
    raise TypeError(
        f"With `tensor` > 1 a tensor group exchanges its batch, but an input of "
        f"dtype {dtype.name} cannot be exchanged: use numeric or bool inputs "
        f"(convert strings to ids in the input pipeline).")


def _as_columns(tensors):
    """`tensors` (rows of a known shape, one sent dtype) as the columns of
    one matrix of that dtype: each row flattened, side by side."""
    return tf.concat([tf.reshape(_gatherable(t.dtype)[0](t), [tf.shape(t)[0], -1])
                      for t in tensors], axis=1)


def _from_columns(matrix, tensors):
    """The converse of `_as_columns`: `matrix`'s columns cut back into
    tensors of the dtypes and row shapes of `tensors`."""
    columns = tf.split(matrix, [t.shape[1:].num_elements() for t in tensors], axis=1)
    return [_gatherable(t.dtype)[1](tf.reshape(c, [-1, *t.shape[1:]]))
            for c, t in zip(columns, tensors)]


def cluster_devices(extended):
    """Every replica's device in replica order: across the cluster under a
    multi-worker strategy (a task's replicas follow its id in the cluster:
    the chief's first), else the strategy's own devices.

    Example:

    ```python
    cluster_devices(strategy.extended)   # 2 workers x 2 CPUs:
    # ['/job:worker/replica:0/task:0/device:CPU:0', '.../task:0/device:CPU:1',
    #  '/job:worker/replica:0/task:1/device:CPU:0', '.../task:1/device:CPU:1']
    ```
    """
    local = list(extended.worker_devices)
    spec = tf_distribute.cluster_spec(extended)
    if not spec or not spec.jobs:
        return local
    tasks = sorted(((job, index) for job in ("chief", "worker") if job in spec.jobs
                    for index in range(spec.num_tasks(job))),
                   key=lambda task: tf_distribute.id_in_cluster(spec, *task))
    return [tf.DeviceSpec.from_string(device).replace(job=job, task=index).to_string()
            for job, index in tasks for device in local]

