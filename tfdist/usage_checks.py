"""Checks of how a strategy is used, failing early with a message saying what to do.

TensorFlow reports these mistakes late and obscurely (an `AssertionError` or
"Mixing different tf.distribute.Strategy objects" from inside the optimizer, a
bare `StopIteration` from the input pipeline); the strategies call these
checks where they first see the model and the data.
"""

import tensorflow as tf

from tfdist._compat.tf_variables import distribute_strategy_of


def check_built_in_scope(model, strategy):
    """Raises if none of `model`'s trainable variables belongs to `strategy`.

    That is the mark of a model built (its layers' weights created) outside
    `strategy.scope()` and then trained under it.

    Example:

    ```python
    with strategy.scope():
        model = build_model()          # weights created here: passes
    check_built_in_scope(model, strategy)
    ```
    """
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        return  # its variables are placed on the ps tasks, not all wrapped
    variables = [getattr(v, "value", v) for v in model.trainable_variables]
    if variables and not any(distribute_strategy_of(v) is strategy
                             for v in variables):
        raise ValueError(
            f"Model {model.name!r} was built outside `strategy.scope()`, so its "
            f"weights are not distributed by this {type(strategy).__name__}. Build "
            f"(create the layers and weights of) and compile the model inside the "
            f"scope:\n\n    with strategy.scope():\n        model = build_model()\n"
            f"        model.compile(...)\n    model.fit(...)")


def check_not_empty(dataset: tf.data.Dataset):
    """Raises if `dataset` is known to have no elements (cardinality 0).

    A dataset whose size TensorFlow cannot know before reading it (after a
    `filter`, say) is not checked.

    Example:

    >>> check_not_empty(tf.data.Dataset.range(0))
    Traceback (most recent call last):
    ...
    ValueError: The dataset is empty (0 batches)...
    """
    if int(dataset.cardinality()) == 0:
        raise ValueError(
            "The dataset is empty (0 batches): there is nothing to train or "
            "evaluate on. Check the data given to `fit`/`evaluate`/`predict` (an "
            "empty array, a file pattern matching no file, `take(0)`, or a batch "
            "size larger than the data with `drop_remainder=True`).")
