"""Keras callbacks for tfdist jobs.

Example:

```python
model.fit(dataset, epochs=10,
          callbacks=[tfdist.callbacks.BackupAndRestore("/shared/backup")])
```
"""

from tfdist.callbacks.backup import BackupAndRestore
