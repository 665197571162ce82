"""TensorFlow collective internals: a strategy's per-replica launchers.

`MirroredStrategy` and `MultiWorkerMirroredStrategy` communicate through
`CollectiveAllReduce`, which keeps one `CollectiveReplicaLauncher` per local
replica (its group, device, instance keys and ordering token). tfdist issues
its own collectives (all-to-all, subgroup all-gathers) through launchers so
that they order with the strategy's.
"""

import itertools

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops, cross_device_utils
from tensorflow.python.eager import context
from tensorflow.python.framework import errors
from tensorflow.python.ops import gen_collective_ops

from tfdist._compat.tf_function import caller_value, sharing_a_trace


def abort_collectives(message: str):
    """Fails every pending and future collective op of this process with a
    `DeadlineExceededError` carrying `message` (the eager context's
    `abort_collective_ops`, as TensorFlow's own peer health check does). The
    process must restart to communicate again.

    Example:

    ```python
    abort_collectives("worker:1 did not join step 12 within 300 s")
    ```
    """
    context.context().abort_collective_ops(errors.DEADLINE_EXCEEDED, message)


def strategy_launcher(extended, local: int):
    """The strategy's collective launcher of its `local`-th replica on this task.

    Raises NotImplementedError for a strategy that does not communicate with
    collective ops.

    Example:

    ```python
    strategy_launcher(strategy.extended, 0)
    ```
    """
    collectives = extended._cross_device_ops
    if not isinstance(collectives, cross_device_ops.CollectiveAllReduce):
        raise NotImplementedError(
            f"tfdist's collectives (ZeRO's reduce-scatter, tfdist.batch_statistics) need a "
            f"strategy that communicates with collective ops (tfdist's strategies, "
            f"MultiWorkerMirroredStrategy), not {type(collectives).__name__}.")
    return collectives._launchers[local]


def launcher_options(launcher):
    """The `CommunicationOptions` a launcher runs its collectives with.

    Example:

    ```python
    launcher_options(strategy_launcher(strategy.extended, 0)).timeout_seconds
    ```
    """
    return launcher._options


def group_launcher(keys, group, device, own=None, options=None):
    """A launcher for the devices `group` on `device`, ordered with the
    strategy's `own` launcher there if given (sharing its ordering token),
    else with an ordering token of its own and `options`.

    Example:

    ```python
    group_launcher(collective_keys(extended), devices[:2], devices[0],
                   own=strategy_launcher(extended, 0))
    ```
    """
    launcher = cross_device_utils.CollectiveReplicaLauncher(
        keys.get_group_key(group), len(group), keys, device,
        own._options if own else options)
    if own is not None:
        launcher._ordering_token = own._ordering_token
    return launcher


class CallerLauncher(cross_device_utils.CollectiveReplicaLauncher):
    """The launcher of a trace every replica shares (`ReplicaSharedFunction`):
    its collectives take the calling replica's launcher's group key, instance
    keys and ordering token (`resolve()`, evaluated in the caller's trace at
    each call) as inputs of the call, and run on the call's device.

    Only inside a shared trace (`caller_value`), or the backward function
    TensorFlow builds for it (a custom gradient's collectives): each graph
    takes its own inputs. Launchers whose resolved launchers share an
    ordering token (a tensor group's and a data group's with the strategy's)
    take it as one input, so that their collectives stay in one order.

    Example:

    ```python
    launcher = CallerLauncher("tensor", lambda: launchers[mesh.replica()])
    launcher.all_reduce(x)   # each caller's own group and keys
    ```
    """

    def __init__(self, name: str, resolve):
        # Not the base class's __init__, which makes an ordering token.
        traced = resolve()
        self._group_size = traced._group_size
        self._options = traced._options
        self._collective_keys = None
        self._device = None  # the call's
        self._name = name
        self._resolve = resolve
        self._token_name = f"ordering_token/{id(traced._ordering_token)}"

    @property
    def _group_key(self):  # an input of the graph being built
        return caller_value(f"{self._name}/group_key",
                            lambda: tf.constant(self._resolve()._group_key, tf.int32), tf.int32)

    def _next_instance_key(self):  # one input per collective
        return caller_value(f"instance_key/{next(_INSTANCE_KEYS)}",
                            lambda: self._resolve()._next_instance_key(), tf.int32,
                            each_call=True)

    def _get_ordering_token(self):
        return caller_value(self._token_name,
                            lambda: self._resolve()._get_ordering_token(), tf.resource)


_INSTANCE_KEYS = itertools.count()  # names of a shared trace's instance-key inputs


