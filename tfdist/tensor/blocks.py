"""Tensor plans inside custom layers (Transformer blocks), from their data flow.

A custom layer (a keras-hub `TransformerDecoder`, `LlamaTransformerDecoder`,
...) calls its sublayers inside `call`, so no functional graph shows which
Dense feeds which. `block_decisions` traces the layer's `call` on symbolic
tensors (`traced_call`) and reads the pairs from that data flow:

- **Column group -> row**: a Dense whose input is computed only from the
  outputs of other Dense layers, through elementwise operations only (an
  activation, a cast, a product, dropout), is row-parallel and those Dense
  layers column-parallel, sharing one "f" of their input: an MLP
  (up -> down) or a gated MLP (`activation(gate) * up -> down`). An
  EinsumDense that is a matrix product over the last axis (`"btd,df->btf"`,
  as Gemma's MLP) counts as a Dense (`is_matmul`).
- **Attention by heads**: a custom layer whose weights are only EinsumDense
  projections with (d, heads, size) kernels reading its input, feeding one
  EinsumDense with a (heads, size, d) kernel that makes its output: the
  projections column-parallel by heads, the output row-parallel. Every
  projection's head count must be divisible by `tensor` (grouped-query
  attention: the key/value heads too).
- **Attention by hidden features**, where heads cannot be split (a kernel
  holding its heads first, as Gemma's (heads, d, size); head counts
  `tensor` does not divide): the projections row-parallel over their input
  features (each device multiplies its slice of the input, the group sums),
  the attention between computed whole on every device, the output
  projection row-parallel over its input's heads. Also the alternative a
  `LayoutMap` may ask for instead of heads (keras-hub's Llama map does).
- Other sublayers are decided like top-level layers (`decide`), and each
  weighted sublayer left whole says why.

Example:

```python
decisions = block_decisions(backbone.get_layer("transformer_layer_0"), 2, decide)
[(d.layer.name, d.layout.name) for d in decisions]
# [('self_attention', 'heads'), ('self_attention_layer_norm', 'replicated'),
#  ('feedforward_intermediate_dense', 'column'), ('feedforward_output_dense', 'row'), ...]
```
"""

import dataclasses
import re

import keras

from tfdist._compat import keras_functional, keras_layers
from tfdist.tensor.column_group import (
    ColumnOfGroup,
    RowOfSlicedInput,
    SharedInput,
    kernel_axis,
)
from tfdist.tensor.decision import Decision
from tfdist.tensor.layouts import PerSlice, Replicated, Row

# Keras activations that act element by element (safe on a slice of features).
_ELEMENTWISE_ACTIVATIONS = (
    "linear", "relu", "relu6", "leaky_relu", "elu", "selu", "gelu", "silu",
    "swish", "mish", "tanh", "sigmoid", "hard_sigmoid", "hard_silu",
    "softplus", "softsign", "exponential",
)

# Keras operations (classes of `keras.ops` and of activations, lower-cased)
# and layers that act element by element on equally shaped operands.
_ELEMENTWISE_OPERATIONS = frozenset((
    "add", "subtract", "multiply", "divide", "cast", "dropout", "relu", "relu6",
    "leakyrelu", "elu", "selu", "gelu", "silu", "mish", "tanh", "sigmoid",
    "hardsigmoid", "hardsilu", "softplus", "softsign", "exp", "power", "sqrt",
    "negative", "absolute", "square", "maximum", "minimum", "erf", "rsqrt", "reciprocal",
    "gaussiannoise", "gaussiandropout", "alphadropout",
))


def activation_name(layer):
    """The name of a Dense layer's activation.

    Example:

    >>> activation_name(keras.layers.Dense(4, activation="gelu"))
    'gelu'
    """
    return getattr(layer.activation, "__name__", None) or str(layer.activation)


