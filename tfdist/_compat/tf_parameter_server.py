"""Parameter-server strategy internals: Keras 3 variables on ps tasks.

`tf.distribute`'s `ParameterServerStrategyV2` creates and updates variables in
its `extended` object, whose hooks (`_create_variable`, `_update`) and
counters are private; tfdist's `ParameterServerStrategy` replaces that object's
class with one that serves Keras 3 variables, and lets the chief run Keras's
own evaluate and predict functions.
"""

import contextlib
import time

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import parameter_server_strategy_v2, sharded_variable
from tensorflow.python.distribute.coordinator import cluster_coordinator

_RESULT_POLL_SECONDS = 0.01


def serve_keras_variables(strategy):
    """Makes the `extended` of a parameter-server `strategy` serve Keras 3
    variables (`_KerasPartitionedVariables`): a per-object class swap, listed
    in `tfdist._compat.patches`.

    Example:

    ```python
    serve_keras_variables(strategy)   # right after ParameterServerStrategy.__init__
    ```
    """
    strategy.extended.__class__ = _KerasPartitionedVariables


def is_worker_failure(error) -> bool:
    """Whether `error`, raised to the chief during training, means a lost
    worker by TensorFlow's coordinator's reckoning (an unreachable worker
    task), and not a lost parameter server.

    Example:

    ```python
    is_worker_failure(error)   # True: UNAVAILABLE from /job:worker/replica:0/task:1
    ```
    """
    return cluster_coordinator._is_worker_failure(error) and not is_ps_failure(error)


def is_ps_failure(error) -> bool:
    """Whether `error`, raised to the chief during training, means a lost
    parameter server: one TensorFlow's coordinator counts as a ps failure (an
    unreachable task, or one restarted on the same address), or a variable
    looked up on a ps that no longer holds it (a restarted one holds none).

    Example:

    ```python
    is_ps_failure(error)   # True: "Unable to find the relevant tensor remote_handle" from /job:ps
    ```
    """
    if cluster_coordinator._is_ps_failure(error):
        return True
    return isinstance(error, (tf.errors.NotFoundError, tf.errors.FailedPreconditionError)) and (
        cluster_coordinator._RPC_ERROR_FROM_PS in str(error))


def num_workers(extended) -> int:
    """Worker tasks in a parameter-server strategy's cluster.

    Example:

    ```python
    num_workers(strategy.extended)   # 2
    ```
    """
    return extended._num_workers


def num_ps(extended) -> int:
    """Ps tasks in a parameter-server strategy's cluster.

    Example:

    ```python
    num_ps(strategy.extended)   # 1
    ```
    """
    return extended._num_ps


def wait_for_result(remote_value, seconds: float) -> bool:
    """Waits up to `seconds` for a scheduled function's `RemoteValue` to have
    its result (or error) on the chief; whether it has (`fetch()` then
    returns at once).

    The value's own event is set when the function is sent to a worker, not
    when it has run: the coordinator's thread for that worker then copies the
    result to the chief holding the value's lock, and a `fetch()` meanwhile
    waits for that lock, forever if the worker froze after taking the
    function. So the result is there once that copy is made (or the value
    holds an error, or was aborted).

    Example:

    ```python
    while not wait_for_result(remote_value, 1.0):
        monitor.check()
    logs = remote_value.fetch()
    ```
    """
    deadline = time.monotonic() + seconds
    while remote_value._status_available_event.wait(max(0.0, deadline - time.monotonic())):
        if remote_value._error is not None or remote_value._has_fetched_to_local:
            return True  # (an aborted value holds its error too)
        if time.monotonic() >= deadline:
            return False
        time.sleep(_RESULT_POLL_SECONDS)  # sent, not yet copied
    return False


@contextlib.contextmanager
def running_without_coordinator(extended):
    """Lets the chief run a step function itself, not through the coordinator
    (`_allow_run_without_coordinator`), for the duration of the block.

    Example:

    ```python
    with running_without_coordinator(strategy.extended):
        logs = model.test_function(iterator)
    ```
    """
    allowed = extended._allow_run_without_coordinator
    extended._allow_run_without_coordinator = True
    try:
        yield
    finally:
        extended._allow_run_without_coordinator = allowed


class _KerasPartitionedVariables(parameter_server_strategy_v2.ParameterServerStrategyV2Extended):
    """The parent's `extended`, made to serve Keras 3 partitioned variables.

    - An optimizer slot of a partitioned variable is partitioned like it
      (the parent would put a slot "colocated" with it on the chief).
    - A partitioned variable converts to a NumPy array (Keras's weight files
      save it whole).
    - Keras 3 optimizers update every variable as one: a partitioned one is
      updated where the step runs, its reads and writes going to each shard's
      ps task.
    """

    def _create_variable(self, next_creator, **kwargs):
        if isinstance(kwargs.get("colocate_with"), sharded_variable.ShardedVariable):
            del kwargs["colocate_with"]
        variable = super()._create_variable(next_creator, **kwargs)
        if isinstance(variable, sharded_variable.ShardedVariable):
            return PartitionedVariable(variable.variables, name=variable.name)
        return variable

    def _update(self, var, fn, args, kwargs, group):
        if not isinstance(var, sharded_variable.ShardedVariable):
            return super()._update(var, fn, args, kwargs, group)
        result = fn(var, *self._select_single_value(args), **self._select_single_value(kwargs))
        return result if group else tf.nest.map_structure(self._local_results, result)


class PartitionedVariable(sharded_variable.ShardedVariable):
    """A variable split along its first axis across ps tasks, as one array.

    Example:

    ```python
    np.asarray(model.layers[0].embeddings)   # the whole table, from every shard
    ```
    """

    def __array__(self, dtype=None):
        return np.asarray(self.numpy(), dtype=dtype)


