"""Asynchronous parameter-server training for Keras 3 `model.fit`.

Example:

```python
resolver = tfdist.ps.in_process_cluster(workers=2, ps=1)  # or TF_CONFIG
strategy = tfdist.ParameterServerStrategy(cluster_resolver=resolver)
with strategy.scope():
    model = build_model()
    model.compile(optimizer="adam", loss="mse")
model.fit(x, y, batch_size=32, epochs=2)
```
"""

from tfdist.ps.strategy import ParameterServerStrategy, in_process_cluster, serve

__all__ = ["ParameterServerStrategy", "in_process_cluster", "serve"]
