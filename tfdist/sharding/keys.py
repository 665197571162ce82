"""Keeping a Keras optimizer's variable keys valid when variables get new storage."""

import contextlib


@contextlib.contextmanager
def optimizer_keys_follow(model):
    """Renews the model's optimizer keys for variables whose storage the block swaps.

    Keras's TensorFlow optimizers key each variable by its storage (the
    `tf.Variable` behind the Keras variable). Partitioning or moving a
    variable gives it new storage, which the optimizer would no longer know.

    Example:

    ```python
    with optimizer_keys_follow(model):
        model.layers[0].kernel._value = new_storage
    model.optimizer.apply_gradients(...)   # still finds the kernel
    ```
    """
    optimizer = getattr(model, "optimizer", None)
    optimizers = []
    if optimizer is not None and optimizer.built:
        optimizers = [o for o in (optimizer, getattr(optimizer, "inner_optimizer", None))
                      if o is not None]
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
