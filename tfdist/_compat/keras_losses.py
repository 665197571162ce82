"""Keras loss internals: a wrapped loss function's arguments, distribution scaling."""

from keras.src.losses import loss as loss_module


def loss_function_kwargs(loss) -> dict:
    """The keyword arguments a Keras `LossFunctionWrapper` passes its function
    (`from_logits`, `axis`, ...; its `_fn_kwargs`), or {} for other losses.

    Example:

    ```python
    loss_function_kwargs(keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # {'from_logits': True, 'ignore_class': None, 'axis': -1}
    ```
    """
    return getattr(loss, "_fn_kwargs", {})


def unscale_loss_for_distribution(loss):
    """A replica's loss as the whole batch's (Keras divides it by the replicas
    in sync for `tf.distribute`; this multiplies it back).

    Example:

    ```python
    tracker.update_state(unscale_loss_for_distribution(loss))
    ```
    """
    return loss_module.unscale_loss_for_distribution(loss)
