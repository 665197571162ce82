"""Estimated compute of one layer call: FLOPs per example, by kind of layer.

Pipeline stages are balanced by these estimates (`tfdist.pipeline.stages`).
The shapes are the call's own, per example (without the batch dimension),
with every length the graph leaves unknown (`None`, usually the sequence)
set to `sequence_length` (1 when it is not known). A multiply-add is 2 FLOPs.

- `Dense`: 2 · kernel · positions, plus one per output element (bias,
  activation).
- `EinsumDense`: 2 · kernel · positions, positions being the input's
  elements over the lengths the kernel contracts.
- `MultiHeadAttention`: its projections, 2 · kernel · positions each, plus
  QKᵀ and AV, 2 · Tq · Tk · heads · (key_dim + value_dim), plus 5 per
  score (scale, mask, softmax): the sequence-squared work.
- `Embedding` and any layer named `...Embedding` (keras-hub's
  `PositionEmbedding`): a lookup, one per output element.
- `Embedding(x, reverse=True)`, a tied output projection: a matmul,
  2 · vocabulary · width per position.
- `LayerNormalization` and any layer named `...Normalization`: 5 per
  output element.
- A layer made of sublayers (keras-hub's `TransformerDecoder` and
  `TransformerEncoder`): the sum of its sublayers', each at the call's
  positions and sequence length.
- Anything else: 2 · weights · positions, plus one per output element (a
  convolution's kernel is used once per output position).

Positions are the elements of the call's main input divided by its last
(feature) dimension: the tokens of a sequence, the pixels of an image. The
main input is the first positional tensor, or for a call by keywords only
(keras-hub's BART decoder blocks) the tensor of highest rank, not a mask.
"""

import dataclasses
import math

import keras
from keras import tree

from tfdist._compat.keras_functional import direct_sublayers

# Operations per element of a normalization and per attention score.
NORMALIZATION_OPS = 5
SOFTMAX_OPS = 5


@dataclasses.dataclass(frozen=True)
class CallShapes:
    """The per-example shapes of one layer call (no batch dimension), every
    unknown length filled in.

    Example:

    ```python
    CallShapes(inputs=((1024, 768),), outputs=((1024, 768),))
    ```
    """

    inputs: tuple
    outputs: tuple
    reverse: bool = False

    @property
    def positions(self) -> int:
        """The main (first) input's elements over its last dimension (tokens, pixels)."""
        shape = self.inputs[0] if self.inputs else self.outputs[0]
        return math.prod(shape[:-1]) if shape else 1


def shapes_of(node, sequence_length=None) -> CallShapes:
    """`node`'s per-example shapes, unknown lengths set to `sequence_length`
    (1 when None).

    Example:

    ```python
    shapes_of(node, sequence_length=1024).positions   # 1024 for (None, None, 768)
    ```
    """
    def known(tensor):
        return tuple(d if d is not None else (sequence_length or 1) for d in tensor.shape[1:])

    reverse = bool(node.arguments.kwargs.get("reverse", False))
    return CallShapes(tuple(known(x) for x in _main_input_first(node)),
                      tuple(known(x) for x in node.outputs), reverse)


def _main_input_first(node):
    """The call's input tensors, the one that carries the sequence first: the
    first positional one, or for a call by keywords only (`block(inputs=x,
    decoder_padding_mask=m)`, whose tensors Keras lists by keyword name) the
    one of highest rank, then most known elements, not the mask."""
    tensors = list(node.input_tensors)
    positional = [x for x in tree.flatten(node.arguments.args)
                  if any(x is tensor for tensor in tensors)]
    if positional:
        main = positional[0]
    elif tensors:
        main = max(tensors, key=lambda x: (len(x.shape), math.prod(
            d for d in x.shape[1:] if d is not None)))
    else:
        return tensors
    return [main, *(x for x in tensors if x is not main)]


def sequence_length_of(inputs, x):
    """The longest length a batch `x` gives to a dimension (after the batch)
    that the model's `inputs` leave unknown; None when there is none or the
    batch's shapes are not known either.

    Example:

    ```python
    sequence_length_of(gpt2_backbone.inputs, {"token_ids": ids, "padding_mask": mask})
    # 1024 for ids and mask of shape (8, 1024)
    ```
    """
    values = tree.flatten(x)
    if len(values) != len(inputs):
        return None
    lengths = []
    for symbolic, value in zip(inputs, values):
        value = getattr(value, "values", (value,))[0]  # one replica's, if per replica
        shape = getattr(value, "shape", None)
        if shape is None or len(shape) != len(symbolic.shape):
            return None
        lengths += [n for s, n in zip(symbolic.shape[1:], tuple(shape)[1:])
                    if s is None and n is not None]
    return max(lengths, default=None)


