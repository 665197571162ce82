"""Keras callbacks for tfdist jobs.

Example:

```python
model.fit(dataset, epochs=10, callbacks=[
    tfdist.callbacks.BackupAndRestore("/shared/backup"),
    tfdist.callbacks.Profiler("logs", steps=(20, 25)),
    tfdist.callbacks.Metrics("logs", every_n_steps=50),
])
```
"""

from tfdist.callbacks.backup import BackupAndRestore
from tfdist.callbacks.metrics import Metrics
from tfdist.callbacks.profiler import Profiler

__all__ = ["BackupAndRestore", "Metrics", "Profiler"]
