"""Keeping a Keras optimizer's variable keys valid when variables get new storage."""

from tfdist._compat.keras_optimizer import keys_follow_storage


def optimizer_keys_follow(model):
    """Renews the model's optimizer keys for variables whose storage the block swaps.

    Keras's TensorFlow optimizers key each variable by its storage (the
    `tf.Variable` behind the Keras variable). Partitioning or moving a
    variable gives it new storage, which the optimizer would no longer know.

    Example:

    ```python
    with optimizer_keys_follow(model):
        set_storage(model.layers[0].kernel, new_storage)
    model.optimizer.apply_gradients(...)   # still finds the kernel
    ```
    """
    optimizer = getattr(model, "optimizer", None)
    optimizers = []
    if optimizer is not None and optimizer.built:
        optimizers = [o for o in (optimizer, getattr(optimizer, "inner_optimizer", None))
                      if o is not None]
    return keys_follow_storage(optimizers)
