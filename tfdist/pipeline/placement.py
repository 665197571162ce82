"""Moving a built model's stage variables (and their optimizer slots) to the
stage's devices.

Each data replica r runs stage s on device `mesh[r][s]`. A stage's variables
are mirrored across the data axis on exactly those devices: the strategy's own
mirrored-variable creator makes them, told (through its `colocate_with`
argument, which carries a device list) to use the stage's devices instead of
the replicas'. Inside replica r a read gives the copy on `mesh[r][s]`.

Keras variables keep their identity, path and value: only their storage moves,
so saving, loading and the optimizer's bookkeeping are unchanged.
"""

import tensorflow as tf

from tfdist._compat.keras_optimizer import trainable_variables_of
from tfdist._compat.tf_variables import set_storage
from tfdist.sharding.keys import optimizer_keys_follow
from tfdist.sharding.slots import optimizer_slots
from tfdist.sharding.storage import ShardedStorage, axis_layout


class _OnDevices:
    """What `MirroredExtended._create_variable` reads from `colocate_with`."""

    def __init__(self, devices):
        self._devices = tuple(devices)


def mirrored_copy(variable, devices, strategy):
    """A new TensorFlow variable mirrored on `devices` (one per replica),
    holding the Keras `variable`'s value, of its kind.

    Example:

    ```python
    copy = mirrored_copy(embedding.embeddings, ["/device:CPU:1", "/device:CPU:3"], strategy)
    ```
    """
    old = variable.value

    def on_devices(next_creator, **kwargs):
        kwargs["colocate_with"] = _OnDevices(devices)
        return next_creator(**kwargs)

    with strategy.scope(), tf.variable_creator_scope(on_devices):
        return tf.Variable(
            tf.convert_to_tensor(old), name=variable.name, dtype=old.dtype,
            trainable=old.trainable, synchronization=old.synchronization,
            aggregation=old.aggregation)


def split_like(variable, copy, strategy):
    """`copy` (a `mirrored_copy` of `variable`), split as tensor groups split
    `variable` since (a `ShardedStorage` of its layout on `copy`'s devices),
    or `copy` itself when `variable` is whole.

    Example:

    ```python
    copy = split_like(embedding.embeddings, copy, strategy)   # (V/t, d) per device
    ```
    """
    layout = axis_layout(variable)
    if layout is None:
        return copy
    return ShardedStorage.create(strategy, layout, tf.convert_to_tensor(variable.value),
                                 name=variable.name, dtype=variable.dtype, trainable=True,
                                 devices=[c.device for c in copy.values])


def move_variable(variable, devices, strategy):
    """Re-creates a Keras variable's storage mirrored on `devices`, same value.

    Example:

    ```python
    move_variable(model.layers[1].kernel, ["/device:CPU:1", "/device:CPU:3"], strategy)
    ```
    """
    set_storage(variable, mirrored_copy(variable, devices, strategy))


def place_stages(model, stages, stage_devices, strategy) -> dict:
    """Moves every stage's variables, and the optimizer slots of its trainable
    ones, onto that stage's devices (`stage_devices[s]`, one per replica).
    Returns the copies of tied layers' weights on the last stage's devices,
    by `id` of the Keras variable (the first stage holds the variable).

    Example:

    ```python
    place_stages(model, plan_stages(model, 2), [["CPU:0", "CPU:2"], ["CPU:1", "CPU:3"]],
                 strategy)
    ```
    """
    with tf.init_scope():
        copies = {id(v): mirrored_copy(v, stage_devices[stage.index], strategy)
                  for stage in stages for layer in stage.tied for v in layer.trainable_weights}
        where = {}
        with optimizer_keys_follow(model):
            for stage, devices in zip(stages, stage_devices):
                for variable in stage.variables:
                    move_variable(variable, devices, strategy)
                    where[id(variable)] = devices
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            inner = getattr(optimizer, "inner_optimizer", optimizer)
            trainable = trainable_variables_of(inner)
            for slot, index in optimizer_slots(inner, trainable):
                if id(trainable[index]) in where:
                    move_variable(slot, where[id(trainable[index])], strategy)
    return copies


def component_devices(variable):
    """The devices holding a (mirrored) Keras variable's copies.

    Example:

    ```python
    component_devices(model.layers[1].kernel)   # ['/job:localhost/.../CPU:1', ...]
    ```
    """
    value = variable.value
    return [v.device for v in getattr(value, "values", (value,))]
