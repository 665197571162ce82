"""Sharded optimizer state (ZeRO): the sharded update (layouts and storage from
`tfdist.sharding`); and `OneBitAdam`, Adam whose momenta cross devices as signs.

Example:

```python
strategy = tfdist.Strategy(data=4, zero=2)   # optimizer state and gradients sharded
with strategy.scope():
    model = build_model()
    model.compile(optimizer="adam", loss="mse")
model.fit(x, y)
```
"""

from tfdist.optim.one_bit_adam import OneBitAdam
from tfdist.optim.zero import ELEMENTWISE, elementwise
from tfdist.sharding.layout import ShardLayout
from tfdist.sharding.storage import ShardedStorage

__all__ = ["ELEMENTWISE", "OneBitAdam", "ShardLayout", "ShardedStorage", "elementwise"]
