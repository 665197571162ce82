"""Splitting a Keras model's graph into contiguous pipeline stages.

A Sequential or functional model is a graph of layer calls (Keras nodes), a
nested functional model's calls included (`tfdist.pipeline.graph`). Its
nodes, in the order Keras runs them, are cut into `pipeline` contiguous runs,
balanced by an estimate of each node's compute (FLOPs per example,
`tfdist.pipeline.cost`), with the parameter count as tie-break. A tensor may skip across
stages (a residual, a second input): it is an input of every later stage that
uses it, and its gradient flows back from each of them.

`stage_boundaries` (layer names, one per stage after the first) overrides the
balance: each named layer starts a stage.
"""

import dataclasses
import math

import tensorflow as tf

from tfdist.config import check_boundary_count
from tfdist.pipeline.cost import node_cost
from tfdist.pipeline.graph import LayerGraph
from tfdist.pipeline.schedule import held_activations, stage_device, stage_orders


@dataclasses.dataclass
class Stage:
    """One pipeline stage: the nodes it runs and the tensors that cross its edges.

    `inputs` are the symbolic tensors it reads from the model's inputs or from
    earlier stages; `outputs` those it produces that later stages or the
    model's outputs read (resolved by `graph`, the model's `LayerGraph`:
    a nested model's input stands for what its caller passed). `tied` (last
    stage only) are layers the first stage calls too, such as an input
    embedding reused as the output projection: the first stage holds their
    weights, the last stage computes with a copy (Megatron's tied embedding).

    Example:

    ```python
    first, second = plan_stages(model, 2)
    [layer.name for layer in second.layers], second.params, second.cost
    ```
    """

    index: int
    nodes: list
    inputs: list
    outputs: list
    params: int
    cost: float
    graph: LayerGraph = None
    tied: list = dataclasses.field(default_factory=list)

    @property
    def layers(self):
        """The stage's own layers, in the order it runs them (each once; not
        the `tied` ones, whose weights the first stage holds)."""
        seen, layers = {id(layer) for layer in self.tied}, []
        for node in self.nodes:
            if id(node.operation) not in seen:
                seen.add(id(node.operation))
                layers.append(node.operation)
        return layers

    @property
    def variables(self):
        """Every variable of the stage's layers (trainable or not)."""
        return [v for layer in self.layers for v in getattr(layer, "variables", ())]


def plan_stages(model, stages: int, boundaries=None, sequence_length=None) -> list[Stage]:
    """Cuts `model` into `stages` contiguous stages.

    Nested functional models (a keras-hub task model's backbone) are cut
    inside (`LayerGraph`).

    Args:
        model: a built Sequential or functional Keras model.
        stages: the number of stages (`pipeline`).
        boundaries: optional layer names, one per stage after the first,
            each the first layer of its stage, in model order.
        sequence_length: the length of every dimension the graph leaves
            unknown (`None`) after the batch, for the cost estimates
            (`tfdist.pipeline.cost`); 1 when None.

    Example:

    ```python
    for stage in plan_stages(gpt2_backbone, 4, sequence_length=1024):
        print(stage.index, [layer.name for layer in stage.layers], stage.cost)
    ```
    """
    if sequence_length is not None and (
            not isinstance(sequence_length, int) or isinstance(sequence_length, bool)
            or sequence_length < 1):
        raise ValueError(
            f"`sequence_length` must be a positive int (the length of the "
            f"model's unknown input dimensions), got {sequence_length!r}.")
    graph = LayerGraph(model)
    nodes = graph.nodes
    if len(nodes) < stages:
        raise ValueError(
            f"`pipeline={stages}` needs at least {stages} layers to split, but "
            f"{model.name!r} has {len(nodes)}: use pipeline <= {len(nodes)}.")
    costs = [node_cost(n, sequence_length) for n in nodes]
    params = [sum(math.prod(w.shape) for w in operation_weights(n.operation)) for n in nodes]
    if boundaries is None:
        starts = _balanced_starts(costs, params, stages)
    else:
        starts = _named_starts(nodes, boundaries, stages)
    ends = starts[1:] + [len(nodes)]
    groups = [nodes[a:b] for a, b in zip(starts, ends)]
    tied = _tied_layers(groups)
    result = []
    for index, (group, a, b) in enumerate(zip(groups, starts, ends)):
        own = [p for node, p in zip(group, params[a:b])
               if index == 0 or node.operation not in tied]
        result.append(Stage(index, group, [], [], sum(own), sum(costs[a:b]), graph,
                            tied if index == stages - 1 and index else []))
    connect(graph, result)
    return result


def _balanced_starts(costs, params, stages):
    """Start indices minimising the largest stage cost, then its parameters."""
    n = len(costs)
    prefix_cost = [0.0]
    prefix_params = [0]
    for c, p in zip(costs, params):
        prefix_cost.append(prefix_cost[-1] + c)
        prefix_params.append(prefix_params[-1] + p)

    def weight(a, b):
        return (prefix_cost[b] - prefix_cost[a], prefix_params[b] - prefix_params[a])

    # best[k][j]: the best (max cost, max params) cutting nodes[:j] into k stages.
    best = [[None] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0)
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] is None:
                    continue
                candidate = max(best[k - 1][i], weight(i, j))
                if best[k][j] is None or candidate < best[k][j]:
                    best[k][j], cut[k][j] = candidate, i
    starts, j = [], n
    for k in range(stages, 0, -1):
        j = cut[k][j]
        starts.append(j)
    return starts[::-1]


