"""The activations a training step holds: what its backward reads of its forward.

A step holds, from its forward until its backward has used them, the forward
tensors the gradient reads: each matmul's inputs, a softmax's output, a
normalisation's statistics, a dropout's mask, inside a layer as well as
between layers (a keras-hub backbone is one layer of its model, its attention
scores and feed-forward activations within it). `traced_activations` traces
a model's training forward and its gradient once (its weights given as
values, `stateless_call`), and finds those tensors (a reshape or an identity
read through to the tensor it shares its buffer with); each one's size is
linear in the rows of the batch, read from traces of 1 and 2 rows.

Under tensor groups a device holds its slice of a tensor computed inside a
layer whose weights the group splits (an attention's scores by heads, a
feed-forward block's inner activations by features): `HeldTensor.parts`
reads it from the split weights' axes.
"""

import dataclasses
import re
import weakref

import tensorflow as tf

from tfdist.pipeline.graph import LayerGraph, graph_of

# Ops whose output is a view of their input, sharing its buffer.
_VIEWS = {"Reshape", "Identity", "IdentityN", "ExpandDims", "Squeeze", "StopGradient",
          "Snapshot", "EnsureShape"}
# Ops that read only a tensor's shape, not its values.
_SHAPE_READERS = {"Shape", "ShapeN", "Size", "Rank"}
# Tensors that are not the step's activations: the weights, the batch, constants.
_NOT_ACTIVATIONS = {"Placeholder", "Const", "ReadVariableOp", "Shape", "ShapeN", "Size"}


@dataclasses.dataclass(frozen=True)
class HeldTensor:
    """One forward tensor the backward reads: its bytes are `fixed` +
    `per_row` x rows; `scope` is the layer path its op ran in, `dims` its
    axes past the first.

    Example:

    >>> scores = HeldTensor("block/attention", (4, 32, 32), fixed=0, per_row=16384)
    >>> scores.bytes(rows=8)
    131072
    """

    scope: str
    dims: tuple
    fixed: int
    per_row: int

    def bytes(self, rows: int) -> int:
        return self.fixed + self.per_row * rows

    def parts(self, split_axes: dict, sequence_length=None) -> int:
        """The slices tensor groups cut this tensor in: `parts` of a split
        weight under its layer (`split_axes` maps a layer path to each of its
        split weights' (split axis size, parts)) whose split axis is one of
        this tensor's axes past the first, other than the sequence's (an
        axis of that size is taken as the sequence's: whole, the safe side).

        Example:

        >>> scores = HeldTensor("block/attention", (4, 32, 32), fixed=0, per_row=16384)
        >>> scores.parts({"block/attention/query": [(4, 2)]}, sequence_length=32)
        2
        >>> HeldTensor("block", (32, 256), 0, 32768).parts({"block/dense": [(1024, 2)]})
        1
        """
        parts = 1
        for layer, axes in split_axes.items():
            if _inside(layer, self.scope):
                for size, split in axes:
                    if size != sequence_length and size in self.dims:
                        parts = max(parts, split)
        return parts


@dataclasses.dataclass(frozen=True)
class TracedActivations:
    """What `traced_activations` reads from a model's traced step: the
    forward's op count and the tensors its backward reads.

    Example:

    ```python
    traced = traced_activations(model, sequence_length=128)
    traced.bytes(rows=8) / 2**20   # MiB a replica of 8 rows holds
    ```
    """

    forward_ops: int
    held: tuple

    def bytes(self, rows: int, split_axes=None, sequence_length=None, groups=None) -> int:
        """The held tensors' bytes for `rows` examples, each divided by the
        parts tensor groups split it in (`split_axes`, see `HeldTensor.parts`).
        With `groups` (lists of layer paths: zero=3's units, each replayed
        for its backward), only the largest group's and those computed in no
        group.

        Example:

        >>> traced = TracedActivations(0, (HeldTensor("a", (8,), 0, 32),
        ...                                HeldTensor("b", (4,), 0, 16)))
        >>> traced.bytes(rows=2), traced.bytes(rows=2, groups=[["a"], ["b"]])
        (96, 64)
        """
        sizes = [t.bytes(rows) // (t.parts(split_axes, sequence_length) if split_axes else 1)
                 for t in self.held]
        if not groups:
            return sum(sizes)
        inside = [0] * len(groups)
        outside = 0
        for tensor, size in zip(self.held, sizes):
            group = next((k for k, layers in enumerate(groups)
                          if any(_inside(tensor.scope, layer) for layer in layers)), None)
            if group is None:
                outside += size
            else:
                inside[group] += size
        return outside + max(inside)


