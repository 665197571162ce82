"""tfdist's step for tf_keras (Keras 2) models, such as the Model Garden's.

A compiled tf_keras model run with `strategy.train_step(model)` (an orbit
trainer, a custom loop) gets data parallelism, `microbatches`, `precision`,
`xla` and `zero` 1/2 from the same parts as a Keras 3 model (`LocalCompute`,
`AllReduce` or `ShardedReduce`), with tf_keras's own loss, metrics and
optimizer in place of Keras 3's:

- `TfKerasLoss`: a microbatch's loss is tf_keras's `compute_loss` (the
  compiled loss plus `model.losses`, divided by the replicas as tf_keras
  does), weighted by the microbatch's share and scaled by a
  `LossScaleOptimizer`; `compute_metrics` updates the compiled metrics and
  the loss tracker.
- `TfKerasApply`: the optimizer applies the reduced gradients (unscaled
  first under loss scaling; its own all-reduce off: they are reduced); under
  `zero`, `tfdist.optim.tf_keras_zero.TfKerasShardedUpdate`.

`pipeline`, `tensor` and `zero=3` are Keras 3 only (`tfdist.engine.modes`
refuses them), and so is tf_keras's own `fit` (it never calls tfdist's step).
The parts are chosen by `tfdist.engine.modes.assemble`, with this module's
loss, update and checks (its `TfKeras` flavour).

Example:

```python
with strategy.scope():            # tfdist.Strategy(data=2, microbatches=2)
    model = official.nlp.modeling.models.BertClassifier(encoder, num_classes=2)
    model.compile(optimizer=tf_keras.optimizers.Adam(1e-3), loss=...)
step = strategy.train_step(model)
step.build(dataset.element_spec)
```
"""

import contextlib
import inspect

import keras
import tensorflow as tf
from keras import tree

# Loss reductions of tf_keras that average over the batch.
_MEAN_REDUCTIONS = ("auto", "sum_over_batch_size")


def is_tf_keras(model) -> bool:
    """Whether `model` is a tf_keras (Keras 2) model.

    Example:

    >>> import keras
    >>> is_tf_keras(keras.Sequential())
    False
    """
    return any(cls.__module__.split(".")[0] == "tf_keras" for cls in type(model).__mro__)


def check_tf_keras_optimizer(model, optimizer=None):
    """A tf_keras model must have an optimizer (`optimizer`, else the compiled
    one) before its step runs.

    Example:

    ```python
    check_tf_keras_optimizer(uncompiled_model)   # ValueError: ... has no optimizer
    ```
    """
    if (optimizer or getattr(model, "optimizer", None)) is None:
        raise ValueError(f"{getattr(model, 'name', model)!r} has no optimizer: call "
                         f"`model.compile(optimizer=...)` before running its step.")


def check_tf_keras_policy(model, precision: str):
    """A tf_keras model's dtype policy must be the strategy's `precision`.

    Example:

    ```python
    check_tf_keras_policy(model, "mixed_float16")   # ValueError unless built in the scope
    ```
    """
    policy = model.dtype_policy.name
    if policy != precision:
        raise ValueError(
            f"{getattr(model, 'name', model)!r} was built with tf_keras dtype policy "
            f"{policy!r} but the strategy has `precision={precision!r}`: build the model "
            f"inside `strategy.scope()`, which sets tf_keras's policy too.")


def check_microbatches(model, k: int):
    """Losses that average over the batch, and no BatchNormalization, for
    `microbatches=k` on a tf_keras model.

    Example:

    ```python
    check_microbatches(model, 2)   # ValueError for a summed loss
    ```
    """
    for loss in tree.flatten(getattr(model, "loss", None)):
        reduction = getattr(loss, "reduction", "auto")
        if reduction not in _MEAN_REDUCTIONS:
            raise ValueError(
                f"`microbatches={k}` needs losses that average over the batch "
                f"(reduction in {_MEAN_REDUCTIONS}), but {loss!r} has "
                f"reduction={reduction!r}. Use a mean reduction, or microbatches=1.")
    for layer in model.submodules:
        if type(layer).__name__ in ("BatchNormalization", "SyncBatchNormalization"):
            raise NotImplementedError(
                f"`microbatches={k}` with tf_keras's {type(layer).__name__} "
                f"({layer.name!r}): its moving statistics would move once per "
                f"microbatch ({k} times per step). Use microbatches=1 (a larger "
                f"`data`), or build the model with Keras 3, whose statistics "
                f"tfdist moves once per step.")