def own_or_caller_launcher(name: str, own):
    """The current replica's launcher `own()`, or, in a trace the replicas
    share, a `CallerLauncher` of it whose keys and ordering token each caller
    gives.

    Example:

    ```python
    launcher = own_or_caller_launcher("data", lambda: launchers[mesh.replica()])
    ```
    """
    return CallerLauncher(name, own) if sharing_a_trace() else own()


def launcher_device(launcher) -> str:
    """The device a launcher's collectives run on.

    Example:

    ```python
    with tf.device(launcher_device(launcher)):
        total = tf.reduce_sum(all_to_all(launcher, rows), axis=0)
    ```
    """
    return launcher._device


def launcher_group_size(launcher) -> int:
    """How many replicas a launcher's collectives span.

    Example:

    ```python
    whole_bytes = shard_bytes * launcher_group_size(launcher)   # what a gather returns
    ```
    """
    return launcher._group_size


def all_gather(launcher, tensor, options=None):
    """`tensor` of every replica of the launcher's group (all of one shape),
    concatenated along the first axis in group order (the launcher's
    `_all_gather`).

    TensorFlow's gather of a tensor with no elements crashes the process (an
    empty microbatch's logits, say): unless its shape says it is not empty,
    each replica sends its elements and one more, dropped from what it receives.

    Example:

    ```python
    all_gather(launcher, row[tf.newaxis])   # (group size, m)
    ```
    """
    if tensor.shape.is_fully_defined() and tensor.shape.num_elements():
        return launcher._all_gather(tensor, options)
    sent = tf.concat([tf.reshape(tensor, [-1]), tf.zeros([1], tensor.dtype)], 0)
    received = tf.reshape(launcher._all_gather(sent, options), [launcher._group_size, -1])
    shape = tf.concat([[-1], tf.shape(tensor)[1:]], 0)
    gathered = tf.reshape(received[:, :-1], shape)
    first = tensor.shape[0]
    gathered.set_shape([None if first is None else first * launcher._group_size,
                        *tensor.shape[1:]])
    return gathered


def all_to_all(launcher, rows):
    """Row r of `rows` (shape `(N, m)`) sent to replica r of the launcher's
    group; returns the N rows received, row s from replica s.

    TensorFlow has no public all-to-all: this issues the collective op with
    the launcher's keys, ordering token and options.

    Example:

    ```python
    received = all_to_all(launcher, tf.reshape(gradient, (4, -1)))
    ```
    """
    options = launcher._options
    token = launcher._get_ordering_token()
    with tf.device(launcher._device):
        return gen_collective_ops.collective_all_to_all_v2(
            rows,
            group_size=launcher._group_size,
            group_key=launcher._group_key,
            instance_key=launcher._next_instance_key(),
            ordering_token=[] if token is None else [token],
            communication_hint=options.implementation.value,
            timeout_seconds=options.timeout_seconds or 0,
        )


def all_gather_slices(launcher, slices):
    """Every replica's `tf.IndexedSlices` of the launcher's group, concatenated
    in group order: the same slices, in the same order, as `tf.distribute`'s
    all-reduce gives (`CollectiveReplicaLauncher.all_reduce_indexed_slices`).

    Values and indices are gathered as they are when the trace knows how many
    slices there are (the same number on every replica: the replicas run one
    program on inputs of one shape, and a gather of unequal shapes fails);
    else padded to the longest, gathered with their numbers, and the padding
    dropped. TensorFlow's own traces a `tf.cond` between the two, with both
    branches' collectives, on every replica: half of a data-parallel step's
    trace for a model with an Embedding at data=8.

    Example:

    ```python
    gathered = all_gather_slices(mesh.data_launcher(), embedding_gradient)
    ```
    """
    options = launcher._options
    with tf.device(launcher._device):
        if slices.indices.shape[0] is not None:
            return tf.IndexedSlices(all_gather(launcher, slices.values, options),
                                    all_gather(launcher, slices.indices, options),
                                    slices.dense_shape)
        counts = all_gather(launcher, tf.shape(slices.indices)[:1], options)
        longest = tf.reduce_max(counts)

        def gathered_padded(tensor):
            rows = [[0, longest - tf.shape(tensor)[0]]]
            padding = tf.concat([rows, tf.zeros([tf.rank(tensor) - 1, 2], tf.int32)], 0)
            return all_gather(launcher, tf.pad(tensor, padding), options)

        values = gathered_padded(slices.values)
        indices = gathered_padded(slices.indices)
        sent = tf.reshape(tf.sequence_mask(counts, longest), [-1])
        return tf.IndexedSlices(tf.boolean_mask(values, sent), tf.boolean_mask(indices, sent),
                                slices.dense_shape)
