"""Partitioning built Keras layers across a tensor group (Megatron layouts).

Each function below moves a built layer's weights into per-device shards
(`ShardedStorage` with an `AxisLayout`: the Keras variables keep their full
shape, path and identity) and gives the layer (this object only) a call that
computes on its shards inside the strategy's replicas. Outside them (Keras's
symbolic build, eager calls, another strategy) the layer reads its weights
whole and computes exactly as before.

- `column`: a Dense / EinsumDense whose kernel and bias are split along the
  output axis (`axis` of the kernel): each rank computes its slice of the
  output. Its input passes Megatron's "f" (`copy_input`), unless the owner of
  several projections applied it once (attention).
- `row`: a Dense / EinsumDense whose kernel is split along its first (input)
  axis; it takes a column layer's sliced output, and the partial products are
  summed over the group ("g") before the replicated bias and the activation.
- `vocabulary`: an Embedding whose table is split by rows; each rank looks up
  the ids it owns (zeros elsewhere) and the group sums ("g").
- `heads`: a MultiHeadAttention: query/key/value column-parallel by heads, the
  output projection row-parallel; each distinct input passes "f" once.
- `classifier`: the model's final Dense split by output classes (vocabulary)
  like `column`; inside tfdist's training step (`sharded_logits()`) it returns
  each rank's slice of the logits, which `ShardedSoftmaxCrossEntropy` turns
  into the loss without ever assembling them; elsewhere it all-gathers them.
"""

import contextlib
import threading


import keras
import tensorflow as tf
from keras.src import backend
from keras.src.losses.losses import sparse_categorical_crossentropy

from tfdist.optim.sharded import shard_keras_variable, storage_layout
from tfdist.tensor.layout import AxisLayout


def column(layer, mesh, axis=-1, copy_input=True, gather_output=False):
    """Splits a built Dense/EinsumDense by output features over `mesh`'s group.

    Example:

    ```python
    column(model.layers[0], strategy.tensor_mesh)   # (in, out) -> (in, out/t)
    ```
    """
    kernel_axis = axis % len(layer._kernel.shape)
    _split(layer._kernel, kernel_axis, mesh)
    if layer.bias is not None:
        # The bias has the kernel's output axes (those after its input axes).
        offset = len(layer._kernel.shape) - len(layer.bias.shape)
        _split(layer.bias, kernel_axis - offset, mesh)
    own_call = type(layer).call

    def call(inputs, training=None):
        if mesh.rank() is None:
            return own_call(layer, inputs)
        x = mesh.copy(inputs) if copy_input else inputs
        y = own_call(layer, x)
        return mesh.gather_last(y) if gather_output else y

    layer.call = call


def row(layer, mesh):
    """Splits a built Dense/EinsumDense by input features over `mesh`'s group.

    Example:

    ```python
    row(model.layers[1], strategy.tensor_mesh)      # (in, out) -> (in/t, out)
    ```
    """
    _split(layer._kernel, 0, mesh)
    # Its input is a slice of the features inside replicas, whole outside.
    layer.input_spec = None
    own_call = type(layer).call

    def call(inputs, training=None):
        if mesh.rank() is None:
            return own_call(layer, inputs)
        if isinstance(layer, keras.layers.EinsumDense):
            partial = keras.ops.einsum(layer.equation, inputs, layer.kernel)
        else:
            partial = keras.ops.matmul(inputs, layer.kernel)
        y = mesh.reduce(partial)
        if layer.bias is not None:
            y = keras.ops.add(y, layer.bias)
        return y if layer.activation is None else layer.activation(y)

    layer.call = call


def vocabulary(layer, mesh):
    """Splits a built Embedding's table by rows (vocabulary) over the group.

    Example:

    ```python
    vocabulary(model.layers[0], strategy.tensor_mesh)  # (V, d) -> (V/t, d)
    ```
    """
    _split(layer._embeddings, 0, mesh)
    own_call = type(layer).call
    rows = layer.input_dim // mesh.tensor

    def call(inputs):
        rank = mesh.rank()
        if rank is None:
            return own_call(layer, inputs)
        ids = tf.cast(inputs, tf.int32) - rank * rows
        owned = tf.logical_and(ids >= 0, ids < rows)
        found = tf.gather(tf.convert_to_tensor(layer.embeddings),
                          tf.where(owned, ids, tf.zeros_like(ids)))
        found = found * tf.cast(owned, found.dtype)[..., tf.newaxis]
        return tf.cast(mesh.reduce(found), layer.compute_dtype)

    layer.call = call


