"""Tensor layouts: how a built Keras layer is split across a tensor group.

Each layout (Megatron's, Shoeybi et al., 2019) owns two things: how it moves a
built layer's weights into per-device shards (`split`: `ShardedStorage` with an
`AxisLayout`; the Keras variables keep their full shape, path and identity)
and the call the layer makes on its shards inside the strategy's replicas
(`sharded_call`). `apply` does both; outside the replicas (Keras's symbolic
build, eager calls, another strategy) the layer reads its weights whole and
computes exactly as before. `name` is what `describe` prints.

- `Column`: a Dense / EinsumDense whose kernel and bias are split along the
  output axis (`axis` of the kernel): each rank computes its slice of the
  output. Its input passes Megatron's "f" (`copy_input`), unless the owner of
  several projections applied it once (attention).
- `Row`: a Dense / EinsumDense whose kernel is split along its first (input)
  axis; it takes a column layer's sliced output, and the partial products are
  summed over the group ("g") before the replicated bias and the activation.
- `Vocabulary`: an Embedding whose table is split by rows; each rank looks up
  the ids it owns (zeros elsewhere) and the group sums ("g").
- `Heads`: a MultiHeadAttention: query/key/value column-parallel by heads, the
  output projection row-parallel; each distinct input passes "f" once.
- `Classifier`: the model's final Dense split by output classes like
  `Column`; inside tfdist's training step (`sharded_logits()`) it returns each
  rank's slice of the logits, which `ShardedSoftmaxCrossEntropy` turns into
  the loss without ever assembling them; elsewhere it all-gathers them.
- `Replicated`: the layer is left whole on every device.
- `PerSlice`: a layer left whole on every device that acts on each rank's
  slice of its input (a norm of each attention head, on the rank's heads):
  its weights' gradients, each rank's share, are summed over the group.

Example:

```python
Column().apply(model.layers[0], strategy.tensor_mesh)   # (in, out) -> (in, out/t)
Row().apply(model.layers[1], strategy.tensor_mesh)      # (in, out) -> (in/t, out)
```
"""

import keras
import tensorflow as tf

from tfdist._compat import keras_layers
from tfdist.sharding.layout import AxisLayout, MeshShardLayout
from tfdist.sharding.storage import shard_keras_variable
from tfdist.tensor.softmax import logits_are_sharded


class TensorLayout:
    """How a built layer is split over a tensor group, and how it then computes.

    Subclasses set `name` (what `describe` prints) and implement
    `weight_axes(layer)` (which weights are split, along which axis: `split`
    splits them) and `sharded_call(layer, mesh, *args, **kwargs)`.

    Example:

    ```python
    layout = Vocabulary()
    layout.apply(embedding, strategy.tensor_mesh)   # (V, d) -> (V/t, d)
    layout.name                                     # 'vocabulary'
    ```
    """

    name = None
    sharded_loss = False  # its logits feed `ShardedSoftmaxCrossEntropy`

    def weight_axes(self, layer):
        """[(weight, axis)]: each weight of `layer` this layout splits, and
        the axis it splits it along (weights not listed stay whole)."""
        raise NotImplementedError

    def split(self, layer, mesh):
        """Moves `layer`'s weights into shards over `mesh`'s tensor group."""
        for variable, axis in self.weight_axes(layer):
            _split(variable, axis, mesh)

    def sharded_call(self, layer, mesh, *args, **kwargs):
        """What `layer` computes on its shards inside a replica of `mesh`."""
        raise NotImplementedError

    def apply(self, layer, mesh):
        """Splits built `layer` over `mesh` and gives it its sharded call."""
        self.split(layer, mesh)
        own_call = type(layer).call

        def call(*args, **kwargs):
            if mesh.rank() is None:  # outside the mesh's replicas: whole weights
                return own_call(layer, *args, **kwargs)
            return self.sharded_call(layer, mesh, *args, **kwargs)

        keras_layers.use_call(layer, call)
        layer._tfdist_layout = self  # what `plan` reports for an explicit layer


class Replicated(TensorLayout):
    """A layer left whole on every device of the tensor group.

    Example:

    ```python
    Replicated().apply(layer, mesh)   # nothing changes
    ```
    """

    name = "replicated"

    def weight_axes(self, layer):
        """None: every weight stays whole."""
        return []

    def apply(self, layer, mesh):
        """Leaves `layer` as it is."""


