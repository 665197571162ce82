"""Keras functional-graph internals: a model's nodes, how it calls a node.

A functional (or built Sequential) Keras model is a graph of nodes, one per
layer call; Keras exposes neither the graph nor a layer's nodes publicly.
tfdist walks it to cut pipeline stages and to pair tensor-parallel layers.
"""

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