def build(model, data):
    """Creates the variables of `model`'s step from a batch or its spec: the
    layers' (one call on zeros), the compiled loss's and metrics', and the
    optimizer's, so that a `tf.function` step creates none.

    Example:

    ```python
    build(model, dataset.element_spec)
    ```
    """
    zeros = tree.map_structure(_zeros, data)
    x, y, _ = keras.utils.unpack_x_y_sample_weight(zeros)
    y_pred = model(x, training=False)
    model.compiled_loss.build(y_pred)
    model.compiled_metrics.build(y_pred, y)
    optimizer = model.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if hasattr(inner, "build"):
        inner.build(model.trainable_variables)


def _zeros(spec):
    if not isinstance(spec, tf.TensorSpec):
        return tf.zeros_like(spec)
    return tf.zeros([1 if d is None else d for d in spec.shape], spec.dtype)


class TfKerasLoss:
    """A compiled tf_keras model's loss on one microbatch, and its metrics
    (the interface of `tfdist.engine.microbatch.MicrobatchLoss`).

    Args:
        model: the compiled tf_keras model.
        optimizer: the optimizer whose loss scale applies (default: the
            model's compiled one).

    Example:

    ```python
    loss_of = TfKerasLoss(model)
    loss = loss_of.loss(part, model(part.x, training=True))
    target = loss_of.target(loss, part.share)
    ```
    """

    def __init__(self, model, optimizer=None):
        self.model = model
        self.optimizer = optimizer or model.optimizer

    def logits(self):
        """No sharded logits for tf_keras models."""
        return contextlib.nullcontext()

    def loss(self, microbatch, y_pred):
        """tf_keras's training loss of the microbatch (compiled loss plus
        `model.losses`, divided by the replicas); updates the loss tracker."""
        return self.model.compute_loss(microbatch.x, microbatch.y, y_pred,
                                       microbatch.sample_weight)

    def target(self, loss, share):
        """The loss times its share of the batch, times the loss scale."""
        part = loss if share is None else loss * tf.cast(share, loss.dtype)
        optimizer = self.optimizer
        return optimizer.get_scaled_loss(part) if _scales_loss(optimizer) else part

    def record(self, microbatch, loss, y_pred):
        """Updates the compiled metrics; returns every metric's result."""
        del loss  # tf_keras's compiled loss tracked it
        return self.model.compute_metrics(microbatch.x, microbatch.y, y_pred,
                                          microbatch.sample_weight)


class TfKerasApply:
    """A tf_keras optimizer applies already-reduced gradients (unscaled first
    by a `LossScaleOptimizer`, which skips the step where they are not finite:
    every replica alike, as they are reduced).

    Args:
        model: the tf_keras model.
        optimizer: the optimizer that applies them (default: the model's
            compiled one).

    Example:

    ```python
    TfKerasApply(model)(reduced_grads)   # in replica context
    ```
    """

    def __init__(self, model, optimizer=None):
        self.model = model
        self.optimizer = optimizer or model.optimizer

    def __call__(self, grads):
        optimizer = self.optimizer
        with tf.name_scope("apply"):
            if _scales_loss(optimizer):
                grads = optimizer.get_unscaled_gradients(grads)
            pairs = [(g, v) for g, v in zip(grads, self.model.trainable_variables)
                     if g is not None]
            optimizer.apply_gradients(pairs, **_no_aggregation(optimizer))


def _scales_loss(optimizer) -> bool:
    return hasattr(optimizer, "get_scaled_loss")


def _no_aggregation(optimizer) -> dict:
    """The keyword that turns a tf_keras optimizer's own all-reduce off."""
    parameters = inspect.signature(optimizer.apply_gradients).parameters
    if "skip_gradients_aggregation" in parameters:
        return {"skip_gradients_aggregation": True}
    return {"experimental_aggregate_gradients": False}
