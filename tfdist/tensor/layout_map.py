"""A `keras.distribution.LayoutMap` as tfdist's tensor plan.

A `LayoutMap` maps variable-path regexes to axis tuples over a
("batch", "model") `keras.distribution.DeviceMesh`: the format keras-hub's
`Backbone.get_layout_map(...)` returns and `keras.distribution.ModelParallel`
takes. `Strategy(tensor=t, layout_map=...)` reads it as the tensor plan to
run: the mesh's first axis is the data axis (as `ModelParallel` assumes), the
other the tensor axis, of size `t`.

Each layer's main weights (kernels, embedding tables) decide: put on the
tensor axis exactly where tfdist's own plan (`tfdist.tensor.plan`) splits
them, the layer is split that way; not named (or named without the tensor
axis), it stays whole. A column group and its row layer (an MLP, attention's
projections) are split together or not at all; a bias follows its kernel
(put on the tensor axis, it must be where the plan splits it). Anything
else is refused, before training, naming the weight and the layout tfdist
can run instead: another axis (keras-hub's Llama map splits query/key/value
along the hidden axis, which Megatron's layouts do not run), a weight the
plan keeps whole, or a weight on the data axis (tfdist keeps weights whole
over data replicas; `zero=1` or `2` shards optimizer state).
"""

import dataclasses
import re

import keras

from tfdist.tensor.layouts import Replicated


def check_layout_map(layout_map, tensor: int):
    """`layout_map` if it can be a plan for tensor groups of `tensor`, else an error.

    Example:

    >>> mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), ["cpu:0", "cpu:1"])
    >>> check_layout_map(keras.distribution.LayoutMap(mesh), tensor=2) is not None
    True
    >>> check_layout_map({}, tensor=2)
    Traceback (most recent call last):
    ...
    TypeError: `layout_map` must be a keras.distribution.LayoutMap, got {} of type dict.
    """
    if layout_map is None:
        return None
    if not isinstance(layout_map, keras.distribution.LayoutMap):
        raise TypeError(f"`layout_map` must be a keras.distribution.LayoutMap, got "
                        f"{layout_map!r} of type {type(layout_map).__name__}.")
    if tensor == 1:
        raise ValueError("`layout_map` is a tensor-parallel plan, but tensor=1: give "
                         "`tensor` > 1 or leave `layout_map` out.")
    mesh = layout_map.device_mesh
    if mesh is None or len(mesh.axis_names) != 2:
        raise ValueError(
            f"`layout_map` needs a DeviceMesh of two axes (data, tensor), as "
            f"keras.distribution.ModelParallel takes; got "
            f"{None if mesh is None else tuple(mesh.axis_names)}.")
    if mesh.shape[1] != tensor:
        raise ValueError(
            f"`layout_map`'s mesh {dict(zip(mesh.axis_names, mesh.shape))} has "
            f"{mesh.shape[1]} devices on its tensor axis {mesh.axis_names[1]!r}, but "
            f"tensor={tensor}: build the mesh with shape (data, {tensor}).")
    return layout_map


def follow_layout_map(decisions, layout_map):
    """`decisions` (tfdist's plan) as `layout_map` asks: each layer split as
    planned or kept whole; a `ValueError` for what tfdist cannot run.

    Example:

    ```python
    decisions = follow_layout_map(plan(model, 2), layout_map)
    ```
    """
    data_axis, tensor_axis = layout_map.device_mesh.axis_names
    owned = _own_weights(decisions)
    paths = [w.path for weights in owned.values() for w in weights]
    unknown = [key for key in layout_map
               if not any(path == key or re.fullmatch(key, path) for path in paths)]
    if unknown:
        raise ValueError(f"`layout_map` keys {unknown} match no weight of the model "
                         f"(keys are regexes matched against `variable.path`).")

    def asked(weight):  # the axis the map puts on the tensor axis, or None
        spec = layout_map[weight.path]
        if spec is None:
            return None
        axes = tuple(spec.axes)
        if data_axis in axes:
            raise ValueError(
                f"`layout_map` puts weight {weight.path!r} {tuple(weight.shape)} on the "
                f"data axis {data_axis!r} ({axes}): tfdist keeps weights whole across "
                f"data replicas (zero=1 or 2 shards their optimizer state); map "
                f"{data_axis!r} to None.")
        return axes.index(tensor_axis) if tensor_axis in axes else None

    split = {id(d): _follows(d, owned[id(d)], asked, tensor_axis) for d in decisions}
    _check_groups(decisions, split)
    return [d if split[id(d)] or isinstance(d.layout, Replicated) else dataclasses.replace(
        d, layout=Replicated(), reason="layout_map keeps it whole") for d in decisions]


def _own_weights(decisions):
    """{id(decision): the weights it lays out}: a custom layer's decision
    (its own weights stay whole) leaves its sublayers' weights to theirs."""
    owned, taken = {}, set()
    for d in sorted(decisions, key=lambda d: len(d.layer.weights)):
        owned[id(d)] = [w for w in d.layer.weights if id(w) not in taken]
        taken.update(id(w) for w in owned[id(d)])
    return owned


def _follows(decision, weights, asked, tensor_axis):
    """Whether `layout_map` splits `decision`'s layer (its `weights`) as
    planned (False: it keeps the layer whole); a `ValueError` if neither."""
    axes = decision.layout.weight_axes(decision.layer)
    planned = {id(w): axis for w, axis in axes}
    wanted = {id(w): asked(w) for w in weights}
    main = [w for w in weights if id(w) in planned and w.name != "bias"]
    split = any(wanted[id(w)] is not None for w in main)
    for weight in weights:
        expected = planned.get(id(weight)) if split else None
        if wanted[id(weight)] == expected or (wanted[id(weight)] is None
                                              and weight.name == "bias"):
            continue  # as planned, or a bias left to follow its kernel
        raise ValueError(_refusal(decision, weight, wanted[id(weight)], axes, tensor_axis))
    return split


def _refusal(decision, weight, axis, axes, tensor_axis):
    where = (f"`layout_map` puts weight {weight.path!r} {tuple(weight.shape)} "
             f"on the tensor axis {tensor_axis!r} along axis {axis}" if axis is not None
             else f"`layout_map` keeps weight {weight.path!r} whole")
    if not axes:
        return (f"{where}, but tfdist keeps {decision.name} ({type(decision.layer).__name__}) "
                f"whole: {decision.reason}. Map it to None on every axis.")
    runs = ", ".join(f"{w.path!r} on axis {a}" for w, a in axes)
    return (f"{where}; tfdist splits {decision.name} ({type(decision.layer).__name__}) "
            f"as {decision.layout.name} only: {runs} (or every weight whole).")


def _check_groups(decisions, split):
    groups = {}
    for d in decisions:
        if d.group is not None:
            groups.setdefault(id(d.group), []).append(d)
    for members in groups.values():
        if len({split[id(d)] for d in members}) > 1:
            names = ", ".join(d.name for d in members)
            raise ValueError(
                f"`layout_map` splits some of {names} and not the others: they are split "
                f"together (column-parallel into row-parallel) or not at all.")
