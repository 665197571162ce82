"""Keras layer internals: the variables behind a layer's weights, masks, its call.

Keras layers keep the variable of a weight that LoRA or quantization may wrap
in a private attribute (`Dense._kernel`, `Embedding._embeddings`), and
`MultiHeadAttention` its projections in `_query_dense` and kin. tfdist splits
exactly those variables and changes how one built layer computes.
"""

import tensorflow as tf
from keras.src import backend


def kernel_variable(layer):
    """The variable holding a Dense / EinsumDense layer's kernel (`_kernel`).

    Example:

    ```python
    kernel_variable(keras.layers.Dense(4)).shape   # once built: (in, 4)
    ```
    """
    return layer._kernel


def embeddings_variable(layer):
    """The variable holding an Embedding layer's table (`_embeddings`).

    Example:

    ```python
    embeddings_variable(embedding).shape   # (input_dim, output_dim)
    ```
    """
    return layer._embeddings


def main_variable(layer):
    """The variable a layer's size is judged by: a Dense-like kernel, an
    embedding table, or an attention layer's query kernel; else None.

    Example:

    ```python
    main_variable(keras.layers.Dense(4))   # once built: its kernel
    ```
    """
    for name in ("_kernel", "_embeddings", "_query_dense"):
        value = getattr(layer, name, None)
        if value is not None:
            return value._kernel if name == "_query_dense" else value
    return None


def attention_projections(layer):
    """The query, key and value projections (EinsumDense layers) of a
    `MultiHeadAttention` layer.

    Example:

    ```python
    query, key, value = attention_projections(attention)
    ```
    """
    return layer._query_dense, layer._key_dense, layer._value_dense


def attention_output_projection(layer):
    """The output projection (an EinsumDense layer) of a `MultiHeadAttention` layer.

    Example:

    ```python
    attention_output_projection(attention).kernel.shape   # (heads, size, d)
    ```
    """
    return layer._output_dense


def attention_is_gated(layer) -> bool:
    """Whether an attention layer multiplies its output by a learned gate (`_use_gate`).

    Example:

    ```python
    attention_is_gated(keras.layers.MultiHeadAttention(2, 8))   # False
    ```
    """
    return getattr(layer, "_use_gate", False)


def copy_keras_mask(source, target):
    """Gives the tensor `target` the Keras mask of `source` (None clears it).

    Example:

    ```python
    copy_keras_mask(x, tf.identity(x))
    ```
    """
    backend.set_keras_mask(target, backend.get_keras_mask(source))


def set_keras_mask(target, mask):
    """Gives the tensor `target` the Keras mask `mask` (None: none).

    Example:

    ```python
    set_keras_mask(embedded, ids != 0)
    ```
    """
    if mask is not None:
        backend.set_keras_mask(target, mask)


def keras_masks(outputs):
    """The Keras masks of a nest of tensors (None where a tensor has none), to
    carry them out of a `tf.function`, which returns new tensors without them.

    Example:

    ```python
    masks = keras_masks(y_pred)   # inside the function; returned beside y_pred
    ```
    """
    return tf.nest.map_structure(backend.get_keras_mask, outputs)


def set_keras_masks(outputs, masks):
    """Gives each tensor of `outputs` its mask in `masks` (`keras_masks`'s).

    Example:

    ```python
    set_keras_masks(y_pred, masks)   # after the function returned both
    ```
    """
    for target, mask in zip(tf.nest.flatten(outputs), tf.nest.flatten(masks)):
        set_keras_mask(target, mask)


def use_call(layer, call):
    """Makes `call` the computation of one built layer (this object only).

    Keras offers no hook to change how one built layer computes: its
    `__call__` runs `self.call`, so an instance attribute shadows the class's
    method for this object alone (its class, other instances, its config and
    its weights are untouched). Every tensor layout changes a layer's call
    here, and nowhere else (listed in `tfdist._compat.patches`).

    Example:

    ```python
    own_call = type(layer).call
    use_call(layer, lambda inputs, training=None: own_call(layer, inputs) * 2.0)
    ```
    """
    layer.call = call


def read_dtype(layer, variable):
    """The dtype `layer`'s call reads its own `variable` in: under mixed
    precision its compute dtype, where Keras autocasts the read (the layer's
    `autocast` and the variable's `_autocast`; off for normalization layers'
    weights); the variable's dtype otherwise.

    Example:

    ```python
    read_dtype(dense, dense.kernel)   # "float16" under mixed_float16
    ```
    """
    if (layer.autocast and variable._autocast and backend.is_float_dtype(layer.compute_dtype)
            and backend.is_float_dtype(variable.dtype)):
        return layer.compute_dtype
    return variable.dtype


def call_losses(model):
    """The losses `model`'s layers added in their last call (`add_loss`,
    activity regularizers), not the weights' regularization losses.

    Example:

    ```python
    call_losses(model)   # [<tf.Tensor ...>] after a forward of a Mixtral backbone
    ```
    """
    return [loss for layer in model._flatten_layers() for loss in layer._losses]
