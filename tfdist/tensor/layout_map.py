"""A `keras.distribution.LayoutMap` as tfdist's tensor plan.

A `LayoutMap` maps variable-path regexes to axis tuples over a
("batch", "model") `keras.distribution.DeviceMesh`: the format keras-hub's
`Backbone.get_layout_map(...)` returns and `keras.distribution.ModelParallel`
takes. `Strategy(tensor=t, layout_map=...)` reads it as the tensor plan to
run: the mesh's first axis is the data axis (as `ModelParallel` assumes), the
other the tensor axis, of size `t`.

Each layer's main weights (kernels, embedding tables) decide: put on the
tensor axis exactly where tfdist's own plan (`tfdist.tensor.plan`) splits
them, or where one of the plan's alternatives for the layer does (attention
by hidden features instead of heads, as keras-hub's Llama map asks; an
embedding's untied reverse table whole), the layer is split that way; not
named (or named without the tensor axis), it stays whole. A column group and
its row layer (an MLP, attention's projections) are split together, by one
option, or not at all; a bias follows its kernel (put on the tensor axis, it
must be where the layout splits it). Anything else is refused, before
training, naming the weight and the layouts tfdist can run instead.

The data axis: a weight put on it is sharded over the data replicas and
gathered where it is used (FSDP), which tfdist does with `zero=3` (for every
weight). With more than one device on the data axis such a map needs
`zero=3`; with one, the data axis shards nothing.
"""

import dataclasses
import re

import keras

from tfdist.tensor.layouts import Replicated


def check_layout_map(layout_map, tensor: int, zero: int = 0):
    """`layout_map` if it can be a plan for tensor groups of `tensor` (with
    ZeRO level `zero`), else an error.

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
    data_axis = mesh.axis_names[0]
    on_data = [key for key, spec in layout_map.items()
               if spec is not None and data_axis in tuple(spec.axes)]
    if on_data and mesh.shape[0] > 1 and zero != 3:
        raise ValueError(
            f"`layout_map` puts weights on its data axis {data_axis!r} of {mesh.shape[0]} "
            f"devices ({on_data[0]!r}: {tuple(layout_map[on_data[0]].axes)}): sharded over "
            f"the data replicas and gathered where used, which tfdist does with zero=3 "
            f"(every weight), but zero={zero}: pass zero=3, or map {data_axis!r} to None.")
    return layout_map


def follow_layout_map(decisions, layout_map):
    """`decisions` (tfdist's plan) as `layout_map` asks: each layer (a group
    together) split as planned, split as one of its alternatives, or kept
    whole; a `ValueError` for what tfdist cannot run.

    Example:

    ```python
    decisions = follow_layout_map(plan(model, 2), layout_map)
    ```
    """
    tensor_axis = layout_map.device_mesh.axis_names[1]
    owned = _own_weights(decisions)
    paths = [w.path for weights in owned.values() for w in weights]
    unknown = [key for key in layout_map
               if not any(path == key or re.fullmatch(key, path) for path in paths)]
    if unknown:
        raise ValueError(f"`layout_map` keys {unknown} match no weight of the model "
                         f"(keys are regexes matched against `variable.path`).")

    def asked(weight):  # the axis the map puts on the tensor axis, or None
        spec = layout_map[weight.path]
        axes = () if spec is None else tuple(spec.axes)
        return axes.index(tensor_axis) if tensor_axis in axes else None

    groups = {}
    for d in decisions:
        groups.setdefault(id(d.group) if d.group is not None else id(d), []).append(d)
    chosen = {}
    for members in groups.values():
        chosen.update(_group_choice(members, owned, asked, tensor_axis))
    return [chosen[id(d)] for d in decisions]


def _own_weights(decisions):
    """{id(decision): the weights it lays out}: a custom layer's decision
    (its own weights stay whole) leaves its sublayers' weights to theirs."""
    owned, taken = {}, set()
    for d in sorted(decisions, key=lambda d: len(d.layer.weights)):
        owned[id(d)] = [w for w in d.layer.weights if id(w) not in taken]
        taken.update(id(w) for w in owned[id(d)])
    return owned


def _group_choice(members, owned, asked, tensor_axis):
    """{id(decision): the decision as the map asks} for one group (or one
    layer): every member whole, or every member split by the same option
    (the plan's layout, or its i-th alternative)."""
    wanted = {id(w): asked(w) for d in members for w in owned[id(d)]}
    if all(wanted[id(w)] is None for d in members for w in _main(d, owned)):
        whole = {}
        for d in members:
            weight = _mismatch(Replicated(), d, owned, wanted)  # a bias split, its kernel not
            if weight is not None:
                raise ValueError(_refusal(d, weight, wanted[id(weight)], tensor_axis))
            whole[id(d)] = d if isinstance(d.layout, Replicated) else dataclasses.replace(
                d, layout=Replicated(), reason="layout_map keeps it whole", alternatives=())
        return whole
    options = [[(d.layout, d.reason) for d in members]] + [
        [d.alternatives[i] for d in members]
        for i in range(min(len(d.alternatives) for d in members))]
    for option in options:
        if all(_mismatch(layout, d, owned, wanted) is None
               for (layout, _), d in zip(option, members)):
            return {id(d): dataclasses.replace(d, layout=layout, reason=reason, alternatives=())
                    for (layout, reason), d in zip(option, members)}
    unasked = [all(wanted[id(w)] is None for w in _main(d, owned)) for d in members]
    if any(unasked):
        names = ", ".join(d.name for d in members)
        raise ValueError(f"`layout_map` splits some of {names} and not the others: they are "
                         f"split together (column-parallel into row-parallel) or not at all.")
    for d in members:
        weight = _mismatch(d.layout, d, owned, wanted)
        if weight is not None:
            raise ValueError(_refusal(d, weight, wanted[id(weight)], tensor_axis))
    raise ValueError(  # each member as planned, but not all by one option
        f"`layout_map` splits {', '.join(d.name for d in members)} by different layouts; "
        f"they are split by one together.")


def _main(decision, owned):
    """The weights that decide whether a layer is split: all but biases."""
    return [w for w in owned[id(decision)] if w.name != "bias"]


def _mismatch(layout, decision, owned, wanted):
    """The first of `decision`'s weights the map asks otherwise than `layout`
    lays it out (a bias left out follows its kernel), else None."""
    axes = {id(w): axis for w, axis in layout.weight_axes(decision.layer)}
    return next((w for w in owned[id(decision)] if wanted[id(w)] != axes.get(id(w)) and not (
        wanted[id(w)] is None and w.name == "bias")), None)


def _refusal(decision, weight, axis, tensor_axis):
    where = (f"`layout_map` puts weight {weight.path!r} {tuple(weight.shape)} "
             f"on the tensor axis {tensor_axis!r} along axis {axis}" if axis is not None
             else f"`layout_map` keeps weight {weight.path!r} whole")
    layouts = [decision.layout, *(layout for layout, _ in decision.alternatives)]
    if all(not layout.weight_axes(decision.layer) for layout in layouts):
        return (f"{where}, but tfdist keeps {decision.name} ({type(decision.layer).__name__}) "
                f"whole: {decision.reason}. Map it to None on every axis.")
    runs = " or ".join(
        f"{layout.name} ({', '.join(f'{w.path!r} on axis {a}' for w, a in axes)})"
        for layout in layouts if (axes := layout.weight_axes(decision.layer)))
    return (f"{where}; tfdist splits {decision.name} ({type(decision.layer).__name__}) "
            f"as {runs} only (or every weight whole).")
