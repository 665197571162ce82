"""ZeRO-3: trainable parameters sharded across the replicas, gathered unit by unit.

With `zero=3` every trainable variable is stored as N element shards
(`ShardLayout`, one per replica), as its optimizer slots are under zero 1/2
(`ShardedUpdate` moves both): each device persistently holds 1/N of the
parameters and of their optimizer state. Non-trainable variables
(BatchNormalization statistics, seed counters) stay replicated.

A step runs the model's graph (`LayerGraph`: nested functional models, such
as a keras-hub task model's backbone, are flattened) as a sequence of units:
each layer call with trainable weights starts one, and calls without join the
unit before them, so a keras-hub transformer block is a unit of its own. For
each microbatch, on each replica:

1. forward, unit by unit: the unit's parameters are all-gathered (one packed
   collective), its layers run on those values, and the values are dropped;
   only the unit's inputs are kept (its forward is recomputed in 2). The
   last unit (with the loss) runs under a tape instead, its values kept:
   its backward comes next;
2. backward, units in reverse: the parameters are gathered again (not kept
   from the forward; the last unit's are still there), the unit's forward is
   replayed under a tape (the same dropout masks: `StageRunner.replay`), and
   the gradients of the full parameters are reduce-scattered at once: a
   replica keeps only its shard of each reduced gradient, summed over the
   microbatches;
3. the update is zero=2's (`ShardedUpdate`) on the parameter shards
   themselves; nothing is gathered after it. Each unit's weights are updated
   right after their last reduce-scatter, inside the backward (the program's
   `UPDATE`), so no reduced shard waits for the others (under loss scaling,
   whose skip needs every gradient, and Adafactor, at the step's end).

Under mixed precision a weight that its layer reads in the compute dtype
(float16, bfloat16; Keras's autocast) is gathered in that dtype, each shard
cast before it is sent: half the bytes, and the same values the layer would
compute with. Its gradient is cast back to the weight's dtype before the
reduce-scatter, as the gradient of Keras's own cast is. Normalization layers'
weights (not autocast) are gathered in float32.

Each unit's work (gather, layers, and in the backward the reduce-scatter)
waits for every op of the unit's work two before it in that order: at most
two units' gathered parameters are alive at once, the current one's and the
next one's, fetched while the current one computes.

Per microbatch a replica all-gathers the parameters twice (the last unit's
once) and reduce-scatters their gradients once: about 3 x (N - 1)/N x the
parameters' bytes, ZeRO's 1.5x of data parallelism's all-reduce (2 x (N - 1)/N).

Ops are named `tfdist/unit{u}/{fwd|bwd}/mb{i}/...`, the collectives
`.../gather/...` and `.../reduce_scatter/...`.
"""

import functools

import keras
import tensorflow as tf

from tfdist._compat.keras_functional import nested_sublayers
from tfdist._compat.keras_layers import read_dtype
from tfdist._compat.tf_variables import storage_of
from tfdist.engine.reduce import ShardedReduce
from tfdist.optim.zero import updates_in_backward
from tfdist.pipeline.compute import StagedCompute
from tfdist.pipeline.graph import LayerGraph, graph_of
from tfdist.pipeline.program import unit_program
from tfdist.pipeline.runner import StageRunner, substituted
from tfdist.pipeline.stages import Stage, connect
from tfdist.sharding.collectives import PIECE_BYTES, packed_all_gather
from tfdist.sharding.layout import MeshShardLayout
from tfdist.sharding.storage import storage_layout


def check_model(model):
    """Errors for a model whose parameters `zero=3` cannot shard, before the
    first step, with what to change.

    Example:

    ```python
    check_model(subclassed_model)   # NotImplementedError: ... functional API
    ```
    """
    try:
        graph_of(model)
    except ValueError:
        raise NotImplementedError(
            f"`zero=3` gathers the parameters unit by unit along the model's "
            f"graph of layer calls, which {model.name!r} does not have before it "
            f"runs (a subclassed model, or a Sequential model without "
            f"`keras.Input`). Build it with the functional API or start it with "
            f"`keras.Input(...)`, or use zero <= 2.") from None
    for layer in nested_sublayers(model):
        if isinstance(layer, keras.layers.BatchNormalization) and layer.synchronized:
            raise NotImplementedError(
                f"{layer.name!r} is a BatchNormalization(synchronized=True), not "
                f"supported with `zero=3` in this version: use synchronized=False, "
                f"or zero <= 2.")
        if getattr(layer, "activity_regularizer", None) is not None:
            raise NotImplementedError(
                f"{layer.name!r} has an activity regularizer, not supported with "
                f"`zero=3` in this version (its loss is added during the call): "
                f"drop it, or use zero <= 2.")
    for variable in model.trainable_weights:
        for name in ("regularizer", "constraint"):
            if getattr(variable, name, None) is not None:
                raise NotImplementedError(
                    f"{variable.path!r} has a {name}, which needs the whole "
                    f"weight: not supported with `zero=3` in this version "
                    f"(each replica holds 1/N of it). Drop it, or use zero <= 2.")


