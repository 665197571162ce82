"""The places where tfdist relies on Keras and TensorFlow internals.

Keras 3 and `tf.distribute` have no public hooks for some of what tfdist
does (turning off an optimizer's own gradient all-reduce, pointing its slot
lookup at shard buffers, ...). Each such use is a named function here, one
module per foreign area (`keras_optimizer`, `keras_trainer`, `keras_losses`,
`keras_functional`, `keras_layers`, `tf_variables`, `tf_graph`, `tf_distribute`,
`tf_collectives`, `tf_parameter_server`, `tf_logging`, `tf_profiler`), and every change to
Keras or TensorFlow code is listed in `patches`, so a Keras or TensorFlow
upgrade means auditing this package and nothing else.
`tools/check_internals.py` (in `make lint`) keeps it that way.

Example:

```python
from tfdist._compat.tf_variables import storage_of
storage_of(model.layers[0].kernel)   # the tf.Variable behind the Keras variable
```
"""
