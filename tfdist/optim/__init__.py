"""Sharded optimizer state (ZeRO): element layouts, sharded storage, the sharded update.

Example:

```python
strategy = tfdist.Strategy(data=4, zero=2)   # optimizer state and gradients sharded
with strategy.scope():
    model = build_model()
    model.compile(optimizer="adam", loss="mse")
model.fit(x, y)
```
"""

from tfdist.optim.layout import ShardLayout
from tfdist.optim.sharded import ShardedStorage
from tfdist.optim.zero import ELEMENTWISE, elementwise

__all__ = ["ELEMENTWISE", "ShardLayout", "ShardedStorage", "elementwise"]