def heads(layer, mesh):
    """Splits a built MultiHeadAttention by heads over the group.

    Example:

    ```python
    heads(block_attention, strategy.tensor_mesh)  # 8 heads -> 8/t per device
    ```
    """
    for projection in (layer._query_dense, layer._key_dense, layer._value_dense):
        column(projection, mesh, axis=-2, copy_input=False)  # (d, heads, size)
    row(layer._output_dense, mesh)                              # (heads, size, d)
    own_call = type(layer).call

    def call(query, value, key=None, **kwargs):
        if mesh.rank() is None:
            return own_call(layer, query, value, key, **kwargs)
        copies = {}

        def copy(x):  # "f" once per distinct input (self-attention: once)
            if x is None:
                return None
            if id(x) not in copies:
                copies[id(x)] = mesh.copy(x)
                backend.set_keras_mask(copies[id(x)], backend.get_keras_mask(x))
            return copies[id(x)]

        return own_call(layer, copy(query), copy(value), copy(key), **kwargs)

    layer.call = call


_logits = threading.local()  # per replica thread: are logits left sharded?


@contextlib.contextmanager
def sharded_logits():
    """Inside it (tfdist's training step), a `classifier` layer returns this
    rank's slice of the logits instead of gathering them.

    Example:

    ```python
    with sharded_logits():
        logits = model(x, training=True)      # (..., classes / t) per rank
    ```
    """
    previous = getattr(_logits, "sharded", False)
    _logits.sharded = True
    try:
        yield
    finally:
        _logits.sharded = previous


def logits_are_sharded():
    """Whether the current replica thread is inside `sharded_logits()`."""
    return getattr(_logits, "sharded", False)


def classifier(layer, mesh):
    """Splits the model's final Dense by output classes over the group.

    Example:

    ```python
    classifier(model.layers[-1], strategy.tensor_mesh)  # (d, V) -> (d, V/t)
    ```
    """
    column(layer, mesh)
    sliced = layer.call

    def call(inputs, training=None):
        y = sliced(inputs)
        if mesh.rank() is None or logits_are_sharded():
            return y
        return mesh.gather_last(y)

    layer.call = call


class ShardedSoftmaxCrossEntropy(keras.losses.Loss):
    """Sparse softmax cross-entropy of logits split by class over a tensor group.

    Each rank holds logits for classes [r·V/t, (r+1)·V/t). The log-sum-exp is
    assembled from each rank's sum of exponentials (and the group's maximum,
    for range), the true class's logit from the rank that owns it: two
    all-reduces of one value per example, never the logits. The gradient on
    each rank is its slice of softmax − one-hot. Outside `sharded_logits()`
    it is the loss it replaces (`fallback`), with its reduction and weights.

    Example:

    ```python
    loss = ShardedSoftmaxCrossEntropy(mesh, keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    ```
    """

    def __init__(self, mesh, fallback):
        super().__init__(name=fallback.name, reduction=fallback.reduction,
                         dtype=fallback.dtype)
        self.mesh = mesh
        self.fallback = fallback

    def call(self, y_true, y_pred):
        if not logits_are_sharded() or self.mesh.rank() is None:
            return self.fallback.call(y_true, y_pred)
        mesh = self.mesh
        width = y_pred.shape[-1]
        labels = tf.cast(y_true, tf.int32)
        if labels.shape.rank == y_pred.shape.rank:
            labels = tf.squeeze(labels, -1)
        local_max = tf.stop_gradient(tf.reduce_max(y_pred, axis=-1, keepdims=True))
        top = tf.reduce_max(mesh.gather_last(local_max), axis=-1, keepdims=True)
        exp_sum = mesh.reduce(tf.reduce_sum(tf.exp(y_pred - top), axis=-1))
        own = labels - mesh.rank() * width
        hot = tf.one_hot(tf.where((own >= 0) & (own < width), own, -1), width,
                         dtype=y_pred.dtype)  # all zeros where another rank owns it
        true_logit = mesh.reduce(tf.reduce_sum(y_pred * hot, axis=-1))
        return tf.math.log(exp_sum) + tf.squeeze(top, -1) - true_logit


def is_sparse_softmax_loss(loss):
    """Whether a Keras loss is sparse categorical cross-entropy on logits (last
    axis, no ignored class): the one a sharded classifier can compute."""
    kwargs = getattr(loss, "_fn_kwargs", {})
    return (getattr(loss, "fn", None) is sparse_categorical_crossentropy
            and kwargs.get("from_logits") and kwargs.get("ignore_class") is None
            and kwargs.get("axis", -1) == -1)


def _split(variable, axis, mesh):
    layout = AxisLayout(variable.shape, axis, mesh.tensor)
    with mesh.strategy.scope():
        shard_keras_variable(variable, layout, mesh.strategy)


def layout_of(variable):
    """The `AxisLayout` of a partitioned Keras variable, else None."""
    layout = storage_layout(variable)
    return layout if isinstance(layout, AxisLayout) else None
