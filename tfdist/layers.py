"""Keras layers tfdist adds: the explicit tensor-parallel layers.

Example:

```python
with tfdist.Strategy(tensor=2).scope():
    block = keras.Sequential([keras.Input((64,)),
                              tfdist.layers.ColumnParallelDense(256, activation="relu"),
                              tfdist.layers.RowParallelDense(64)])
```
"""

from tfdist.tensor.layers import ColumnParallelDense, ParallelEmbedding, RowParallelDense

__all__ = ["ColumnParallelDense", "ParallelEmbedding", "RowParallelDense"]
