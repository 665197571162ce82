"""ZeRO 1/2 for tf_keras (Keras 2) optimizers, such as a Model Garden model's.

The same sharded step as Keras 3's (`tfdist.optim.zero.ShardedUpdate`: reduce
into shards, the optimizer's own `update_step` on each replica's shard,
gather), with tf_keras's optimizer interface:

- slots: tf_keras's slots are `tf.Variable`s (mirrored under the strategy);
  each is replaced, in the optimizer's slot lists and `variables`, by a
  `ShardedStorage` of the same value, whose checkpoint entry (and
  `optimizer.variables` value outside replicas) is the full tensor, so a
  checkpoint is the same as an unsharded run's;
- the update sums the duplicate slices of a sparse gradient first and computes
  a learning-rate schedule's value, as tf_keras's `apply_gradients` does.

The v2.11+ tf_keras optimizers whose update is elementwise are supported
(`TF_KERAS_ELEMENTWISE`); the legacy ones (`tf_keras.optimizers.legacy`, and the
Model Garden's own such as `AdamWeightDecay`), which keep slots by name, and
loss scaling (`mixed_float16`) are refused before the first step.

Example:

```python
update = TfKerasShardedUpdate(model, 1, strategy.replica_mesh)   # once, optimizer built
reduce = ShardedReduce(update.layouts, 1, strategy.replica_mesh, AllReduce())
update(reduce(local_gradients))    # per step, in replica context
```
"""

import functools

from tfdist._compat import tf_keras_optimizer
from tfdist.optim.zero import ShardedUpdate, check_options
from tfdist.sharding.storage import ShardedStorage, copy_devices

_ELEMENTWISE_NAMES = ("SGD", "Adam", "AdamW", "Adamax", "RMSprop", "Adagrad", "Adadelta",
                      "Lion")


@functools.cache
def tf_keras_elementwise():
    """The tf_keras optimizer classes whose update is elementwise.

    Example:

    ```python
    tf_keras.optimizers.Adam in tf_keras_elementwise()   # True
    ```
    """
    import tf_keras

    return frozenset(getattr(tf_keras.optimizers, name) for name in _ELEMENTWISE_NAMES)


def check_tf_keras_shardable(optimizer, zero: int):
    """Errors for a tf_keras optimizer whose state `zero` cannot shard exactly.

    Example:

    ```python
    check_tf_keras_shardable(tf_keras.optimizers.legacy.Adam(), 1)  # NotImplementedError
    ```
    """
    import tf_keras

    mode = f"`zero={zero}`"
    cls = type(optimizer)
    if hasattr(optimizer, "get_scaled_loss"):
        raise NotImplementedError(
            f"{mode} with a tf_keras LossScaleOptimizer (precision='mixed_float16') is "
            f"not supported in this version. Use zero=0 with mixed_float16, or "
            f"zero with float32 or mixed_bfloat16 (no loss scaling).")
    if isinstance(optimizer, tf_keras.optimizers.legacy.Optimizer):
        raise NotImplementedError(
            f"{mode} takes tf_keras's v2.11+ optimizers (tf_keras.optimizers.Adam, ...), "
            f"but {cls.__module__}.{cls.__qualname__} is a legacy one (its slots are "
            f"kept by name). Use the same optimizer from tf_keras.optimizers (in a Model "
            f"Garden optimizer config: type 'sgd_experimental', 'adam_experimental' or "
            f"'adamw_experimental'), or zero=0.")
    if cls not in tf_keras_elementwise():
        raise ValueError(
            f"{mode} shards optimizer state element by element, which is exact only "
            f"for optimizers whose update is elementwise; tfdist does not know "
            f"{cls.__module__}.{cls.__qualname__} to be. Supported tf_keras optimizers: "
            f"{', '.join(_ELEMENTWISE_NAMES)}. Use one of those, or zero=0.")
    check_options(optimizer, mode)


class TfKerasShardedUpdate(ShardedUpdate):
    """ZeRO's sharded update of a tf_keras model's optimizer (replica context).

    Args:
        model: a tf_keras model built under a tfdist strategy.
        zero: the stage, 1 or 2.
        mesh: the strategy's `replica_mesh`.
        optimizer: the optimizer that applies (default: the model's compiled
            one); it is built on the model's trainable variables if it is not.

    Example:

    ```python
    mesh = strategy.replica_mesh
    update = TfKerasShardedUpdate(model, 2, mesh)
    update(ShardedReduce(update.layouts, 2, mesh, AllReduce())(local_gradients))
    ```
    """

    def __init__(self, model, zero: int, mesh, optimizer=None):
        optimizer = optimizer or model.optimizer
        with model.distribute_strategy.scope():
            optimizer.build(model.trainable_variables)  # a no-op once built
        super().__init__(model, zero, mesh, optimizer)
        for variable, buffer in zip(self.variables, self.buffers):
            tf_keras_optimizer.found_as(buffer, variable)

    def _check(self, optimizer, zero):
        check_tf_keras_shardable(optimizer, zero)

    def _optimizer_variables(self):
        variables = list(self.model.trainable_variables)
        missing = [v.name for v in variables
                   if not tf_keras_optimizer.knows(self.inner, v)]
        if missing:
            raise ValueError(
                f"The optimizer was built on other variables than the model's trainable "
                f"ones (it has no state for {missing}): build it on "
                f"`model.trainable_variables`, or let the step build it.")
        return sorted(variables, key=self._index_of)

    def _index_of(self, variable):
        return tf_keras_optimizer.variable_index(self.inner, variable)

    def _shard_slots(self, slots, storage, strategy):
        sharded = {}
        for slot, index in slots:
            if getattr(slot, "layout", None) == storage[index]:  # created as shards
                continue
            sharded[id(slot)] = ShardedStorage.create(
                strategy, storage[index], slot.read_value(), slot.name.split(":")[0],
                slot.dtype, devices=copy_devices(slot, strategy))
        tf_keras_optimizer.replace_variables(self.inner, sharded)

    def _learning_rate(self):
        return tf_keras_optimizer.current_learning_rate(self.inner)

    def _update_steps(self, shards, buffers, indices, learning_rate):
        del learning_rate  # tf_keras's update_step reads it from the optimizer
        shards = tf_keras_optimizer.summed_duplicates(self.inner, shards)
        for gradient, buffer in zip(shards, buffers):  # each finds its variable's slots
            self.inner.update_step(gradient, buffer)