def plan_units(model, min_params: int = 0) -> list[Stage]:
    """`model`'s units: each layer call with trainable weights starts one;
    calls without any (a residual add, dropout) join the unit before them.
    With `min_params`, consecutive units are joined until each holds at least
    that many parameters (the last may hold fewer).

    Example:

    ```python
    [[layer.name for layer in unit.layers] for unit in plan_units(gpt2_backbone)]
    # [['token_embedding'], ['position_embedding', 'embeddings_add', ...],
    #  ['transformer_layer_0'], ..., ['layer_norm']]
    ```
    """
    graph = LayerGraph(model)
    nodes = graph.nodes
    starts = [0] + [k for k, node in enumerate(nodes)
                    if k and getattr(node.operation, "trainable_weights", ())]
    units = []
    for a, b in zip(starts, starts[1:] + [len(nodes)]):
        if units and units[-1].params < min_params:
            units[-1].nodes += nodes[a:b]
        else:
            units.append(Stage(len(units), nodes[a:b], [], [], 0, 0.0, graph))
        units[-1].params = sum(v.shape.num_elements() for v in unit_weights(units[-1]))
    connect(graph, units)
    return units


def describe(model, data: int, min_params: int = 0, stages=None, split=None) -> str:
    """One line per unit: its parameters, the bytes a replica gathers of them
    (in the dtype its layers compute with; with tensor groups, its rank's
    slices), the bytes each device keeps of them, and its layers; then the
    totals. With pipeline `stages`, each stage is the unit; `split` maps the
    id of each weight tensor groups split to its `AxisLayout`.

    Example:

    ```python
    print(describe(model, 4))
    # unit 0  params 4,096  gathered 16,384 B  per device 4,096 B  layers: token_embedding
    # ...
    ```
    """
    split = split or {}
    tensor = next(iter(split.values())).parts if split else 1
    layouts = {id(v): MeshShardLayout(v.shape, tensor, data, split.get(id(v)))
               for v in model.trainable_weights}
    dtypes = read_dtypes(model)

    def gathered(v):
        return layouts[id(v)].part.size * tf.as_dtype(dtypes[id(v)]).size

    def kept(v):
        return layouts[id(v)].part.shard_size * tf.as_dtype(v.dtype).size

    lines, every = [], {}
    kind = "stage" if stages else "unit"
    for unit in stages or plan_units(model, min_params):
        weights = unit_weights(unit)
        every.update((id(v), v) for v in weights)  # a tied weight counts once
        names = ", ".join(layer.name for layer in unit.layers)
        lines.append(f"{kind} {unit.index}  params {unit.params:,}  "
                     f"gathered {sum(map(gathered, weights)):,} B  "
                     f"per device {sum(map(kept, weights)):,} B  layers: {names}")
    total = sum(v.shape.num_elements() * tf.as_dtype(v.dtype).size for v in every.values())
    held = (f"{sum(map(kept, every.values())):,} B per replica, each stage's on its device "
            f"(each stage's gathered for each of its actions)" if stages else
            f"{sum(map(kept, every.values())):,} B per device (the largest two units "
            f"gathered at once)")
    over = f"{data} data replicas x tensor {tensor}" if tensor > 1 else f"{data} replicas"
    lines.append(f"zero=3 over {over}: parameters {total:,} B, {held}")
    return "\n".join(lines)


def read_dtypes(model) -> dict:
    """The dtype each trainable weight of `model` is computed with, by id:
    its layer's compute dtype where Keras casts the read (mixed precision),
    its own dtype otherwise. `zero=3` gathers the weights in that dtype.

    Example:

    ```python
    keras.mixed_precision.set_global_policy("mixed_float16")
    read_dtypes(model)[id(dense.kernel)]   # "float16"
    ```
    """
    owners = {}
    for layer in nested_sublayers(model):  # outer layers first: the innermost wins
        owners.update((id(v), layer) for v in layer.trainable_weights)
    return {id(v): read_dtype(owners[id(v)], v) if id(v) in owners else v.dtype
            for v in model.trainable_weights}


