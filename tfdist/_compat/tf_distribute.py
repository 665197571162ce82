"""`tf.distribute` strategy internals: replica ids, collective keys, the cluster.

A strategy's `extended` knows which replica of the sync group each local
device is and holds the collective group keys; none of it is public.
"""

import itertools

import tensorflow as tf
from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
from tensorflow.python.distribute import (
    collective_util,
    cross_device_ops,
    distribute_lib,
    multi_worker_util,
    values_util,
)
from tensorflow.python.eager import context as eager_context
from tensorflow.python.trackable import base as trackable_base
from tensorflow.python.util import nest


def replica_id_in_sync_group(extended, local: int) -> int:
    """The sync-group id (across workers) of this task's `local`-th replica.

    Example:

    ```python
    replica_id_in_sync_group(strategy.extended, 0)   # 2 on the second of 2-replica workers
    ```
    """
    return extended._get_replica_id_in_sync_group(local)


def local_replica_id(extended, replica) -> int:
    """The position on this task of the replica with sync-group id `replica`
    (the inverse of `replica_id_in_sync_group`).

    Example:

    ```python
    local_replica_id(strategy.extended, context.replica_id_in_sync_group)
    ```
    """
    return extended._get_local_replica_id(replica)


def current_local_replica_id() -> int:
    """The position on this task of the replica running this code, as a
    Python int (in replica context).

    Example:

    ```python
    strategy.run(lambda: current_local_replica_id())   # 0, 1, ... per device
    ```
    """
    return values_util.get_current_replica_id_as_int()


def collective_keys(extended):
    """The strategy's `CollectiveKeys`: group and instance keys of its collectives.

    Example:

    ```python
    collective_keys(strategy.extended).get_group_key(devices)
    ```
    """
    return extended._collective_keys


def cluster_spec(extended):
    """The cluster of a multi-worker strategy (a `ClusterSpec`), or None on one host.

    Example:

    ```python
    cluster_spec(strategy.extended)   # None for a MirroredStrategy
    ```
    """
    return getattr(extended, "_cluster_spec", None)


def id_in_cluster(spec, job: str, index: int) -> int:
    """The id of task `job:index` in `spec`: the chief is 0, then the workers.

    Example:

    ```python
    id_in_cluster(spec, "worker", 0)   # 1 with a chief
    ```
    """
    return multi_worker_util.id_in_cluster(spec, job, index)


def summed_across_replicas(values):
    """Each tensor (or `tf.IndexedSlices`) of the structure `values` summed
    over every replica, in replica context.

    What `ReplicaContext.all_reduce(SUM, values)` computes, by the same calls
    (`batch_reduce_to` in a merge call, or the strategy's replica-context
    all-reduce), without the differentiable wrapper it adds: traced in a
    function, that wrapper's gradient is registered in TensorFlow's global
    gradient registry for good, which then keeps the replica context, its
    strategy and everything the strategy reaches alive. Nothing tfdist
    reduces is differentiated.

    Example:

    ```python
    total = summed_across_replicas(tf.constant(1.0))   # in replica context: N
    ```
    """
    context = tf.distribute.get_replica_context()
    flat = nest.flatten(values)
    extended = context.strategy.extended
    options = collective_util.Options()
    sum_ = tf.distribute.ReduceOp.SUM
    if extended._use_merge_call():
        def batch_sum(strategy, *flat):
            pairs = [(v, distribute_lib._batch_reduce_destination(v)) for v in flat]
            if cross_device_ops._all_devices_match(pairs):
                return strategy.extended.batch_reduce_to(sum_, pairs, options)
            # Values on several devices (a pipeline replica's gradients on its
            # stages'): `batch_reduce_to` packs only one device's, and would
            # reduce these one by one after logging that it cannot pack them.
            return [strategy.extended.batch_reduce_to(sum_, [pair], options)[0] for pair in pairs]

        reduced = context.merge_call(batch_sum, args=flat)
    else:
        reduced = extended._replica_ctx_all_reduce(sum_, flat, options)
    return nest.pack_sequence_as(values, reduced)