def traced_activations(model, sequence_length=None):
    """The forward op count and the held tensors of `model`'s training step
    (functional or Sequential: traced from its inputs, unknown lengths
    `sequence_length`), or None when it has no functional graph. Traced once
    per model and length.

    Example:

    ```python
    traced_activations(keras_hub.models.GPT2Backbone.from_preset("gpt2_base_en"), 1024)
    ```
    """
    cache = _TRACED.setdefault(model, {})
    if sequence_length not in cache:
        try:
            inputs = graph_of(model).input
        except ValueError:
            return None
        (ops, one), (_, two) = (_trace(model, inputs, rows, sequence_length) for rows in (1, 2))
        layers = _layer_paths(model, LayerGraph(model).nodes)
        held = []
        for name, (dims, size_one) in one.items():
            dims_two, size_two = two.get(name, (dims, size_one))
            held.append(HeldTensor(_scope(name, layers), dims_two, fixed=2 * size_one - size_two,
                                   per_row=size_two - size_one))
        cache[sequence_length] = TracedActivations(ops, tuple(held))
    return cache[sequence_length]


# `traced_activations` of each model it has traced, by sequence length.
_TRACED = weakref.WeakKeyDictionary()


def _trace(model, inputs, rows, sequence_length):
    """The forward's op count and, by name, the (axes past the first, bytes)
    of each tensor its gradient reads, for `rows` examples."""
    specs = [[tf.TensorSpec(v.shape, v.dtype) for v in variables]
             for variables in (model.trainable_variables, model.non_trainable_variables)]
    specs.append(tf.nest.map_structure(
        lambda t: tf.TensorSpec([rows] + [d or sequence_length or 1 for d in t.shape[1:]],
                                t.dtype), inputs))
    forward_end = []

    def step(trainable, other, x):
        with tf.GradientTape() as tape:
            tape.watch(trainable)
            outputs, _ = model.stateless_call(trainable, other, x, training=True)
            forward_end.append(len(tf.compat.v1.get_default_graph().get_operations()))
            loss = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32))
                             for o in tf.nest.flatten(outputs)])
            forward_end.append(len(tf.compat.v1.get_default_graph().get_operations()))
        return tape.gradient(loss, trainable)

    graph = tf.function(step).get_concrete_function(*specs).graph
    operations = graph.get_operations()
    forward = operations[:forward_end[0]]
    forward_names = {op.name for op in forward}
    held = {}
    for op in operations[forward_end[1]:]:  # the gradient's, past the loss's
        for tensor in () if op.type in _SHAPE_READERS else op.inputs:
            if tensor.op.name not in forward_names:
                continue
            while tensor.op.type in _VIEWS:
                tensor = tensor.op.inputs[tensor.value_index if tensor.op.type == "IdentityN"
                                          else 0]
            if (tensor.op.type in _NOT_ACTIVATIONS or tensor.dtype in (tf.resource, tf.variant)
                    or not tensor.shape.is_fully_defined() or tensor.shape.rank == 0):
                continue
            held[tensor.name] = (tuple(tensor.shape[1:]),
                                 tensor.shape.num_elements() * tensor.dtype.size)
    return sum(op.type != "Placeholder" for op in forward), held


def _inside(path, layer):
    """Whether layer path `path` is `layer` or one of its sublayers'."""
    return path == layer or path.startswith(layer + "/")


def _layer_paths(model, nodes):
    """Every layer path of `model`'s weights (`model/block/attention` of
    `model/block/attention/kernel`, and its parents) and of its graph's
    layer calls `nodes` (layers without weights too), by itself and by its
    tails (`block/attention`: the ops' scopes may leave the outer ones out)."""
    paths = {}
    for path in [v.path.rsplit("/", 1)[0] for v in model.weights if "/" in v.path] + [
            node.operation.path for node in nodes if getattr(node.operation, "path", None)]:
        parts = path.split("/")
        for end in range(1, len(parts) + 1):
            for start in range(end):
                paths.setdefault("/".join(parts[start:end]), "/".join(parts[:end]))
    return paths


def _scope(name, layers):
    """The deepest layer path of `layers` (`_layer_paths`) an op `name` ran
    in: its name scopes, each read without the `_1` a repeated scope gets
    (Keras enters a layer's scope twice, its ops in the second), else as it
    is."""
    scope = ""
    for part in name.split("/")[:-1]:
        for candidate in (re.sub(r"_\d+$", "", part), part):
            path = f"{scope}/{candidate}" if scope else candidate
            if path in layers:
                scope = path
                break
        else:
            break
    return layers.get(scope, "")