class PerSlice(TensorLayout):
    """A layer whose weights stay whole on every device of the tensor group
    while it acts on each rank's slice of the features (a norm of each
    attention head, run on the rank's heads): each rank's gradient of its
    weights is its heads' share, so every weight it reads passes Megatron's
    "f" (identity forward, gradient summed over the group backward).

    Example:

    ```python
    PerSlice().apply(query_norm, strategy.tensor_mesh)   # weights whole, gradients summed
    ```
    """

    name = "per-slice"

    def weight_axes(self, layer):
        """None: every weight stays whole."""
        return []

    def sharded_call(self, layer, mesh, *args, **kwargs):
        """The layer's own call on this rank's slice, its weights read through "f"."""
        reads = [(w, mesh.copy(w.value)) for w in layer.trainable_weights]
        with keras.StatelessScope(reads):
            return type(layer).call(layer, *args, **kwargs)


class Column(TensorLayout):
    """A Dense / EinsumDense split by output features (kernel axis `axis`).

    Args:
        axis: the kernel's output axis to split (-2 for attention's
            (d, heads, size) projections).
        copy_input: pass the input through Megatron's "f" (off when the owner
            of several projections applies it once).
        gather_output: all-gather the output slices (last axis).

    Example:

    ```python
    Column().apply(model.layers[0], strategy.tensor_mesh)   # (in, out) -> (in, out/t)
    ```
    """

    name = "column"

    def __init__(self, axis=-1, copy_input=True, gather_output=False):
        self.axis = axis
        self.copy_input = copy_input
        self.gather_output = gather_output

    def weight_axes(self, layer):
        """The kernel along `axis`, the bias along the same output axis."""
        kernel = keras_layers.kernel_variable(layer)
        kernel_axis = self.axis % len(kernel.shape)
        if layer.bias is None:
            return [(kernel, kernel_axis)]
        # The bias has the kernel's output axes (those after its input axes).
        return [(kernel, kernel_axis),
                (layer.bias, kernel_axis - (len(kernel.shape) - len(layer.bias.shape)))]

    def sharded_call(self, layer, mesh, inputs, training=None):
        """This rank's slice of the output (all of it with `gather_output`)."""
        x = mesh.copy(inputs) if self.copy_input else inputs
        y = type(layer).call(layer, x)
        return mesh.gather_last(y) if self.gathers() else y

    def gathers(self):
        """Whether the output slices are gathered (asked at every call)."""
        return self.gather_output


class Classifier(Column):
    """The model's final Dense split by output classes, its logits left
    sharded inside `sharded_logits()` and gathered elsewhere.

    Example:

    ```python
    Classifier().apply(model.layers[-1], strategy.tensor_mesh)  # (d, V) -> (d, V/t)
    ```
    """

    name = "classifier"
    sharded_loss = True

    def gathers(self):
        """Gathers the logits unless the loss takes them sharded."""
        return not logits_are_sharded()


class Row(TensorLayout):
    """A Dense / EinsumDense split by input features (kernel axis 0).

    Example:

    ```python
    Row().apply(model.layers[1], strategy.tensor_mesh)   # (in, out) -> (in/t, out)
    ```
    """

    name = "row"

    def weight_axes(self, layer):
        """The kernel along its input axis; the bias stays whole."""
        return [(keras_layers.kernel_variable(layer), 0)]

    def split(self, layer, mesh):
        """Splits the kernel by input features."""
        super().split(layer, mesh)
        # Its input is a slice of the features inside replicas, whole outside.
        layer.input_spec = None

    def sharded_call(self, layer, mesh, inputs, training=None):
        """The partial products summed over the group ("g"), bias, activation."""
        if isinstance(layer, keras.layers.EinsumDense):
            partial = keras.ops.einsum(layer.equation, inputs, layer.kernel)
        else:
            partial = keras.ops.matmul(inputs, layer.kernel)
        y = mesh.reduce(partial)
        if layer.bias is not None:
            y = keras.ops.add(y, layer.bias)
        return y if layer.activation is None else layer.activation(y)


