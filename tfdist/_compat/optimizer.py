"""Keras optimizer internals: the gradient all-reduce and the slot lookup.

Both are changed for the duration of one `apply` call, which the replicas of
one step trace together (in several threads): the change is installed by the
first replica to enter and removed by the last to leave (`_shared_change`).
"""

import contextlib
import threading

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

    def install():
        target._all_reduce_sum_gradients = list

    def uninstall():
        del target._all_reduce_sum_gradients

    return _shared_change(("reduced", id(target)), install, uninstall)


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
    keys = {optimizer._var_key(b): i for b, i in zip(buffers, indices)}
    table = optimizer._trainable_variables_indices

    def uninstall():
        for key in keys:
            table.pop(key, None)

    return _shared_change(("slots", id(optimizer)), lambda: table.update(keys), uninstall)
