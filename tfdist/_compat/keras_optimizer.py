"""Keras optimizer internals: variables, slots, keys, and the per-call changes.

The gradient all-reduce, the slot lookup and `update_step` (traced once for
all of a variable's copies) are changed for the duration of one `apply`
call, which the replicas of one step trace together (in several threads):
the change is installed by the first replica to enter and removed by the
last to leave (`_shared_change`).
"""

import contextlib
import threading

import tensorflow as tf

from tfdist._compat.tf_function import ReplicaSharedFunction

_lock = threading.Lock()
_depth = {}


@contextlib.contextmanager
def _shared_change(key, install, uninstall):
    """Runs `install()` when the first holder of `key` enters and
    `uninstall()` when the last one leaves (thread-safe, reference-counted)."""
    with _lock:
        depth = _depth.get(key, 0)
        if depth == 0:
            install()
        _depth[key] = depth + 1
    try:
        yield
    finally:
        with _lock:
            _depth[key] -= 1
            if _depth[key] == 0:
                del _depth[key]
                uninstall()


def _attribute_while_in_effect(target, name, value):
    """`target.name = value` (an instance attribute over its class's) while
    any holder is in the returned context (`_shared_change`)."""
    return _shared_change((name, id(target)), lambda: setattr(target, name, value),
                          lambda: delattr(target, name))


def gradients_already_reduced(optimizer):
    """Turns off a Keras optimizer's own gradient all-reduce while in effect.

    Keras's TensorFlow optimizer sums gradients across replicas in
    `_all_reduce_sum_gradients` before applying them. tfdist reduces them
    itself (once per step, and differently under ZeRO), so for the apply call
    it makes that method the identity on the optimizer that applies (for a
    `LossScaleOptimizer`, its inner optimizer).

    Example:

    ```python
    with gradients_already_reduced(model.optimizer):
        model.optimizer.apply_gradients(zip(reduced, model.trainable_weights))
    ```
    """
    target = getattr(optimizer, "inner_optimizer", optimizer)
    return _attribute_while_in_effect(target, "_all_reduce_sum_gradients", list)


def update_steps_traced_once(optimizer):
    """Makes a Keras optimizer trace each variable's update once for all its
    copies while in effect, not once per device.

    Under a `MirroredStrategy` Keras's TensorFlow optimizer runs
    `update_step(gradient, variable, learning_rate)` for each copy of each
    variable, each on its device (`extended.update`): Adam's update of a
    variable traced 4 times on 4 devices. Here each variable's update is a
    `ReplicaSharedFunction`: traced for its first copy, called for every copy
    with that copy's variables (for a `LossScaleOptimizer`, on its inner
    optimizer).

    Example:

    ```python
    with update_steps_traced_once(model.optimizer):
        model.optimizer.apply_gradients(zip(reduced, model.trainable_weights))
    ```
    """
    target = getattr(optimizer, "inner_optimizer", optimizer)
    shared = target.__dict__.setdefault("_tfdist_update_steps", {})

    def traced_once(gradient, variable, learning_rate):
        key = target._var_key(variable)
        if key not in shared:  # traced on the first copy; each copy's own swapped in
            shared[key] = shared_update_step(target, variable)
        return shared[key](gradient, tf.convert_to_tensor(learning_rate))

    return _attribute_while_in_effect(target, "update_step", traced_once)


def shared_update_step(optimizer, variable):
    """The optimizer's own `update_step` of `variable` (its class's, whatever
    is installed on the instance) as a function of the gradient and the
    learning rate, traced once for all of `variable`'s copies
    (`ReplicaSharedFunction`): `variable` is the copy it is traced on.

    Example:

    ```python
    update = shared_update_step(optimizer, variable)
    update(gradient, learning_rate)   # optimizer.update_step(gradient, copy, lr)
    ```
    """
    update_step = type(optimizer).update_step
    return ReplicaSharedFunction(lambda gradient, learning_rate: update_step(
        optimizer, gradient, variable, learning_rate))


def slots_found_by(optimizer, buffers, indices):
    """Makes `optimizer` find each buffer's slots: those of variable `indices[k]`.

    Keras's `update_step` looks its slots up by the variable it updates (its
    key in `_trainable_variables_indices`); ZeRO's update runs it on shard
    buffers, which must find the slots of the variable they are a shard of.

    Example:

    ```python
    with slots_found_by(inner, buffers, indices):
        inner.update_step(gradient_shard, buffers[0], learning_rate)
    ```
    """
    table = optimizer._trainable_variables_indices
    # (A buffer that is the variable's own storage, zero=3's, is known already.)
    keys = {key: i for key, i in ((optimizer._var_key(b), i) for b, i in zip(buffers, indices))
            if key not in table}

    def uninstall():
        # A new dict, not `pop`: the table is a trackable `_DictWrapper`, which
        # a deletion leaves unsaveable (`tf.train.Checkpoint` refuses it).
        optimizer._trainable_variables_indices = {
            key: i for key, i in table.items() if key not in keys}

    return _shared_change(("slots", id(optimizer)), lambda: table.update(keys), uninstall)