def unit_weights(unit):
    """The unit's trainable variables, each once.

    Example:

    ```python
    unit_weights(plan_units(model)[0])   # [<token_embedding/embeddings>]
    ```
    """
    return list({id(v): v for layer in unit.layers
                 for v in getattr(layer, "trainable_weights", ())}.values())


def gather(variables, layouts, dtypes, launcher=None, wire=None):
    """The full values of sharded `variables` (their `ShardLayout`s
    `layouts`) in `dtypes` (each shard cast before it is sent), all-gathered
    in one packed collective per dtype (replica context; over `launcher`'s
    group if given, else every replica; sent as `wire` encodes them).

    Example:

    ```python
    full = gather(unit_variables, unit_layouts, ["float16"] * 2)   # inside strategy.run
    ```
    """
    return packed_all_gather([tf.cast(storage_of(v).value(), dtype)
                              for v, dtype in zip(variables, dtypes)], layouts, launcher, wire)


def gather_stage_parameters(pipeline, layouts, whole, wire=None):
    """Makes a `PipelineCompute` (its stages placed, its model's parameters
    then sharded by `ShardedUpdate(model, 3, mesh)`, `layouts` aligned with
    the trainable weights) compute with gathered parameters: each stage's
    runner all-gathers the stage's shards over its data group (that stage's
    device of every replica), on the stage's device, for every forward and
    replay; and reduce-scatter each stage's gradients there, over the same
    group, so that no device holds more than its stage's whole gradients
    (`whole`: the reduce part of those reduced whole, sparse ones), both
    sent as `wire` encodes them. The step's reduce part is then
    `AlreadyReduced`.

    Example:

    ```python
    gather_stage_parameters(pipeline, update.layouts, AllReduce())   # before the first step
    ```
    """
    model = pipeline.model
    tied = [v.path for runner in pipeline.runners for v, _ in runner.copies]
    if tied:
        raise NotImplementedError(
            f"`zero=3` with `pipeline` does not support a weight used by two stages "
            f"in this version ({', '.join(tied)}: a tied embedding): use zero <= 2, "
            f"or place the layers that share it on one stage (`stage_boundaries`).")
    mesh = pipeline.mesh  # (its data launcher is the current stage's: `mesh.stage`)
    pipeline.gather_stages(_gathering(model, layouts, mesh, wire))
    # (no weight is on two stages)
    pipeline.reduce_scatter_stages(_scattering(layouts, mesh, whole, wire))


def _scattering(layouts, mesh, whole, wire):
    """A staged compute's `scatter`: this replica's shards of the reduced
    gradients of weights given by index (`layouts` aligned with the model's
    trainable weights), reduce-scattered over the data group of `mesh` (the
    current stage's)."""
    reduce = ShardedReduce(layouts, 2, mesh, whole, wire)

    def scatter(indices, grads):
        # (aligned with the model's weights, as the whole reduce takes them)
        aligned = [None] * len(layouts)
        for index, grad in zip(indices, grads):
            aligned[index] = grad
        shards = reduce(aligned)
        return [shards[index] for index in indices]

    return scatter


def _gathering(model, layouts, mesh, wire):
    """A runner's `gather`: the full values of its weights from their shards
    (`layouts` aligned with `model.trainable_weights`), in the dtypes their
    layers compute with, over the data group of `mesh` (the current stage's:
    `mesh.stage`)."""
    index = {id(v): i for i, v in enumerate(model.trainable_weights)}
    dtypes = read_dtypes(model)

    def gather_weights(variables):
        return gather(variables, [layouts[index[id(v)]] for v in variables],
                      [dtypes[id(v)] for v in variables], mesh.data_launcher(), wire)

    return gather_weights


