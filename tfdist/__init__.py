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

Names that need TensorFlow load on first use, so the `tfdist` command's launcher
and manifest tools start without importing it.
"""

import importlib
import sys

if "tensorflow" not in sys.modules:  # else TensorFlow has read its log level
    from tfdist.logs import quiet_tensorflow

    quiet_tensorflow()

from tfdist.config import ParallelConfig  # noqa: E402

__version__ = "0.1.0"

_LAZY = {
    "ChiefStrategy": "tfdist.chief",
    "MultiWorkerStrategy": "tfdist.strategy",
    "ParameterServerStrategy": "tfdist.ps",
    "Strategy": "tfdist.strategy",
    "plan": "tfdist.plan_trials",
    "use_virtual_devices": "tfdist.devices",
}
_LAZY_MODULES = ("batch_statistics", "callbacks", "checkpoint", "cluster", "engine", "layers",
                 "optim", "ps", "tensor")

__all__ = ["MultiWorkerStrategy", "ParallelConfig", "ParameterServerStrategy", "Strategy",
           "batch_statistics",
           "callbacks", "checkpoint", "cluster", "engine", "layers", "optim", "plan", "ps",
           "tensor", "use_virtual_devices"]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _LAZY_MODULES:
        value = importlib.import_module(f"tfdist.{name}")
    else:
        raise AttributeError(f"module 'tfdist' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