def activation_is_elementwise(layer) -> bool:
    """Whether a Dense layer's activation acts element by element (so it
    may act on a slice of the features): a Keras activation known to, or a
    function whose Keras operations on a symbolic input all are
    (keras-hub's `gelu_approximate`); `softmax` is not.

    Example:

    >>> activation_is_elementwise(keras.layers.Dense(4, activation="gelu"))
    True
    """
    if activation_name(layer) in _ELEMENTWISE_ACTIVATIONS:
        return True
    try:
        steps = keras_functional.traced_function(layer.activation, (2, output_units(layer)))
    except Exception:  # noqa: BLE001 - not traceable: not known to be elementwise
        return False
    return all(_is_elementwise(step.operation) for step in steps)


def is_matmul(layer) -> bool:
    """Whether `layer` multiplies its input's last axis by a 2-D kernel: a
    Dense, or an EinsumDense whose equation says the same (any bias on the
    output axis).

    Example:

    >>> is_matmul(keras.layers.EinsumDense("btd,df->btf", output_shape=(None, 8)))
    True
    >>> is_matmul(keras.layers.EinsumDense("btd,dnh->btnh", output_shape=(None, 2, 4)))
    False
    """
    if type(layer) is keras.layers.Dense:
        return True
    if type(layer) is not keras.layers.EinsumDense:
        return False
    found = re.fullmatch(r"([\w.]*)(\w),(\w)(\w)->([\w.]*)(\w)",
                         layer.equation.replace(" ", ""))
    if not found:
        return False
    batch, inner, inner_again, out, batch_again, out_again = found.groups()
    return (batch == batch_again and inner == inner_again and out == out_again
            and inner != out and inner not in batch and out not in batch
            and layer.bias_axes in (None, out))


def output_units(layer) -> int:
    """The output features of a layer `is_matmul` accepts.

    Example:

    >>> output_units(keras.layers.Dense(4))
    4
    """
    if type(layer) is keras.layers.Dense:
        return layer.units
    return keras_layers.kernel_variable(layer).shape[-1]


def _is_elementwise(operation):
    return type(operation).__name__.lower() in _ELEMENTWISE_OPERATIONS


def is_elementwise_layer(layer) -> bool:
    """Whether a weightless layer acts element by element on its one input
    (Dropout and its kin, ReLU, an elementwise `Activation`), so it may sit
    between a column-split Dense and its row-split consumer.

    Example:

    >>> is_elementwise_layer(keras.layers.Dropout(0.1)), is_elementwise_layer(
    ...     keras.layers.Activation("softmax"))
    (True, False)
    """
    if layer.weights:
        return False
    if isinstance(layer, keras.layers.Activation):
        return activation_name(layer) in _ELEMENTWISE_ACTIVATIONS
    return _is_elementwise(layer)


def is_custom_layer(layer) -> bool:
    """Whether `layer` is a custom (non-Model) layer with weighted sublayers.

    Example:

    >>> is_custom_layer(keras.layers.Dense(4))
    False
    """
    return (not isinstance(layer, keras.Model)
            and type(layer).__module__.split(".")[0] != "keras"
            and any(sub.weights for sub in keras_functional.nested_sublayers(layer)))