class Vocabulary(TensorLayout):
    """An Embedding split by vocabulary rows.

    A `keras.layers.ReversibleEmbedding` (a tied output projection, as in
    keras-hub's causal LMs) called with `reverse=True` gives each rank the
    logits of the rows it holds, V/t of them: gathered into the whole logits,
    or left sharded for `ShardedSoftmaxCrossEntropy` when `sharded_loss`
    (the model's output, `vocab_parallel_classifier=True`). An untied
    `reverse_embeddings` (d, V) is split by its vocabulary columns alike,
    or kept whole (`split_reverse=False`: the reverse call then computes the
    whole logits on every rank, as keras-hub's Llama `get_layout_map` asks).

    Args:
        sharded_loss: the reverse call's logits feed the sharded softmax loss
            inside tfdist's training step.
        split_reverse: split an untied reverse table (else it stays whole).

    Example:

    ```python
    Vocabulary().apply(model.layers[0], strategy.tensor_mesh)   # (V, d) -> (V/t, d)
    ```
    """

    name = "vocabulary"

    def __init__(self, sharded_loss=False, split_reverse=True):
        self.sharded_loss = sharded_loss
        self.split_reverse = split_reverse

    def weight_axes(self, layer):
        """The table by rows (an untied reverse table by columns, if split)."""
        axes = [(keras_layers.embeddings_variable(layer), 0)]
        if self.split_reverse and getattr(layer, "reverse_embeddings", None) is not None:
            axes.append((layer.reverse_embeddings, 1))
        return axes

    def sharded_call(self, layer, mesh, inputs, reverse=False):
        """This rank's rows looked up (zeros for ids it does not own), summed
        ("g"); reversed, this rank's slice of the logits (all of them from a
        whole reverse table)."""
        if reverse and not self.split_reverse and layer.reverse_embeddings is not None:
            return type(layer).call(layer, inputs, reverse=True)
        if reverse:
            logits = type(layer).call(layer, mesh.copy(inputs), reverse=True)
            return logits if self.sharded_loss and logits_are_sharded() else (
                mesh.gather_last(logits))
        if isinstance(inputs, tf.RaggedTensor):  # the ids' vectors, in the same rows
            return inputs.with_flat_values(self.sharded_call(layer, mesh, inputs.flat_values))
        rows = layer.input_dim // mesh.tensor
        ids = tf.cast(inputs, tf.int32) - mesh.rank() * rows
        owned = tf.logical_and(ids >= 0, ids < rows)
        found = tf.gather(tf.convert_to_tensor(layer.embeddings),
                          tf.where(owned, ids, tf.zeros_like(ids)))
        found = found * tf.cast(owned, found.dtype)[..., tf.newaxis]
        result = tf.cast(mesh.reduce(found), layer.compute_dtype)
        # ReversibleEmbedding sets its mask in its call, which this replaces.
        keras_layers.set_keras_mask(result, keras.layers.Embedding.compute_mask(layer, inputs))
        return result


class Heads(TensorLayout):
    """A MultiHeadAttention split by heads.

    Example:

    ```python
    Heads().apply(block_attention, strategy.tensor_mesh)   # 8 heads -> 8/t per device
    ```
    """

    name = "heads"

    @staticmethod
    def _parts(layer):
        """[(sublayer, its layout)]: query/key/value (d, heads, size) by
        heads as `Column`s, the output projection (heads, size, d) as `Row`."""
        return [*((p, Column(axis=-2, copy_input=False))
                  for p in keras_layers.attention_projections(layer)),
                (keras_layers.attention_output_projection(layer), Row())]

    def weight_axes(self, layer):
        """Query/key/value by heads (their `Column`), the output's by heads (`Row`)."""
        return [pair for part, layout in self._parts(layer) for pair in layout.weight_axes(part)]

    def split(self, layer, mesh):
        """Query/key/value `Column` by heads, the output projection `Row`."""
        for part, layout in self._parts(layer):
            layout.apply(part, mesh)

    def sharded_call(self, layer, mesh, query, value, key=None, **kwargs):
        """The layer's own call, each distinct input through "f" once."""
        copies = {}

        def copy(x):  # self-attention: once
            if x is None:
                return None
            if id(x) not in copies:
                copies[id(x)] = mesh.copy(x)
                keras_layers.copy_keras_mask(x, copies[id(x)])
            return copies[id(x)]

        return type(layer).call(layer, copy(query), copy(value), copy(key), **kwargs)


def _split(variable, axis, mesh):
    layout = AxisLayout(variable.shape, axis, mesh.tensor)
    if mesh.strategy.config.shards_parameters:  # straight into zero=3's shards of each rank's slice
        layout = MeshShardLayout(variable.shape, mesh.tensor, mesh.data, layout)
    with mesh.strategy.scope():
        shard_keras_variable(variable, layout, mesh.strategy)