def node_cost(node, sequence_length=None) -> float:
    """Estimated FLOPs per example of one layer call (a functional graph's
    node), its unknown lengths set to `sequence_length`.

    Example:

    ```python
    node_cost(inbound_nodes(dense)[0])   # Dense(64 -> 32): 2*64*32 + 32
    ```
    """
    return layer_cost(node.operation, shapes_of(node, sequence_length))


def layer_cost(layer, shapes: CallShapes) -> float:
    """Estimated FLOPs per example of `layer` called with `shapes` (the
    table in this module's docstring).

    Example:

    ```python
    layer_cost(keras.layers.Dense(32), CallShapes(((64,),), ((32,),)))   # after build
    ```
    """
    if isinstance(layer, keras.layers.MultiHeadAttention):
        return attention_cost(layer, shapes)
    if isinstance(layer, keras.layers.Embedding) and shapes.reverse:
        return tied_projection_cost(layer, shapes)
    if _kind_is(layer, keras.layers.Embedding, "Embedding"):
        return lookup_cost(layer, shapes)
    if isinstance(layer, keras.layers.Dense):
        return dense_cost(layer, shapes)
    if isinstance(layer, keras.layers.EinsumDense):
        return einsum_dense_cost(layer, shapes)
    if _kind_is(layer, keras.layers.LayerNormalization, "Normalization"):
        return normalization_cost(layer, shapes)
    if _weighted_sublayers(layer):
        return composite_cost(layer, shapes)
    return weights_per_position_cost(layer, shapes)


def dense_cost(layer, shapes):
    """2 · kernel · positions, plus one per output element."""
    return 2 * _size(layer.kernel) * shapes.positions + shapes.positions * layer.units


def einsum_dense_cost(layer, shapes):
    """2 · kernel · the input's elements over the lengths the kernel contracts."""
    operand, kernel_axes = layer.equation.split("->")[0].split(",")
    contracted = math.prod(size for axis, size in zip(kernel_axes, layer.kernel.shape)
                           if axis in operand)
    return 2 * _size(layer.kernel) * math.prod(shapes.inputs[0]) // contracted


def attention_cost(layer, shapes):
    """The projections, plus QKᵀ, softmax and AV over every query-key pair."""
    queries = shapes.positions
    keys = math.prod(shapes.inputs[1][:-1]) if len(shapes.inputs) > 1 else queries
    projections = 2 * sum(_size(w) for w in layer.weights) * queries
    pairs = queries * keys * layer.num_heads
    return (projections + 2 * pairs * (layer.key_dim + layer.value_dim)
            + SOFTMAX_OPS * pairs)


def lookup_cost(layer, shapes):
    """One per output element: a gather, not a matmul."""
    return sum(math.prod(shape) for shape in shapes.outputs)


def tied_projection_cost(layer, shapes):
    """The reverse call of a tied embedding: a matmul with the table."""
    return 2 * _size(layer.embeddings) * shapes.positions


def normalization_cost(layer, shapes):
    """A few operations per element (mean, variance, scale, shift)."""
    return NORMALIZATION_OPS * shapes.positions * _width(layer, shapes)


def composite_cost(layer, shapes):
    """The sum of its sublayers' costs, each at the call's shapes."""
    inner = CallShapes(shapes.inputs[:1], shapes.inputs[:1])
    return sum(layer_cost(sublayer, inner) for sublayer in _weighted_sublayers(layer))


def weights_per_position_cost(layer, shapes):
    """Each weight used once per output position, plus one per output element."""
    weights = sum(_size(w) for w in getattr(layer, "weights", ()))
    cost = 0.0
    for shape in shapes.outputs:
        elements = math.prod(shape)
        positions = elements // shape[-1] if shape else 1
        cost += 2 * weights * positions + elements
    return cost


def _kind_is(layer, keras_class, name_suffix):
    """Whether `layer` is a `keras_class`, or a layer of another library whose
    class name ends with `name_suffix` (keras-hub's `PositionEmbedding`)."""
    return isinstance(layer, keras_class) or type(layer).__name__.endswith(name_suffix)


def _weighted_sublayers(layer):
    """The layers `layer` is made of that have weights (none for a Keras op)."""
    if not isinstance(layer, keras.layers.Layer):
        return []
    return [sub for sub in direct_sublayers(layer) if sub.weights]


def _width(layer, shapes):
    """The layer's output width: its weights' last dimension, else the call's."""
    widths = [w.shape[-1] for w in getattr(layer, "weights", ()) if w.shape]
    if widths:
        return widths[-1]
    return shapes.outputs[0][-1] if shapes.outputs and shapes.outputs[0] else 1


def _size(variable):
    return math.prod(variable.shape)
