"""Sharding: splitting variables across a strategy's replicas.

Shared by sharded optimizer state (`tfdist.optim`, ZeRO), tensor parallelism
(`tfdist.tensor`) and pipeline placement (`tfdist.pipeline`):

- `layout`: how a value is split (`ShardLayout`, `AxisLayout`, `MeshShardLayout`);
- `storage`: `ShardedStorage`, a variable held as one shard per replica, and
  moving a Keras variable's storage into it;
- `slots`: which optimizer variables are per-variable slots;
- `keys`: keeping an optimizer's variable keys valid when storage moves;
- `collectives`: reduce-scatter and all-gather for the current replica.

Example:

```python
from tfdist.sharding.layout import ShardLayout
from tfdist.sharding.storage import shard_keras_variable

with strategy.scope():
    slot = keras.Variable(tf.zeros((1000, 64)))
shard_keras_variable(slot, ShardLayout(slot.shape, 4), strategy)
```
"""
