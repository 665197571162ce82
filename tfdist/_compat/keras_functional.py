"""Keras functional-graph internals: a model's nodes, how it calls a node.

A functional (or built Sequential) Keras model is a graph of nodes, one per
layer call; Keras exposes neither the graph nor a layer's nodes publicly.
tfdist walks it to cut pipeline stages and to pair tensor-parallel layers,
and traces a custom layer's `call` the same way to see its sublayers' data flow.
"""

import functools

from keras import tree
from keras.src import backend
from keras.src.backend.common.keras_tensor import KerasTensor
from keras.src.layers import Layer
from keras.src.models.functional import operation_fn


def functional_graph_of(sequential):
    """The functional model a built Sequential model runs (`_functional`),
    or None before its input shape is known.

    Example:

    ```python
    functional_graph_of(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    ```
    """
    return sequential._functional


def is_functional_graph(model) -> bool:
    """Whether `model` is a functional graph (has nodes by depth).

    Example:

    ```python
    is_functional_graph(keras.Model(inputs, outputs))   # True
    ```
    """
    return hasattr(model, "_nodes_by_depth")


def nodes_by_depth(graph) -> dict:
    """The graph's nodes by depth: {depth: [node, ...]}, the outputs at depth 0.

    Example:

    ```python
    nodes_by_depth(model)[0]   # the nodes producing the outputs
    ```
    """
    return graph._nodes_by_depth


def node_call(operation, training):
    """The function Keras's functional model calls to run `operation` in one
    node (`operation_fn`: passes `training` when the layer takes it).

    Example:

    ```python
    outputs = node_call(node.operation, training=True)(*args, **kwargs)
    ```
    """
    return operation_fn(operation, training=training)


def outputs_structure(graph):
    """The nested structure of the graph's outputs (`_outputs_struct`), to
    pack a flat list of output values into.

    Example:

    ```python
    keras.tree.pack_sequence_as(outputs_structure(model), flat_outputs)
    ```
    """
    return graph._outputs_struct


def standardize_inputs(graph, x):
    """`x` in the structure of the graph's inputs (Keras's `_standardize_inputs`).

    Example:

    ```python
    keras.tree.flatten(standardize_inputs(model, x))   # aligned with model.inputs
    ```
    """
    return graph._standardize_inputs(x)


def inbound_nodes(layer):
    """The nodes in which `layer` was called (`_inbound_nodes`).

    Example:

    ```python
    inbound_nodes(dense)[0].outputs   # the outputs of its first call
    ```
    """
    return layer._inbound_nodes


def outbound_nodes(layer):
    """The nodes that consume an output of `layer` (`_outbound_nodes`).

    Example:

    ```python
    [node.operation for node in outbound_nodes(dense)]   # its consumers
    ```
    """
    return layer._outbound_nodes


def direct_sublayers(model):
    """The layers `model` tracks directly, in order (not itself, not nested
    ones: Keras's `_flatten_layers(include_self=False, recursive=False)`).

    Example:

    ```python
    direct_sublayers(model)   # [InputLayer, Dense, Dense]
    ```
    """
    return model._flatten_layers(include_self=False, recursive=False)


def nested_sublayers(model):
    """Every layer `model` tracks, nested ones included, in order (not itself:
    Keras's `_flatten_layers(include_self=False)`).

    Example:

    ```python
    nested_sublayers(model)   # the layers of its blocks too
    ```
    """
    return model._flatten_layers(include_self=False)


class TracedStep:
    """One operation called while tracing a layer's `call`: the `operation`
    (a layer or a Keras op), the symbolic tensors it read and produced, and
    the `(args, kwargs)` it was called with.

    Example:

    ```python
    [type(step.operation).__name__ for step in traced_call(block)]
    # ['LayerNormalization', 'MultiHeadAttention', 'Add', 'Dense', ...]
    ```
    """

    def __init__(self, node):
        self.operation = node.operation
        self.inputs = tuple(node.input_tensors)
        self.outputs = tuple(node.output_tensors)
        self.arguments = (node.arguments.args, node.arguments.kwargs)


def traced_call(layer, arguments=None, placeholder_size=2):
    """The operations `layer.call` performs, in call order (`TracedStep`s).

    The layer's `call` runs once on fresh symbolic tensors shaped like
    `arguments` (`(args, kwargs)`; by default those of its first call, from
    its first inbound node), unknown sizes set to `placeholder_size`, so
    Keras records a node for every sublayer and op it calls; those nodes are
    removed from the sublayers afterwards. Its arguments are the tensors no
    step produced. Raises ValueError for a layer never called symbolically.

    Example:

    ```python
    steps = traced_call(model.get_layer("transformer_layer_0"))
    ```
    """
    if arguments is None:
        if not layer._inbound_nodes:
            raise ValueError(f"layer {layer.name!r} was never called on symbolic inputs")
        arguments = (layer._inbound_nodes[0].arguments.args,
                     layer._inbound_nodes[0].arguments.kwargs)
    args, kwargs = tree.map_structure(lambda v: _placeholder(v, placeholder_size), arguments)
    sublayers = layer._flatten_layers(include_self=False)
    saved = [(sub, list(sub._inbound_nodes), list(sub._outbound_nodes)) for sub in sublayers]
    # Keras's generic symbolic call (the sublayer's call on placeholders), for
    # layers with their own `compute_output_spec` too (some take fewer
    # arguments than their `call`: keras-hub's cached attention), each None it
    # returns (an attention's absent cache) made a placeholder: a Keras node
    # holds tensors only.
    try:
        for sub in sublayers:
            own = type(sub).compute_output_spec is not Layer.compute_output_spec
            spec = (functools.partial(backend.compute_output_spec, sub.call) if own
                    else sub.compute_output_spec)
            sub.compute_output_spec = functools.partial(_without_none, spec)
        return _steps_to(type(layer).call(layer, *args, **kwargs))
    finally:
        for sub in sublayers:
            del sub.compute_output_spec
        for sub, inbound, outbound in saved:
            sub._inbound_nodes[:] = inbound
            sub._outbound_nodes[:] = outbound


def _without_none(spec, *args, **kwargs):
    outputs = spec(*args, **kwargs)
    return tree.map_structure(lambda v: KerasTensor(()) if v is None else v, outputs)


def traced_function(function, shape, dtype="float32"):
    """The Keras operations `function` performs on one input of `shape`.

    Example:

    ```python
    [type(s.operation).__name__ for s in traced_function(keras.activations.gelu, (2, 8))]
    # ['Gelu']
    ```
    """
    return _steps_to(function(KerasTensor(shape, dtype)))


def _placeholder(value, size):
    if not isinstance(value, KerasTensor):
        return value
    return KerasTensor(tuple(size if dim is None else dim for dim in value.shape), value.dtype)


def _steps_to(outputs):
    """The steps that computed `outputs`, producers before consumers."""
    steps, seen = [], set()

    def visit(tensor):
        history = getattr(tensor, "_keras_history", None)
        if history is None or history.operation is None:
            return
        node = history.operation._inbound_nodes[history.node_index]
        if id(node) in seen:
            return
        seen.add(id(node))
        for parent in node.input_tensors:
            visit(parent)
        steps.append(TracedStep(node))

    for output in tree.flatten(outputs):
        visit(output)
    return steps