def _named_starts(nodes, boundaries, stages):
    check_boundary_count(boundaries, stages)
    names = [n.operation.name for n in nodes]
    starts = [0]
    for name in boundaries:
        if name not in names:
            raise ValueError(
                f"`stage_boundaries`: no layer named {name!r} in the model; its "
                f"layers are {names}.")
        index = names.index(name)
        if index <= starts[-1]:
            raise ValueError(
                f"`stage_boundaries`: {name!r} must come after the previous "
                f"boundary in model order {names}, and the first stage must "
                f"not be empty.")
        starts.append(index)
    return starts


def _tied_layers(groups):
    """The layers called in the first and the last stage (tied embeddings),
    which the last stage computes with a copy; any other layer called in
    two stages is refused."""
    owner, tied = {}, []
    last = len(groups) - 1
    for index, group in enumerate(groups):
        for node in group:
            layer = node.operation
            first = owner.setdefault(id(layer), index)
            if first == index:
                continue
            if first == 0 and index == last and not getattr(layer, "non_trainable_weights", ()):
                if layer not in tied:
                    tied.append(layer)
                continue
            raise ValueError(
                f"Layer {layer.name!r} is called in stages {first} and {index}; a "
                f"layer's weights live on one stage (only a layer of trainable "
                f"weights called in the first and the last stage, a tied "
                f"embedding, gets a copy). Move the boundary (`stage_boundaries`) "
                f"so its calls share a stage.")
    return tied


def connect(graph, stages):
    """Fills in each stage's crossing inputs and outputs."""
    produced_by = {id(x): -1 for x in graph.inputs}
    for stage in stages:
        for node in stage.nodes:
            for x in node.outputs:
                produced_by[id(x)] = stage.index
    for stage in stages:
        own = {id(x) for node in stage.nodes for x in node.outputs}
        seen = set()
        for node in stage.nodes:
            for x in graph.input_tensors(node):
                if id(x) not in own and id(x) not in seen:
                    seen.add(id(x))
                    stage.inputs.append(x)
    last = stages[-1]
    for x in graph.outputs:  # the loss, on the last stage, reads every output
        if produced_by[id(x)] < last.index and all(x is not y for y in last.inputs):
            last.inputs.append(x)
    # A tensor leaves its stage when another stage reads it or it is a model output.
    needed = {id(x) for x in graph.outputs} | {id(x) for s in stages for x in s.inputs}
    for stage in stages:
        stage.outputs.extend(x for node in stage.nodes for x in node.outputs
                             if id(x) in needed)


def stage_devices(config, pipeline_devices) -> list[list]:
    """Each of `config.model_stages` stages' devices, one per data replica
    (`pipeline_devices[r][d]`: replica r's pipeline device d): stage s runs
    on the device its schedule places it on (`schedule.stage_device`: s mod
    `config.pipeline`, or ZB-V's V).

    Example:

    >>> from tfdist.config import ParallelConfig
    >>> stage_devices(ParallelConfig(pipeline=2), [["CPU:0", "CPU:1"], ["CPU:2", "CPU:3"]])
    [['CPU:0', 'CPU:2'], ['CPU:1', 'CPU:3']]
    """
    return [[replica[stage_device(config.schedule, s, config.pipeline)]
             for replica in pipeline_devices] for s in range(config.model_stages)]


def describe(stages, devices) -> str:
    """One line per stage: its devices, parameters, estimated cost and its
    ratio to the mean stage's, layers.

    Example:

    ```python
    print(describe(plan_stages(model, 2), [["CPU:0"], ["CPU:1"]]))
    # stage 0  [CPU:0]  params 1,088  cost 2,112 FLOPs/example (0.98x mean)  layers: ...
    ```
    """
    mean = sum(stage.cost for stage in stages) / len(stages)
    lines = []
    for stage, stage_devices in zip(stages, devices):
        names = ", ".join(layer.name for layer in stage.layers)
        where = ", ".join(_short_name(d) for d in stage_devices)
        ratio = stage.cost / mean if mean else 1.0
        tied = "".join(f"; tied: {layer.name} (a copy of stage 0's)" for layer in stage.tied)
        lines.append(
            f"stage {stage.index}  [{where}]  params {stage.params:,}  "
            f"cost {stage.cost:,.0f} FLOPs/example ({ratio:.2f}x mean)  layers: {names}{tied}")
    return "\n".join(lines)


def held_activation_bytes(config, stage_bytes: int, input_bytes: int) -> int:
    """The activations a stage's device holds at once under `config`'s
    schedule, for `tfdist.sharding.peak`: a stage's outputs of one microbatch
    (`stage_bytes`) times the microbatches the schedule holds at once; with
    `remat`, only those microbatches' stage inputs (`input_bytes`, the
    largest stage's) plus one stage's outputs recomputed.

    Example:

    >>> from tfdist.config import ParallelConfig
    >>> held_activation_bytes(ParallelConfig(pipeline=2, microbatches=4), 100, 10)
    400
    """
    in_flight = max(held_activations(stage_orders(
        config.schedule, config.pipeline, config.microbatches, config.virtual_stages)))
    if config.remat:
        return stage_bytes + input_bytes * in_flight
    return stage_bytes * in_flight


def operation_weights(operation):
    """A layer's weights; none for a Keras op such as `x + y` or `x[:, 0]`
    in a functional model.

    Example:

    ```python
    [operation_weights(node.operation) for node in LayerGraph(model).nodes]
    ```
    """
    return getattr(operation, "weights", ())


def _short_name(device):
    """A device's name as `describe` prints it: "CPU:1" on this host,
    "worker:2/CPU:0" on another task's (`tfdist.ChiefStrategy`)."""
    spec = tf.DeviceSpec.from_string(device)
    local = f"{spec.device_type}:{spec.device_index}"
    return local if spec.job in (None, "localhost") else f"{spec.job}:{spec.task}/{local}"