def block_decisions(layer, tensor, decide, arguments=None):
    """The decisions for the weighted sublayers of custom `layer`.

    Args:
        layer: a built custom layer called on symbolic inputs.
        tensor: the tensor-group size.
        decide: `decide(sublayer, arguments)`, the list of decisions for a
            sublayer none of this module's rules splits (a MultiHeadAttention,
            an Embedding, a nested custom layer called with `arguments`...).
        arguments: the `(args, kwargs)` `layer` is called with (by default
            those of its first call).

    Example:

    ```python
    block_decisions(block, 2, decide)   # see the module's docstring
    ```
    """
    try:
        steps = keras_functional.traced_call(layer, arguments)
    except Exception as error:  # noqa: BLE001 - any failure leaves the layer whole
        first_line = str(error).strip().splitlines()[0]
        return _replicated_sublayers(
            layer, f"its call could not be traced ({type(error).__name__}: {first_line})")
    attention = _attention(layer, steps, tensor)
    if attention is not None:
        return attention
    decisions, taken, why = [], set(), {}
    for step in steps:
        if is_matmul(step.operation):
            pair = _column_group(step, steps, tensor, taken)
            if isinstance(pair, dict):
                why.update((key, value) for key, value in pair.items() if key not in taken)
            else:
                decisions.extend(pair)
                taken.update(id(d.layer) for d in pair)
    arguments_of = {id(step.operation): step.arguments for step in steps}
    for sub in keras_functional.direct_sublayers(layer):
        if id(sub) in taken or not sub.weights:
            continue
        if is_matmul(sub):
            decisions.append(Decision(sub, Replicated(), why.get(
                id(sub), "no Dense reads its output through elementwise operations")))
        else:
            decisions.extend(decide(sub, arguments_of.get(id(sub))))
    nested = keras_functional.nested_sublayers(layer)
    inner = {id(w) for sub in nested for w in sub.weights}
    own = [w.name for w in layer.weights if id(w) not in inner]
    if own:
        decisions.append(Decision(layer, Replicated(), f"its own weights {own} are not split"))
    order = {id(sub): i for i, sub in enumerate(nested)}
    return sorted(decisions, key=lambda d: order.get(id(d.layer), -1))


def _replicated_sublayers(layer, reason):
    return [Decision(sub, Replicated(), reason)
            for sub in keras_functional.nested_sublayers(layer)
            if sub.weights and not keras_functional.nested_sublayers(sub)]


def _producers(steps):
    return {id(t): step for step in steps for t in step.outputs}


def _consumers(steps):
    found = {}
    for step in steps:
        for t in step.inputs:
            found.setdefault(id(t), []).append(step)
    return found


def _calls(steps):
    counts = {}
    for step in steps:
        counts[id(step.operation)] = counts.get(id(step.operation), 0) + 1
    return counts


def _column_group(row_step, steps, tensor, taken):
    """[column..., row] decisions for the Dense of `row_step`, else why not:
    {id(layer): reason} for the row and the column partner to blame."""
    row = row_step.operation
    producers, consumers, calls = _producers(steps), _consumers(steps), _calls(steps)
    if calls[id(row)] != 1:
        return {id(row): f"called {calls[id(row)]} times"}
    columns, pending = [], list(row_step.inputs)
    while pending:
        tensor_ = pending.pop()
        step = producers.get(id(tensor_))
        if step is None:
            return {id(row): "its input is not computed from a Dense's output"}
        if not is_matmul(step.operation) and not _is_elementwise(step.operation):
            return {id(row): f"{type(step.operation).__name__} {step.operation.name!r} "
                             f"before it is not elementwise"}
        if len(consumers.get(id(tensor_), ())) != 1:
            return {id(row): f"the output of {step.operation.name} is read elsewhere too"}
        if is_matmul(step.operation):
            columns.append(step.operation)
        else:
            pending.extend(step.inputs)
    for column in columns:
        reason = _column_refusal(column, columns, calls, tensor, taken)
        if reason:
            return {id(row): f"its column partner {column.name}: {reason}",
                    id(column): f"column partner of {row.name}, but {reason}"}
    shared, names = SharedInput(), ", ".join(c.name for c in columns)
    units = output_units(columns[0])
    return [Decision(c, ColumnOfGroup(shared), f"column of {row.name} ({units} -> "
                     f"{units // tensor} units per device)", group=shared) for c in columns] + [
        Decision(row, Row(), f"sums the slices of {names} (one all-reduce)", group=shared)]


def _column_refusal(column, columns, calls, tensor, taken):
    """Why `column` cannot be column-parallel in its group, else None."""
    if id(column) in taken:
        return "already paired"
    if calls[id(column)] != 1:
        return f"called {calls[id(column)]} times"
    units = output_units(column)
    if units != output_units(columns[0]):
        return f"units={units} differ from {columns[0].name}'s"
    if units % tensor:
        return f"units={units} is not divisible by tensor={tensor}"
    if not activation_is_elementwise(column):
        return f"activation {activation_name(column)!r} is not elementwise"
    if any(w.constraint is not None for w in column.trainable_weights):
        return "a weight has a constraint, which acts on the whole weight"
    return None