def initial_value(extended, **kwargs):
    """The initial value `tf.Variable(**kwargs)` would be given, as a tensor
    on this task's first device: this task's own (under a
    `MultiWorkerMirroredStrategy`, the value tasks must agree on; the
    strategy broadcasts its chief's, `ShardedStorage.agreed` does so block by
    block).

    Example:

    ```python
    with tf.init_scope():
        value = initial_value(strategy.extended, initial_value=init, dtype="float32")
    ```
    """
    value = kwargs["initial_value"]
    with tf.device(extended.worker_devices[0]):
        if callable(value):
            value = value()
        if isinstance(value, trackable_base.CheckpointInitialValue):
            value = value.wrapped_value
        return tf.convert_to_tensor(value, dtype=kwargs.get("dtype"))


def bound_task_registration(cluster: dict, task_type: str, timeout_seconds: float):
    """Makes the next `MultiWorkerMirroredStrategy` of this process wait at
    most `timeout_seconds` for every chief and worker task of `cluster` (its
    TF_CONFIG dict) to register with TensorFlow's coordination service.

    The strategy configures that service as done here, but with no
    registration deadline: a task that dies before registering leaves the
    others in `WaitForAllTasks` forever (Python signal handlers do not run
    there). With a registration barrier the wait fails instead with a
    `tf.errors.DeadlineExceededError` naming the missing tasks. Nothing is
    done if the service is already configured (by an earlier strategy).

    Example:

    ```python
    bound_task_registration({"worker": ["h0:2222", "h1:2222"]}, "worker", 300)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    ```
    """
    context = eager_context.context()
    if context.coordination_service is not None or task_type not in ("chief", "worker"):
        return
    spec = tf.train.ClusterSpec(cluster)
    context.configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(spec),
        coordinated_jobs=[
            coordination_config_pb2.CoordinatedJob(name=job, num_tasks=len(cluster[job]))
            for job in ("chief", "worker") if job in cluster],
        cluster_register_timeout_in_ms=int(timeout_seconds * 1000))
    context.coordination_service.cluster_register_with_barrier = True


# Each strategy gets its own range of collective group keys: TensorFlow's
# collective runtime remembers a group key's size for the life of the process,
# so two strategies of different sizes must never share one.
_COLLECTIVE_KEY_SPACING = 100_000
_collective_key_bases = itertools.count(1)


def own_collective_keys(strategy):
    """Gives `strategy`, before its `tf.distribute` `__init__` runs, a range
    of collective group keys no other strategy of this process uses (as
    `_collective_key_base`, which that `__init__` reads).

    Example:

    ```python
    class Owned(tf.distribute.MirroredStrategy):
        def __init__(self, devices):
            own_collective_keys(self)
            super().__init__(devices)
    ```
    """
    strategy._collective_key_base = next(_collective_key_bases) * _COLLECTIVE_KEY_SPACING


class MirroredStrategyOfItsOwnKeys(tf.distribute.MirroredStrategy):
    """A `tf.distribute.MirroredStrategy` over `devices` whose collectives
    share no group key with another strategy's (of another size).

    Example:

    ```python
    strategy = MirroredStrategyOfItsOwnKeys(["/device:CPU:0", "/device:CPU:1"])
    ```
    """

    def __init__(self, devices):
        own_collective_keys(self)
        super().__init__(devices)


def lost_peer(strategy, timeout_seconds: float = 2.0):
    """The first chief or worker task of a multi-worker `strategy`, other than
    this one, that is down or has restarted since this task first talked to
    it, as "worker:1 (TensorFlow's message)"; None when all answer, or for a
    strategy of one task. Asks each task's TensorFlow server (collective
    ops' peer health check), each for at most `timeout_seconds`.

    Example:

    ```python
    lost = lost_peer(strategy)   # e.g. "worker:1 (UnavailableError: ...)"
    ```
    """
    resolver = getattr(strategy, "cluster_resolver", None)
    spec = resolver.cluster_spec() if resolver is not None else None
    if not spec or not spec.jobs:
        return None
    own = (resolver.task_type, resolver.task_id)
    for job in ("chief", "worker"):
        for index in spec.task_indices(job) if job in spec.jobs else ():
            if (job, index) == own:
                continue
            try:
                eager_context.context().check_collective_ops_peer_health(
                    f"/job:{job}/replica:0/task:{index}", int(timeout_seconds * 1000))
            except (tf.errors.UnavailableError, tf.errors.FailedPreconditionError,
                    tf.errors.DeadlineExceededError) as error:
                return f"{job}:{index} ({type(error).__name__}: {error.message})"
    return None
