"""A model's layer calls in the order Keras runs them, nested models flattened.

A Sequential or functional model is a graph of layer calls (Keras nodes). A
functional model called as one layer of another (a keras-hub task model
calls its backbone so) is replaced by its own nodes, so that pipeline stages
can cut inside it. Its input tensors then stand for the tensors the outer call
passed, and the outer call's outputs for its outputs: `resolve` maps each of
these aliases to the one tensor whose value is computed, `aliases` back.
"""

import keras
from keras import tree

from tfdist._compat import keras_functional


def graph_of(model):
    """The functional graph of a Sequential or functional model.

    Example:

    ```python
    graph_of(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    ```
    """
    if isinstance(model, keras.Sequential):
        if not model.built or keras_functional.functional_graph_of(model) is None:
            raise ValueError(
                "`pipeline` needs a Sequential model with a known input shape: "
                "start it with `keras.Input(...)`.")
        return keras_functional.functional_graph_of(model)
    if isinstance(model, keras.Model) and keras_functional.is_functional_graph(model):
        return model
    raise ValueError(
        f"`pipeline` splits Sequential and functional Keras models; "
        f"{type(model).__name__} is a subclassed model, whose graph is not known "
        f"before it runs. Build it with the functional API.")


def graph_nodes(graph):
    """The graph's own layer-call nodes in the order Keras runs them (a nested
    model is one node here; `LayerGraph` flattens it).

    Example:

    ```python
    [node.operation.name for node in graph_nodes(model)]
    ```
    """
    nodes = []
    by_depth = keras_functional.nodes_by_depth(graph)
    for depth in sorted(by_depth, reverse=True):
        for node in by_depth[depth]:
            if node.operation is not None and not node.is_input:
                nodes.append(node)
    return nodes


def nested_graph(operation):
    """The functional graph of `operation` when it is a Sequential or
    functional model with a known graph (its call can be flattened), else None.

    Example:

    ```python
    nested_graph(gpt2_causal_lm.backbone)   # the GPT2Backbone itself
    ```
    """
    if not isinstance(operation, keras.Model):
        return None
    if isinstance(operation, keras.Sequential):
        return keras_functional.functional_graph_of(operation) if operation.built else None
    return operation if keras_functional.is_functional_graph(operation) else None


class LayerGraph:
    """A model's layer-call nodes, nested functional models flattened.

    Attributes:
        model: the model's functional graph (`graph_of`).
        nodes: every layer call, nested models' included, in running order.
        inputs: the model's input tensors.
        outputs: the tensors whose values are the model's outputs (resolved).

    Example:

    ```python
    graph = LayerGraph(gpt2_causal_lm)
    [node.operation.name for node in graph.nodes]   # token_embedding, ..., layer_norm,
                                                   # token_embedding (the tied projection)
    ```
    """

    def __init__(self, model):
        self.model = graph_of(model)
        self.nodes = []
        self._resolved = {}   # id(alias) -> the tensor it stands for
        self._aliases = {}    # id(tensor) -> ids of its aliases
        self._flattened = set()
        self._add(self.model)
        self.inputs = list(self.model.inputs)
        self.outputs = [self.resolve(x) for x in self.model.outputs]

    def resolve(self, tensor):
        """The tensor whose value `tensor` has (itself unless it is an alias)."""
        return self._resolved.get(id(tensor), tensor)

    def aliases(self, tensor) -> tuple:
        """The ids of the tensors that stand for `tensor`."""
        return self._aliases.get(id(tensor), ())

    def input_tensors(self, node) -> list:
        """`node`'s input tensors, resolved."""
        return [self.resolve(x) for x in node.input_tensors]

    def _add(self, graph):
        for node in graph_nodes(graph):
            inner = nested_graph(node.operation)
            if inner is None:
                self.nodes.append(node)
                continue
            if id(inner) in self._flattened:
                raise ValueError(
                    f"`pipeline`: the nested model {node.operation.name!r} is called "
                    f"more than once; its layers' weights would live on several "
                    f"stages. Call it once, or build the model without nesting it.")
            self._flattened.add(id(inner))
            args = node.arguments.args
            passed = tree.flatten(args[0] if len(args) == 1 else list(args))
            if len(passed) != len(inner.inputs):
                raise ValueError(
                    f"`pipeline`: the nested model {node.operation.name!r} is called "
                    f"with {len(passed)} tensor(s) for its {len(inner.inputs)} "
                    f"input(s); pass them in the structure of its inputs.")
            for x, outer in zip(inner.inputs, passed):
                self._alias(x, outer)
            self._add(inner)
            for outer, x in zip(node.outputs, inner.outputs):
                self._alias(outer, x)

    def _alias(self, alias, tensor):
        tensor = self.resolve(tensor)
        self._resolved[id(alias)] = tensor
        self._aliases[id(tensor)] = (*self.aliases(tensor), id(alias))