def _attention(layer, steps, tensor):
    """Decisions splitting an attention-shaped custom layer by heads (else
    by its hidden features, else whole, saying why), or None if `layer` is
    not attention-shaped: projections (Dense / EinsumDense) reading only its
    inputs, whose outputs are mixed by a product (queries with keys) and all
    reach one output projection; weighted layers between them (a norm of
    each head) are neither."""
    by_layer = {id(step.operation): step for step in steps}
    weighted = [sub for sub in keras_functional.nested_sublayers(layer) if sub.weights]
    if not weighted or any(sum(step.operation is sub for step in steps) != 1 for sub in weighted):
        return None
    producers = _producers(steps)
    matmuls = [sub for sub in weighted
               if type(sub) in (keras.layers.Dense, keras.layers.EinsumDense)]
    projections = [sub for sub in matmuls if all(
        id(t) not in producers for t in by_layer[id(sub)].inputs)]
    outputs = [sub for sub in matmuls if all(sub is not p for p in projections)]
    between = [sub for sub in weighted if all(sub is not m for m in matmuls)]
    if (len(outputs) != 1 or not projections
            or not _reaches(projections, by_layer[id(outputs[0])], producers)
            or not _mixes(projections, steps)):
        return None
    output = outputs[0]
    by_hidden = _attention_by_hidden(projections, output, tensor)
    if not isinstance(by_hidden, str):
        by_hidden += [Decision(sub, Replicated(), "runs whole on every device (the attention "
                               "computed whole)", group=by_hidden[0].group) for sub in between]
    why_not = _heads_refusal(projections, output, between, by_layer, tensor)
    if why_not is None:
        shared = SharedInput()
        heads = [keras_layers.kernel_variable(p).shape[-2] for p in projections]
        by_heads = [Decision(p, ColumnOfGroup(shared, axis=-2),
                             f"{n} heads -> {n // tensor} per device", group=shared)
                    for p, n in zip(projections, heads)] + [
            Decision(output, Row(), f"sums the heads of {', '.join(p.name for p in projections)}",
                     group=shared)] + [
            Decision(sub, PerSlice(), "acts on each head: on each device's heads, the "
                     "gradients of its weights summed over the group", group=shared)
            for sub in between]
        if isinstance(by_hidden, str):
            return by_heads
        return [dataclasses.replace(d, alternatives=((h.layout, h.reason),))
                for d, h in zip(by_heads, by_hidden)]
    if isinstance(by_hidden, str):
        return _replicated_sublayers(layer, f"attention left whole: {why_not}; {by_hidden}")
    return [dataclasses.replace(d, reason=f"{d.reason}; not by heads: {why_not}")
            for d in by_hidden]


def _mixes(projections, steps):
    """Whether an operation that is not elementwise combines two tensors
    computed from the projections' outputs (queries times keys)."""
    derived = set()
    for step in steps:
        if any(step.operation is p for p in projections):
            derived.update(id(t) for t in step.outputs)
            continue
        reading = sum(id(t) in derived for t in step.inputs)
        if reading >= 2 and not _is_elementwise(step.operation) and not getattr(
                step.operation, "weights", None):
            return True
        if reading:
            derived.update(id(t) for t in step.outputs)
    return False


def _acts_per_head(layer, step):
    """Whether `layer` (called in `step`) acts on each head of its input
    alone, so that it may run on a device's heads (a query/key norm, as
    Qwen3's): one input of rank >= 4 (..., heads, size), only trainable
    weights, each a vector of `size`, and operations that are elementwise or
    act along the last axis only."""
    if len(step.inputs) != 1 or layer.non_trainable_weights:
        return False
    shape = step.inputs[0].shape
    if len(shape) < 4 or any(tuple(w.shape) != (shape[-1],) for w in layer.weights):
        return False
    try:
        inner = keras_functional.traced_call(layer, step.arguments)
    except Exception:  # noqa: BLE001 - not traceable: not known to act per head
        return False
    return all(_is_elementwise(s.operation) or _along_last_axis(s) for s in inner)


