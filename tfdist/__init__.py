"""tfdist: every kind of distributed training for TensorFlow / Keras 3.

Example:

```python
import tfdist, keras
tfdist.use_virtual_devices(4)
strategy = tfdist.Strategy(data=4, microbatches=2)
with strategy.scope():
    model = keras.Sequential([keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss="mse")
model.fit(x, y, batch_size=64)
```
"""

from tfdist import engine
from tfdist.config import ParallelConfig
from tfdist.devices import use_virtual_devices
from tfdist.strategy import MultiWorkerStrategy, Strategy

__version__ = "0.1.0"

__all__ = [
    "MultiWorkerStrategy",
    "ParallelConfig",
    "Strategy",
    "engine",
    "use_virtual_devices",
]
