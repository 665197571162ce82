"""The loss of a classifier split by classes: sharded softmax cross-entropy.

A final Dense split by output classes over a tensor group (the `Classifier`
layout of `tfdist.tensor.layouts`) leaves each rank its slice of the logits
inside `sharded_logits()` (tfdist's training step), and
`ShardedSoftmaxCrossEntropy` turns the slices into the loss without ever
assembling them. Outside `sharded_logits()` the classifier gathers its logits
and the loss is the one it replaces.

Example:

```python
with sharded_logits():                       # in the training step
    logits = model(x, training=True)         # (..., classes / t) per rank
    loss = ShardedSoftmaxCrossEntropy(mesh, fallback)(y, logits)
```
"""

import contextlib
import threading

import keras
import tensorflow as tf

from tfdist._compat.keras_losses import loss_function_kwargs

_logits = threading.local()  # per replica thread: are logits left sharded?


@contextlib.contextmanager
def sharded_logits():
    """Inside it (tfdist's training step), a layer split by classes
    (`tfdist.tensor.layouts.Classifier`) returns this rank's slice of the
    logits instead of gathering them.

    Example:

    ```python
    with sharded_logits():
        logits = model(x, training=True)      # (..., classes / t) per rank
    ```
    """
    previous = getattr(_logits, "sharded", False)
    _logits.sharded = True
    try:
        yield
    finally:
        _logits.sharded = previous


def logits_are_sharded():
    """Whether the current replica thread is inside `sharded_logits()`.

    Example:

    ```python
    with sharded_logits():
        logits_are_sharded()   # True
    ```
    """
    return getattr(_logits, "sharded", False)


class ShardedSoftmaxCrossEntropy(keras.losses.Loss):
    """Sparse softmax cross-entropy of logits split by class over a tensor group.

    Each rank holds logits for classes [r·V/t, (r+1)·V/t). The log-sum-exp is
    assembled from each rank's sum of exponentials (and the group's maximum,
    for range), the true class's logit from the rank that owns it: two
    all-reduces of one value per example, never the logits. The gradient on
    each rank is its slice of softmax − one-hot. Outside `sharded_logits()`
    it is the loss it replaces (`fallback`), with its reduction and weights.

    Example:

    ```python
    loss = ShardedSoftmaxCrossEntropy(mesh, keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    ```
    """

    def __init__(self, mesh, fallback):
        super().__init__(name=fallback.name, reduction=fallback.reduction,
                         dtype=fallback.dtype)
        self.mesh = mesh
        self.fallback = fallback

    def call(self, y_true, y_pred):
        if not logits_are_sharded() or self.mesh.rank() is None:
            return self.fallback.call(y_true, y_pred)
        mesh = self.mesh
        width = y_pred.shape[-1]
        labels = tf.cast(y_true, tf.int32)
        if labels.shape.rank == y_pred.shape.rank:
            labels = tf.squeeze(labels, -1)
        local_max = tf.stop_gradient(tf.reduce_max(y_pred, axis=-1, keepdims=True))
        top = tf.reduce_max(mesh.gather_last(local_max), axis=-1, keepdims=True)
        exp_sum = mesh.reduce(tf.reduce_sum(tf.exp(y_pred - top), axis=-1))
        own = labels - mesh.rank() * width
        hot = tf.one_hot(tf.where((own >= 0) & (own < width), own, -1), width,
                         dtype=y_pred.dtype)  # all zeros where another rank owns it
        true_logit = mesh.reduce(tf.reduce_sum(y_pred * hot, axis=-1))
        return tf.math.log(exp_sum) + tf.squeeze(top, -1) - true_logit


def is_sparse_softmax_loss(loss):
    """Whether a Keras loss is sparse categorical cross-entropy on logits (last
    axis, no ignored class): the one a sharded classifier can compute.

    Example:

    ```python
    is_sparse_softmax_loss(
        keras.losses.SparseCategoricalCrossentropy(from_logits=True))   # True
    ```
    """
    kwargs = loss_function_kwargs(loss)
    return (getattr(loss, "fn", None) is keras.losses.sparse_categorical_crossentropy
            and kwargs.get("from_logits") and kwargs.get("ignore_class") is None
            and kwargs.get("axis", -1) == -1)