def _along_last_axis(step):
    """Whether the operation of `step` reduces (or acts) along its input's last axis only."""
    axis = getattr(step.operation, "axis", None)
    if axis is None or len(step.inputs) != 1:
        return False
    rank = len(step.inputs[0].shape)
    axes = axis if isinstance(axis, (list, tuple)) else (axis,)
    return all(isinstance(a, int) and a % rank == rank - 1 for a in axes)


def _heads_refusal(projections, output, between, by_layer, tensor):
    """Why the attention cannot be split by heads, else None: every
    projection an EinsumDense holding its heads on kernel axis 1, (d, heads,
    size), the output one whose kernel starts with them, (heads, size, d),
    `tensor` dividing every head count, and each weighted layer between
    acting on each head alone."""
    for layer in [*projections, output]:
        shape = tuple(keras_layers.kernel_variable(layer).shape)
        if type(layer) is not keras.layers.EinsumDense or len(shape) != 3:
            return (f"{layer.name}'s kernel {shape} has no axis of heads (its heads are "
                    f"reshaped by the layer's own head count)")
    for projection in projections:
        axis = _heads_axis(projection)
        if axis != 1:
            return (f"{projection.name}'s kernel {tuple(projection.kernel.shape)} holds its "
                    f"heads on axis {axis}, not 1")
    heads = {p.kernel.shape[1] for p in projections}
    if output.kernel.shape[0] not in heads:
        return f"{output.name}'s kernel {tuple(output.kernel.shape)} does not start with heads"
    for layer, count in [(p, p.kernel.shape[1]) for p in projections] + [
            (output, output.kernel.shape[0])]:
        if count % tensor:
            return f"{layer.name}'s {count} heads are not divisible by tensor={tensor}"
    for sub in between:
        if not _acts_per_head(sub, by_layer[id(sub)]):
            return f"{sub.name} ({type(sub).__name__}) does not act on each head alone"
    return None


def _attention_by_hidden(projections, output, tensor):
    """Decisions splitting the projections by their input (hidden) features
    and the output projection by the heads (or size) of its input, the
    attention between them computed whole on every device; else why not."""
    group = SharedInput()
    decisions = []
    for projection in projections:
        axis = kernel_axis(projection, -1)
        hidden = None if axis is None else projection.kernel.shape[axis]
        if hidden is None or hidden % tensor:
            return f"{projection.name}'s input features are not divisible by tensor={tensor}"
        decisions.append(Decision(
            projection, RowOfSlicedInput(group, -1),
            f"input features {hidden} -> {hidden // tensor} per device, partial products "
            f"summed", group=group))
    sizes = ((-1, "features"),) if len(output.kernel.shape) == 2 else (
        (-2, "heads"), (-1, "head size"))
    for axis, what in sizes:
        contracted = kernel_axis(output, axis)
        size = None if contracted is None else output.kernel.shape[contracted]
        if size is not None and not size % tensor:
            return decisions + [Decision(
                output, RowOfSlicedInput(SharedInput(), axis),
                f"its input's {size} {what} -> {size // tensor} per device (the attention "
                f"computed whole on every device)", group=group)]
    return (f"neither the heads nor the head size of {output.name}'s input are divisible "
            f"by tensor={tensor}")


def _heads_axis(projection):
    """The kernel axis of an attention projection's heads: the first output
    axis its input does not have ("btd,dnh->btnh": n, axis 1)."""
    inputs, outputs = projection.equation.replace(" ", "").split("->")
    data, kernel = inputs.split(",")
    heads = next(letter for letter in outputs if letter not in data)
    return kernel.index(heads)


def _reaches(projections, output_step, producers):
    """Whether every projection's output flows into `output_step`."""
    found, pending, seen = set(), list(output_step.inputs), set()
    while pending:
        step = producers.get(id(pending.pop()))
        if step is None or id(step) in seen:
            continue
        seen.add(id(step))
        found.add(id(step.operation))
        pending.extend(step.inputs)
    return all(id(p) in found for p in projections)
