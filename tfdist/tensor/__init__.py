"""Tensor parallelism (Megatron-style): weights split across a tensor group.

With `tensor=t`, the strategy's N replicas form a data x tensor mesh
(`TensorMesh`); supported layers of a model hold 1/t of their weights on each
device of a tensor group (`AxisLayout` shards in `ShardedStorage`). Models
built under the strategy's scope are partitioned automatically (`plan` picks a
layout of `tfdist.tensor.layouts` for each layer), or by hand with
`tfdist.layers`.

Example:

```python
strategy = tfdist.Strategy(tensor=2)       # data = devices / 2
with strategy.scope():
    model = make_transformer()              # unchanged Keras model
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
model.fit(x, y, batch_size=32)
print(strategy.describe(model))             # which layers are split, and why
```
"""

from tfdist.sharding.layout import AxisLayout
from tfdist.tensor.layers import ColumnParallelDense, ParallelEmbedding, RowParallelDense
from tfdist.tensor.mesh import TensorMesh

__all__ = ["AxisLayout", "ColumnParallelDense", "ParallelEmbedding", "RowParallelDense",
           "TensorMesh"]
