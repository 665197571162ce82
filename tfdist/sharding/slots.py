"""Finding a Keras optimizer's per-variable slots.

Keras optimizers keep the state of each variable they were built on in lists
aligned with those variables (`add_optimizer_variables`: Adam's momentums and
velocities, SGD's momentums, Adafactor's factors, ...). Whatever moves or
splits a variable's storage (pipeline placement, tensor parallelism, ZeRO)
treats its slots the same way, and finds them here.
"""

import keras
import tensorflow as tf

from tfdist._compat.keras_optimizer import iterations_variable, learning_rate_setting


def optimizer_slots(optimizer, variables, for_sharding=False, replicated=()):
    """(slot, variable index) of every per-variable slot of a built Keras (or
    tf_keras) optimizer.

    Args:
        optimizer: a built Keras optimizer (the inner one under a
            `LossScaleOptimizer`).
        variables: the variables it was built on, in its order
            (`trainable_variables_of(optimizer)`).
        for_sharding: only the slots to shard like their variable: those of
            their variable's shape, outside `replicated`; and any state of the
            optimizer that is neither such a slot, `replicated`, its iteration
            counter nor its learning rate is refused with a ValueError (it
            could not be sharded).
        replicated: with `for_sharding`, state every replica keeps whole.

    Example:

    ```python
    optimizer_slots(model.optimizer, trainable_variables_of(model.optimizer))
    # [(<m of kernel>, 0), (<m of bias>, 1), (<v of kernel>, 0), (<v of bias>, 1)]
    ```
    """
    skip = {id(v) for v in replicated} if for_sharding else set()
    found = {}
    for value in vars(optimizer).values():
        if not isinstance(value, (list, tuple)) or len(value) != len(variables):
            continue
        for i, (slot, variable) in enumerate(zip(value, variables)):
            if (isinstance(slot, (keras.Variable, tf.Variable)) and slot is not variable
                    and id(slot) not in skip
                    and (not for_sharding or slot.shape == variable.shape)):
                found[id(slot)] = (slot, i)
    if for_sharding:
        known = skip | {id(iterations_variable(optimizer)),
                        id(learning_rate_setting(optimizer))}
        for variable in optimizer.variables:
            if id(variable) not in found and id(variable) not in known:
                raise ValueError(
                    f"{type(optimizer).__name__} has state "
                    f"{getattr(variable, 'path', variable.name)!r} of shape "
                    f"{tuple(variable.shape)} that is not a per-variable slot, so "
                    f"tfdist cannot shard it; use zero=0.")
    return list(found.values())
