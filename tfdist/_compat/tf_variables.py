"""Variable internals: a Keras variable's storage, and `tf.distribute`'s variables.

A Keras 3 variable on TensorFlow keeps its `tf.Variable` (a mirrored one under
a strategy) in `_value`; tfdist swaps that storage to move a variable onto
other devices or split it across replicas, keeping the Keras object itself.
Its sharded storage is a `tf.distribute` on-read variable, whose base class and
context checks are TensorFlow internals.
"""

from tensorflow.python.distribute import distribute_lib, values, values_util
from tensorflow.python.ops import resource_variable_ops

# The base of variables that hold one value per replica and are read across
# replicas (`tf.distribute`'s `SyncOnReadVariable`).
SyncOnReadVariable = values.SyncOnReadVariable
# One value per replica, as `strategy.run` returns them.
PerReplica = values.PerReplica
# A plain TensorFlow resource variable, created without the strategy's
# variable creator (which would mirror it).
ResourceVariable = resource_variable_ops.ResourceVariable


def storage_of(variable):
    """The TensorFlow variable behind a Keras variable (`variable._value`), or
    None for an object that has none.

    Example:

    ```python
    storage_of(model.layers[0].kernel)   # a MirroredVariable under a Strategy
    ```
    """
    return getattr(variable, "_value", None)


def set_storage(variable, storage):
    """Makes `storage` the TensorFlow variable behind the Keras `variable`.

    The Keras object (its identity, path, shape, and its place in layers and
    optimizers) is unchanged; reads and assigns go to `storage` from now on.

    Example:

    ```python
    set_storage(model.layers[0].kernel, tf.Variable(model.layers[0].kernel.value))
    ```
    """
    variable._value = storage


def distribute_strategy_of(variable):
    """The strategy a (distributed) TensorFlow variable was created under, or None.

    Example:

    ```python
    distribute_strategy_of(storage_of(model.layers[0].kernel)) is strategy   # True
    ```
    """
    return getattr(variable, "_distribute_strategy", None)


def in_cross_replica_context(strategy) -> bool:
    """Whether code runs across replicas of `strategy` (not in a replica, nor
    in a replica's update of a variable).

    Example:

    ```python
    in_cross_replica_context(strategy)   # True outside strategy.run
    ```
    """
    with distribute_lib.enter_or_assert_strategy(strategy):
        return (distribute_lib.in_cross_replica_context()
                and not values_util.in_replica_update_context())
