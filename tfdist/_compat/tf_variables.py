"""Variable internals: a Keras variable's storage, and `tf.distribute`'s variables.

A Keras 3 variable on TensorFlow keeps its `tf.Variable` (a mirrored one under
a strategy) in `_value`; tfdist swaps that storage to move a variable onto
other devices or split it across replicas, keeping the Keras object itself.
Its sharded storage is a `tf.distribute` on-read variable, whose base class and
context checks are TensorFlow internals.
"""

import tensorflow as tf
from keras import initializers
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


def keras_zeros(initial_value):
    """The shape and dtype of the Keras variable whose `tf.Variable` gets
    `initial_value`, when that is Keras's deferred call of a `Zeros`
    initializer (`Variable._initialize_with_initializer`: every optimizer slot
    of Adam or SGD's momentum, most biases), else None. Zeros are the same on
    every task and in every shard: such a variable can be made shard by
    shard, with no whole value and nothing broadcast.

    Example:

    ```python
    zeros = keras_zeros(kwargs["initial_value"])   # in a variable creator: (shape, dtype)
    ```
    """
    qualified = getattr(initial_value, "__qualname__", "")
    if not qualified.endswith("._initialize_with_initializer.<locals>.<lambda>"):
        return None
    cells = dict(zip(initial_value.__code__.co_freevars, initial_value.__closure__ or ()))
    initializer, variable = cells.get("initializer"), cells.get("self")
    if initializer is None or variable is None:
        return None
    if type(initializer.cell_contents) is not initializers.Zeros:
        return None
    variable = variable.cell_contents
    return tf.TensorShape(variable.shape), tf.as_dtype(variable.dtype)