def trainable_variables_of(optimizer):
    """The variables a built Keras optimizer updates, in its own order.

    Keras keeps them in `_trainable_variables`; the optimizer's slot lists and
    variable indices follow this order.

    Example:

    ```python
    variables = trainable_variables_of(model.optimizer)   # [kernel, bias, ...]
    ```
    """
    return optimizer._trainable_variables


def variable_index(optimizer, variable) -> int:
    """The position of `variable` in the optimizer's variables (and slot lists).

    Keras's `_get_variable_index`, which looks the variable up by its key.

    Example:

    ```python
    variable_index(model.optimizer, model.layers[0].kernel)   # 0
    ```
    """
    return optimizer._get_variable_index(variable)


def clip_gradients(optimizer, gradients):
    """`gradients` clipped as the optimizer's `clipnorm` / `clipvalue` /
    `global_clipnorm` ask (Keras's `_clip_gradients`, which `apply` runs).

    Example:

    ```python
    gradients = clip_gradients(model.optimizer, gradients)
    ```
    """
    return optimizer._clip_gradients(gradients)


def uses_weight_decay(optimizer, variable) -> bool:
    """Whether the optimizer decays `variable` (Keras's `_use_weight_decay`:
    not excluded by `exclude_from_weight_decay`).

    Example:

    ```python
    uses_weight_decay(keras.optimizers.AdamW(), model.layers[0].kernel)   # True
    ```
    """
    return optimizer._use_weight_decay(variable)


def iterations_variable(optimizer):
    """The variable counting the optimizer's applied steps (`_iterations`).

    The public `iterations` is that variable only without gradient
    accumulation (with it, a tensor: applied steps over accumulation steps).

    Example:

    ```python
    iterations_variable(model.optimizer).assign_add(1)
    ```
    """
    return optimizer._iterations


def learning_rate_setting(optimizer):
    """What the optimizer was given as learning rate: its variable, or the
    schedule (callable) it evaluates each step (Keras's `_learning_rate`).

    Example:

    ```python
    callable(learning_rate_setting(model.optimizer))   # True for a schedule
    ```
    """
    return getattr(optimizer, "_learning_rate", None)


def skip_non_finite_step(loss_scale_optimizer):
    """The function a `LossScaleOptimizer` runs for a step whose gradients are
    not finite: halves the loss scale and resets its counter (Keras's
    `_stateful_handle_non_finite_grads`).

    Example:

    ```python
    tf.cond(finite, apply, skip_non_finite_step(model.optimizer))
    ```
    """
    return loss_scale_optimizer._stateful_handle_non_finite_grads


def adafactor_factors(optimizer, index):
    """`(r, c, v)` of variable `index` of a built Keras `Adafactor`: its row
    and column second-moment factors (scalar placeholders below rank 2) and
    its unfactored second moment.

    Example:

    ```python
    r, c, v = adafactor_factors(optimizer, 0)
    ```
    """
    return optimizer._r[index], optimizer._c[index], optimizer._v[index]


def adafactor_row_and_column_factors(optimizer):
    """Every `r` and `c` factor of a built Keras `Adafactor` (None where a
    variable has none).

    Example:

    ```python
    [f for f in adafactor_row_and_column_factors(optimizer) if f is not None]
    ```
    """
    return list(optimizer._r) + list(optimizer._c)


@contextlib.contextmanager
def keys_follow_storage(optimizers):
    """Re-keys `optimizers` for variables whose storage the block swaps.

    Keras's TensorFlow optimizers key each variable by its storage (`_var_key`:
    the `tf.Variable` behind the Keras variable) in `_trainable_variables_indices`
    and `_exclude_from_weight_decay`; after the block the old keys are renamed
    to the new ones and the weight-decay cache is cleared.

    Example:

    ```python
    with keys_follow_storage([model.optimizer]):
        set_storage(model.layers[0].kernel, new_storage)
    ```
    """
    before = [{id(v): o._var_key(v) for v in o._trainable_variables} for o in optimizers]
    yield
    for o, keys in zip(optimizers, before):
        renamed = {keys[id(v)]: o._var_key(v) for v in o._trainable_variables}
        o._trainable_variables_indices = {
            renamed.get(key, key): index
            for key, index in o._trainable_variables_indices.items()}
        excluded = getattr(o, "_exclude_from_weight_decay", None)
        if excluded:
            o._exclude_from_weight_decay = {renamed.get(k, k) for k in excluded}
        o.__dict__.pop("_exclude_from_weight_decay_cache", None)