def with_gathered_parameters(fn, model):
    """`fn` (a Keras test or predict step) running with `model`'s sharded
    parameters gathered whole, for `evaluate` and `predict` under `zero=3`.

    Example:

    ```python
    strategy.run(with_gathered_parameters(model.test_step, model), args=(batch,))
    ```
    """
    dtypes = read_dtypes(model)
    mesh = model.distribute_strategy.replica_mesh

    @functools.wraps(fn)
    def run(*args, **kwargs):
        sharded = [v for v in model.trainable_weights if storage_layout(v) is not None]
        if not sharded:
            return fn(*args, **kwargs)
        # (With tensor groups: each replica's rank slices, over its data group.)
        with tf.name_scope("gather"):
            full = gather(sharded, [storage_layout(v).part for v in sharded],
                          [dtypes[id(v)] for v in sharded], mesh.data_launcher())
        with substituted(zip(sharded, full)):
            return fn(*args, **kwargs)

    return run


class GatheredUnits(StagedCompute):
    """A replica's gradient shards of its batch, unit by unit with gathered
    parameters (the module's steps 1 and 2): `unit_program` run by the
    staged computes' executor.

    Args:
        model: the compiled Keras model, its trainable weights sharded.
        layouts: each trainable weight's `ShardLayout` (aligned with
            `model.trainable_weights`: `ShardedUpdate.layouts`).
        devices: `devices[r][0]`, the device of data replica r.
        mesh: the strategy's `replica_mesh`: each unit gathers and
            reduce-scatters over the replica's data group.
        whole: the reduce part of gradients reduced whole (sparse ones):
            `AllReduce`, or with tensor groups `DataGroupAllReduce`.
        min_params: the fewest parameters of a unit (`plan_units`).
        wire: how the units' parameters and gradients travel (a
            `tfdist.sharding.wire.Wire`; as they are if None).

    Called in replica context with one (x, y, sample_weight, share, size)
    per microbatch; returns (this replica's shard of each reduced gradient,
    aligned with `model.trainable_weights`, metrics).

    Example:

    ```python
    mesh = strategy.replica_mesh
    units = GatheredUnits(model, update.layouts, strategy.pipeline_devices, mesh, AllReduce())
    compute = PipelinedCompute(model, 2, units, mesh)
    ```
    """

    def __init__(self, model, layouts, devices, mesh, whole, min_params=0, wire=None):
        units = plan_units(model, min_params)
        super().__init__(model, units, devices, [0] * len(units),
                         [StageRunner(unit, model.trainable_weights, shared=True)
                          for unit in units], mesh)
        self.gather = _gathering(model, layouts, mesh, wire)
        self.scatter = _scattering(layouts, mesh, whole, wire)

    def program(self, microbatches, update=None):
        return unit_program(len(self.runners), microbatches,
                            update=update is not None and update.in_backward)


def data_group_traffic(config, model, stages, gradients: float, parameters: float):
    """What a replica's data group collectives move in a step under
    `config.zero`, for `tfdist.plan`'s step time: (bytes its ring sends,
    whether they are summed by an all-reduce rather than reduce-scattered or
    gathered, collectives per step), from the bytes of its `gradients` (as
    compressed) and `parameters`. zero=3 gathers every unit (or with
    `stages`, the stage) forward and backward and reduce-scatters it, per
    microbatch.

    Example:

    >>> from tfdist.config import ParallelConfig
    >>> data_group_traffic(ParallelConfig(data=4, zero=1), None, None, 100, 100)
    (200, False, 2)
    """
    if config.zero == 0:
        return gradients, True, 1
    if config.zero < 3:  # a reduce-scatter of the gradients, a gather of the parameters
        return gradients + parameters, False, 2
    return (gradients + 2 * config.microbatches * parameters, False,
            3 * program_units(config, model, stages) * config.microbatches)


def replayed_nodes(config, model, nodes, stages) -> frozenset:
    """The ids of `nodes` (`model`'s `LayerGraph` nodes) whose forward a
    zero=3 backward runs again: every unit's but the last's (`unit_program`);
    none without zero=3, or when `stages` (pipeline stages) are its units
    (they replay only with `remat`). For `tfdist.plan`'s step time.

    Example:

    ```python
    replayed_nodes(ParallelConfig(data=4, zero=3), model, LayerGraph(model).nodes, None)
    ```
    """
    if not replays_forward(config, stages):
        return frozenset()
    last = plan_units(model, config.zero3_unit_params)[-1]
    return frozenset(id(node) for node in nodes[:len(nodes) - len(last.nodes)])


def each_unit_weights(config, model) -> list[list]:
    """The trainable weights of each of `model`'s zero=3 units under
    `config` (each gathered and reduce-scattered on its own).

    Example:

    ```python
    [len(weights) for weights in each_unit_weights(strategy.config, model)]
    ```
    """
    return [unit_weights(u) for u in plan_units(model, config.zero3_unit_params)]


