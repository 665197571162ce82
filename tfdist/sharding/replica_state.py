"""`ReplicaState`: what the step's parts keep on each replica, checkpointed.

A part of the step may keep state of its own beside the model's weights and
the optimizer's variables, different on each replica: Top-K compression's
error-feedback residuals (`tfdist.engine.compression`), the gradient each
replica did not send yet. A part creates it when the step is prepared, with
`ReplicaState.add` on the model's state (`state_of(model)`), and reads and
assigns it inside a replica as its own value (`own`, `assign_own`).

Each variable is a `ShardedStorage` of shape `(replicas, *shape)`, one row per
replica (`AxisLayout` along axis 0), each row on its replica's device: outside
replicas it reads as every replica's rows, so `ShardedCheckpoint` saves it (as
`state/<name>`, each task its own rows) and restores it like a sharded weight.
A checkpoint restored before the step creates its state (as `fit` restores a
backup before its first step) leaves the saved rows pending here: `add` then
creates the variable with them.

Example:

```python
state = state_of(model)
with strategy.scope():
    residual = state.add("residual/dense/kernel", (4, 8))
# inside strategy.run:
state.assign_own(residual, state.own(residual) + gradient)
```
"""

import tensorflow as tf

from tfdist.sharding.layout import AxisLayout
from tfdist.sharding.storage import ShardedStorage

# The model attribute holding its ReplicaState.
_ATTRIBUTE = "_tfdist_replica_state"


class StateBytes:
    """Stands in for a `ReplicaState` to count the bytes a part's `init`
    would make on each replica, making nothing (what the peak predictor
    counts).

    Example:

    ```python
    counted = StateBytes()
    TopKCompression(None, 0.01, None).init(counted, model.trainable_weights)
    counted.bytes   # one residual per floating weight
    ```
    """

    def __init__(self):
        self.bytes = 0

    def add(self, name: str, shape, dtype="float32", initial=None):
        """Counts a variable `name` of `shape` and `dtype` (see `ReplicaState.add`)."""
        self.bytes += tf.TensorShape(shape).num_elements() * tf.as_dtype(dtype).size


class ReplicaState:
    """The named per-replica variables of one model's step (see the module).

    Args:
        strategy: the strategy the model was built under.

    Example:

    ```python
    state = state_of(model)
    state.variables   # {'topk_residual/dense/kernel': <ShardedStorage (4, 8, 16)>}
    ```
    """

    def __init__(self, strategy):
        self.strategy = strategy
        self.variables = {}  # name -> ShardedStorage, in creation order
        self.pending = {}  # name -> restore(variable), from a checkpoint not yet used

    def add(self, name: str, shape, dtype="float32", initial=None) -> ShardedStorage:
        """A new variable `name` of `shape` on every replica, each replica's
        value `initial` (default zeros), or the rows a checkpoint restored
        before it existed; kept under `name`.

        Example:

        ```python
        with strategy.scope():
            residual = state.add("residual/dense/kernel", (4, 8))
        ```
        """
        if name in self.variables:
            raise ValueError(f"The step's replica state already has a variable {name!r}.")
        replicas = self.strategy.num_replicas_in_sync
        layout = AxisLayout((replicas, *shape), 0, replicas)
        if initial is not None:
            initial = tf.broadcast_to(tf.cast(initial, dtype), layout.shape)
        variable = ShardedStorage.create(self.strategy, layout, initial,
                                         f"replica_state/{name}", tf.as_dtype(dtype))
        self.variables[name] = variable
        restore = self.pending.pop(name, None)
        if restore is not None:
            restore(variable)
        return variable

    @staticmethod
    def own(variable):
        """Inside a replica: its own value of `variable`, of the shape `add` gave.

        Example:

        ```python
        residual = state.own(variable)   # in strategy.run
        ```
        """
        return tf.reshape(variable.read_value(), variable.layout.shape[1:])

    @staticmethod
    def assign_own(variable, value):
        """Inside a replica: assigns its own value of `variable`.

        Example:

        ```python
        state.assign_own(variable, tf.zeros(variable.layout.shape[1:]))
        ```
        """
        return variable.assign(tf.reshape(value, variable.layout.shard_shape))


def state_of(model) -> ReplicaState:
    """`model`'s `ReplicaState` (an empty one the first time).

    Example:

    ```python
    state_of(model).variables   # {} without a part that keeps state
    ```
    """
    state = getattr(model, _ATTRIBUTE, None)
    if state is None:
        state = ReplicaState(model.distribute_strategy)
        # (set past Keras's attribute tracking: not one of the model's weights)
        object.__setattr__(model, _ATTRIBUTE, state)
    return state