def replays_forward(config, stages) -> bool:
    """Whether a zero=3 step runs its units' forward again under the tape
    for their backward (`unit_program`): with zero=3, unless its units are
    pipeline `stages` (which replay only with `remat`).

    Example:

    >>> from tfdist.config import ParallelConfig
    >>> replays_forward(ParallelConfig(data=4, zero=3), None)
    True
    """
    return config.zero == 3 and not stages


def program_units(config, model, stages) -> int:
    """The units a device's zero=3 program gathers, replays and
    reduce-scatters (its stage under `pipeline`; 0 without zero=3).

    Example:

    ```python
    program_units(strategy.config, model, None)   # len(plan_units(model))
    ```
    """
    if config.zero < 3:
        return 0
    return 1 if stages else len(plan_units(model, config.zero3_unit_params))


def held_at_peak(config, model, local: int, state: int, stages, size_of, largest: int = 0):
    """(parameters, gathered, gradients, optimizer state): the bytes a device
    holds at its step's peak under `config.zero` (resolved), for
    `tfdist.sharding.peak`, from the `local` bytes of the weights it computes
    with and their optimizer `state`, both unsharded; `size_of(weights)`
    counts a unit's bytes, `largest` is the largest weight's. zero 1/2 keep a
    shard of the state (their parameter shard buffer is the parameter's own
    memory until the update writes it: `gathering_peak`); beside the whole local
    gradients, zero 0 and 1 the packed buffer a data all-reduce sends (a
    bucket at a time with `bucket_bytes`) or the microbatches' running sum
    (`config.gradients_beside`), zero=2 a piece of its reduce-scatter and
    the reduced shards; zero=3 a shard of the parameters, gathering two
    units at once (with `stages`, its whole stage), and one unit's gradients
    with a piece of its reduce-scatter and its reduced shard (every unit's
    when the update waits for all, `updates_in_backward`, or for the last
    microbatch).

    Example:

    >>> from tfdist.config import ParallelConfig
    >>> held_at_peak(ParallelConfig(data=4, zero=1), None, 400, 800, None, None)
    (400, 0, 800, 200)
    >>> held_at_peak(ParallelConfig(data=4, zero=2), None, 400, 800, None, None)
    (400, 0, 900, 200)
    >>> held_at_peak(ParallelConfig(data=4, bucket_bytes=64), None, 400, 800, None, None, 100)
    (400, 0, 500, 800)
    """
    shard = local // config.data
    if config.zero:
        state //= config.data
    if config.zero == 2:  # reduce-scattered in pieces, each replica keeping its sum
        return local, 0, local + min(local, PIECE_BYTES) + shard, state
    if config.zero < 3:
        return local, 0, local + config.gradients_beside(local, largest), state
    if stages:  # a whole stage gathered at a time
        return shard, local, 2 * local, state
    units = _unit_sizes(config, model, size_of)
    # The reduced shards: one unit's when each unit's update uses them at
    # once, else all until the step's update (or, with microbatches, every
    # unit's running sum until the last one's); and a unit's gradient.
    each_at_once = (updates_in_backward(getattr(model, "optimizer", None), 3)
                    and config.microbatches == 1)
    reduced = units[0] // config.data if each_at_once else shard
    return (shard, sum(units[:2]), reduced + unit_gradient_bytes(config, model, stages, size_of),
            state)


def unit_gradient_bytes(config, model, stages, size_of) -> int:
    """Under zero=3 without pipeline `stages`, the bytes of the largest
    unit's whole gradient and of the rows its reduce-scatter receives (in
    pieces of at most `PIECE_BYTES`): what a device holds for one unit's
    reduce-scatter and frees after it; 0 otherwise. `size_of(weights)`
    counts a unit's bytes.

    Example:

    ```python
    unit_gradient_bytes(strategy.config, model, None, lambda unit: weight_bytes(unit, {}))
    ```
    """
    if config.zero < 3 or stages:
        return 0
    largest = _unit_sizes(config, model, size_of)[0]
    return largest + min(largest, PIECE_BYTES)


def _unit_sizes(config, model, size_of):
    """The bytes of each zero=3 unit, largest first."""
    return sorted(map(size_of, each_unit_weights(config, model)), reverse=True)
