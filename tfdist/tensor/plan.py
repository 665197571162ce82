"""Which layers of an unchanged Keras model are partitioned, and how.

`plan(model, tensor)` decides (a `tfdist.tensor.layouts` layout per layer),
`apply(plan, mesh)` partitions, `describe` renders the decisions. The rules:

- **Dense pairs**: a Dense whose output feeds exactly one layer, a Dense that
  is its only input, becomes column-parallel and that consumer row-parallel
  (an MLP: one all-reduce forward, one backward); weightless elementwise
  layers may sit between them (`Dense -> Dropout -> Dense`); two
  `TimeDistributed(Dense)` pair alike. The first Dense's
  units must be divisible by `tensor` and its activation elementwise.
- **MultiHeadAttention**: split by heads when `num_heads` is divisible by
  `tensor` (query/key/value column-parallel, output row-parallel).
- **Embedding**: split by vocabulary when `input_dim` is divisible by `tensor`.
- A layer with a weight constraint stays replicated (a constraint such as
  `MaxNorm` acts on the whole weight).
- **Custom layers** (Transformer blocks): their sublayers, paired from the
  data flow of a trace of their `call` (`tfdist.tensor.blocks`): Dense
  column groups -> row (MLPs, gated MLPs), attention layers by heads.
- Everything else, and any of these that breaks a rule, stays replicated;
  the plan says why.
"""

import dataclasses
import math
import warnings

import keras

from tfdist._compat import keras_functional, keras_layers
from tfdist._compat.keras_optimizer import trainable_variables_of
from tfdist._compat.keras_trainer import compiled_losses
from tfdist.sharding.keys import optimizer_keys_follow
from tfdist.sharding.layout import MeshShardLayout
from tfdist.sharding.slots import optimizer_slots
from tfdist.sharding.storage import axis_layout, shard_keras_variable
from tfdist.tensor.blocks import (
    activation_is_elementwise,
    activation_name,
    block_decisions,
    is_custom_layer,
    is_elementwise_layer,
)
from tfdist.tensor.decision import Decision
from tfdist.tensor.layout_map import follow_layout_map
from tfdist.tensor.layouts import (
    Classifier,
    Column,
    Heads,
    Replicated,
    Row,
    Vocabulary,
)
from tfdist.tensor.softmax import ShardedSoftmaxCrossEntropy, is_sparse_softmax_loss


def plan(model, tensor: int, classifier: bool = False, layout_map=None) -> list:
    """The layout of every layer of `model` with weights, for tensor groups of
    `tensor` devices. With `classifier`, the model's final Dense (if not
    already the row half of a pair) is split by classes, with a sharded
    softmax loss. With a `keras.distribution.LayoutMap`, the plan it asks
    for (`tfdist.tensor.layout_map`).

    Example:

    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, "relu", name="up"),
    ...                           keras.layers.Dense(4, name="down")])
    >>> [(d.layer.name, d.layout.name) for d in plan(model, 2)]
    [('up', 'column'), ('down', 'row')]
    """
    decisions, taken = [], set()
    for layer in _layers(model):
        if id(layer) in taken or id(_dense_of(layer) or layer) in taken:
            continue
        if isinstance(layer, keras.layers.TimeDistributed) and axis_layout(
                keras_layers.main_variable(layer.layer)) is not None:
            layer = layer.layer  # split already (describe after training)
        if axis_layout(keras_layers.main_variable(layer)) is not None:
            decisions.append(getattr(layer, "_tfdist_decision", None) or Decision(
                layer, layer._tfdist_layout, f"tfdist.layers.{type(layer).__name__}"))
        elif _dense_of(layer) is not None and constrained_weight(layer) is None:
            pair = _dense_pair(layer, tensor, taken)
            if (classifier and isinstance(pair[0].layout, Replicated)
                    and type(layer) is keras.layers.Dense and _is_final(model, layer)):
                pair = [_classifier(model, layer, tensor)]
            decisions.extend(pair)
            taken.update(id(d.layer) for d in pair)
        else:
            decisions.extend(_sublayer_decisions(layer, tensor))
    tied = _final_reverse_embedding(model) if classifier else None
    decisions = [_tied_classifier(model, d) if d.layer is tied and isinstance(
        d.layout, Vocabulary) else d for d in decisions]
    return decisions if layout_map is None else follow_layout_map(decisions, layout_map)


def _sublayer_decisions(layer, tensor, arguments=None):
    """The decisions for a layer outside any functional graph's Dense pairs:
    a constrained, attention or embedding layer, or a custom layer's sublayers
    (traced on `arguments`, by default those of its first call)."""
    if not layer.weights:
        return []
    if constrained_weight(layer) is not None:
        return [Decision(layer, Replicated(), _constrained_reason(layer))]
    if isinstance(layer, keras.layers.MultiHeadAttention):
        return [_attention(layer, tensor)]
    if isinstance(layer, keras.layers.Embedding):
        return [_embedding(layer, tensor)]
    if is_custom_layer(layer):
        decisions = block_decisions(
            layer, tensor, lambda sub, args: _sublayer_decisions(sub, tensor, args), arguments)
        # Block sublayers share names ("query" in every block): their paths.
        return [dataclasses.replace(d, name=d.layer.path) for d in decisions]
    return [Decision(layer, Replicated(), _no_layout(layer))]


def _no_layout(layer):
    """Why `layer` stays whole: a layer of experts (weights of rank 3 with
    one leading axis) is said to be one."""
    leading = {w.shape[0] for w in layer.trainable_weights if len(w.shape) == 3}
    if "expert" in type(layer).__name__.lower() and len(leading) == 1:
        return (f"{leading.pop()} experts of a mixture of experts: each device holds every "
                f"expert (expert parallelism is not implemented)")
    return f"{type(layer).__name__} has no tensor-parallel layout"


def apply(decisions, mesh):
    """Partitions the layers of a plan (layers already partitioned are kept)."""
    for decision in decisions:
        layer = decision.layer
        if axis_layout(keras_layers.main_variable(layer)) is not None:
            continue
        decision.layout.apply(layer, mesh)
        layer._tfdist_decision = decision  # what describe reports afterwards


def describe(decisions) -> str:
    """One line per layer: name, class, layout and why.

    Example:

    ```python
    print(strategy.describe(model))
    # dense      Dense  column      paired with dense_1 (64 -> 32 per device)
    # dense_1    Dense  row         paired with dense
    # dense_2    Dense  replicated  no Dense consumes its output alone
    ```
    """
    rows = [(d.name, type(d.layer).__name__, d.layout.name, d.reason)
            for d in decisions]
    widths = [max((len(r[i]) for r in rows), default=0) for i in range(3)]
    return "\n".join(
        "  ".join(value.ljust(width) for value, width in zip(r[:3], widths)) + "  " + r[3]
        for r in rows)


def _layers(model):
    """Every layer with weights, in order, each once (a task model calls its
    backbone's tied embedding too), attention sublayers left to their owner."""
    found = []
    for layer in keras_functional.direct_sublayers(model):
        if isinstance(layer, keras.Model):
            found.extend(_layers(layer))
        elif not isinstance(layer, keras.layers.InputLayer):
            found.append(layer)
    return list({id(layer): layer for layer in found}.values())


def _attention(layer, tensor):
    heads = layer.num_heads
    if keras_layers.attention_is_gated(layer):
        return Decision(layer, Replicated(), "gated attention is not split in this version")
    if heads % tensor:
        return Decision(layer, Replicated(),
                        f"num_heads={heads} is not divisible by tensor={tensor}")
    return Decision(layer, Heads(), f"{heads} heads -> {heads // tensor} per device")


def _embedding(layer, tensor):
    if layer.input_dim % tensor:
        return Decision(layer, Replicated(),
                        f"input_dim (vocabulary)={layer.input_dim} is not divisible "
                        f"by tensor={tensor}")
    tied = (", reverse=True gives each device its rows' logits"
            if isinstance(layer, keras.layers.ReversibleEmbedding) else "")
    rows = f"{layer.input_dim} rows -> {layer.input_dim // tensor} per device"
    untied = getattr(layer, "reverse_embeddings", None) is not None
    return Decision(layer, Vocabulary(), rows + tied, alternatives=(
        (Vocabulary(split_reverse=False), f"{rows}, its reverse table whole"),) if untied else ())


def gathers_logits(model, decisions) -> bool:
    """Whether `model`'s output is the logits of a reverse embedding split
    by vocabulary under `decisions`, gathered whole on each device of its
    tensor group (not left sharded for the sharded loss, nor computed from
    an untied reverse table kept whole).

    Example:

    ```python
    gathers_logits(model, plan(model, tensor=2))   # a tied causal LM: True
    ```
    """
    final = _final_reverse_embedding(model)
    untied = getattr(final, "reverse_embeddings", None) is not None
    return any(d.layer is final and isinstance(d.layout, Vocabulary)
               and not d.layout.sharded_loss and (d.layout.split_reverse or not untied)
               for d in decisions)


def _final_reverse_embedding(model):
    """The ReversibleEmbedding whose reverse call gives `model`'s only output."""
    outputs = getattr(model, "outputs", None) or []
    for layer in _layers(model) if len(outputs) == 1 else []:
        if isinstance(layer, keras.layers.ReversibleEmbedding) and any(
                node.arguments.kwargs.get("reverse") and node.outputs[0] is outputs[0]
                for node in keras_functional.inbound_nodes(layer)):
            return layer
    return None


def _tied_classifier(model, decision):
    """The decision for the tied embedding giving the model's logits, with
    `vocab_parallel_classifier`: its logits left sharded for the loss."""
    why = _sharded_loss_refusal(model)
    if why:
        return dataclasses.replace(decision, reason=f"{decision.reason}; logits gathered: {why}")
    return Decision(decision.layer, Vocabulary(sharded_loss=True),
                    f"{decision.reason}, sharded softmax loss")


def _is_final(model, layer):
    """Whether `layer`'s output is the model's only output."""
    outputs = getattr(model, "outputs", None) or []
    nodes = keras_functional.inbound_nodes(layer)
    return len(outputs) == 1 and len(nodes) == 1 and nodes[0].outputs[0] is outputs[0]


def _sharded_loss_refusal(model):
    """Why `model`'s loss cannot take sharded logits, or None."""
    entries = compiled_losses(model)
    # Before the first step the compiled loss is not built: what compile got.
    losses = [e.loss for e in entries] if entries else [getattr(model, "loss", None)]
    if len(losses) != 1 or not is_sparse_softmax_loss(
            getattr(losses[0], "fallback", losses[0])):
        return ("a sharded softmax loss needs the model compiled (and built) "
                "with SparseCategoricalCrossentropy(from_logits=True) alone")
    return None


def _classifier(model, layer, tensor):
    why = _sharded_loss_refusal(model)
    if why:
        return Decision(layer, Replicated(), why)
    if layer.units % tensor:
        return Decision(layer, Replicated(),
                        f"units (classes)={layer.units} is not divisible by tensor={tensor}")
    if layer.activation not in (None, keras.activations.linear):
        return Decision(layer, Replicated(), "a class-split classifier must output logits "
                        "(no activation)")
    return Decision(layer, Classifier(), f"{layer.units} classes -> {layer.units // tensor} "
                    f"per device, sharded softmax loss")


def _dense_of(layer):
    """The Dense of a Dense or of a `TimeDistributed(Dense)`, else None."""
    if isinstance(layer, keras.layers.TimeDistributed):
        layer = layer.layer
    return layer if type(layer) is keras.layers.Dense else None


def _dense_pair(layer, tensor, taken):
    """[column, row] decisions for `layer` and its consumer, or [replicated]:
    two Dense layers, or two `TimeDistributed(Dense)` (the decisions are the
    wrapped Dense layers'). Weightless elementwise layers between the two
    (Dropout, an activation) act on each device's slice of the features."""
    outer = layer
    layer = _dense_of(outer)
    consumer, between = _consumer_past_elementwise(outer)
    wrapped = _dense_of(consumer) if consumer is not None and (
        isinstance(consumer, keras.layers.TimeDistributed) == (outer is not layer)) else None
    if wrapped is None or id(consumer) in taken or id(wrapped) in taken:
        why = ("no Dense consumes its output alone" if wrapped is None
               else f"{consumer.name} is already paired")
        return [Decision(layer, Replicated(), why)]
    if _only_consumer_input(consumer) is not (between[-1] if between else outer):
        return [Decision(layer, Replicated(), f"{consumer.name} has other inputs")]
    consumer_outer, consumer = consumer, wrapped
    if constrained_weight(consumer) is not None:
        return [Decision(layer, Replicated(), f"its pair {consumer.name}: "
                         f"{_constrained_reason(consumer)}")]
    if layer.units % tensor:
        return [Decision(layer, Replicated(),
                         f"units={layer.units} is not divisible by tensor={tensor}")]
    name = activation_name(layer)
    if not activation_is_elementwise(layer):
        return [Decision(layer, Replicated(),
                         f"activation {name!r} is not elementwise (it would act on a "
                         f"slice of the features)")]
    pair = object()
    through = f" through {', '.join(b.name for b in between)}" if between else ""
    return [Decision(layer, Column(), f"paired with {consumer_outer.name}{through} "
                     f"({layer.units} -> {layer.units // tensor} units per device)",
                     name=outer.name, group=pair),
            Decision(consumer, Row(), f"paired with {outer.name}{through}",
                     name=consumer_outer.name, group=pair)]


def _consumer_past_elementwise(layer):
    """`layer`'s only consumer, past a chain of weightless elementwise layers
    each of which has it (or the one before) as its only input; and that chain."""
    between, consumer = [], _only_consumer(layer)
    while (consumer is not None and is_elementwise_layer(consumer)
           and _only_consumer_input(consumer) is (between[-1] if between else layer)):
        between.append(consumer)
        consumer = _only_consumer(consumer)
    return consumer, between


def constrained_weight(layer):
    """The path of `layer`'s first weight with a constraint, else None."""
    return next((w.path for w in layer.trainable_weights if w.constraint is not None), None)


def _constrained_reason(layer):
    return (f"weight {constrained_weight(layer)!r} has a constraint, which acts "
            f"on the whole weight")


def _only_consumer(layer):
    nodes = keras_functional.outbound_nodes(layer)
    if len(keras_functional.inbound_nodes(layer)) != 1 or len(nodes) != 1:
        return None
    return nodes[0].operation


def _only_consumer_input(layer):
    nodes = keras_functional.inbound_nodes(layer)
    if len(nodes) != 1:
        return None
    parents = nodes[0].parent_nodes
    return parents[0].operation if len(parents) == 1 else None


def partition_model(model, mesh):
    """Partitions `model` by its plan and its optimizer's slots like their
    variables (values kept). Idempotent; `TrainStep.prepare` calls it.

    Example:

    ```python
    partition_model(model, strategy.tensor_mesh)
    model.layers[0].kernel.value.values   # one (in, out/t) shard per device
    ```
    """
    decisions = plan(model, mesh.tensor, mesh.strategy.config.vocab_parallel_classifier,
                     mesh.strategy.layout_map)
    check_something_splits(model, decisions, mesh.tensor)
    if not getattr(model, "_tfdist_whole_layers_told", False):
        model._tfdist_whole_layers_told = True
        warn_of_whole_layers(model, decisions, mesh.tensor)
    with optimizer_keys_follow(model):
        apply(decisions, mesh)
    if any(d.layout.sharded_loss for d in decisions):
        entries = compiled_losses(model)
        (entry,) = entries
        if not isinstance(entry.loss, ShardedSoftmaxCrossEntropy):
            entries[0] = entry._replace(loss=ShardedSoftmaxCrossEntropy(mesh, entry.loss))
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not optimizer.built:
        return
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    variables = list(trainable_variables_of(inner))
    with mesh.strategy.scope():
        for slot, index in optimizer_slots(inner, variables, for_sharding=True):
            split = axis_layout(variables[index])
            if split is not None and axis_layout(slot) is None:
                # Its weight's slices; under `zero` straight into the shards
                # of them that `ShardedUpdate` keeps.
                layout = (MeshShardLayout(split.shape, mesh.tensor, mesh.data, split)
                          if mesh.strategy.config.shards_optimizer_state else split)
                shard_keras_variable(slot, layout, mesh.strategy)


def check_something_splits(model, decisions, tensor):
    """Raises `ValueError` when `decisions` (`plan`'s for `model`) split no
    layer: every device of a tensor group would hold and compute the same.

    Example:

    ```python
    check_something_splits(model, plan(model, 2), 2)   # a convnet: ValueError
    ```
    """
    if not any(d.layout.weight_axes(d.layer) for d in decisions):
        raise ValueError(
            f"tensor={tensor} splits no layer of model {model.name!r} "
            f"({_listed(decisions) or 'no weights'}): every device of a tensor group would "
            f"hold and compute the same. Use data parallelism (`data`) for this model; "
            f"docs/modes/tensor.md says what splits.")


def _listed(decisions, shown=8):
    """The first `shown` decisions as "name (Class): reason; ...", and how many more."""
    named = "; ".join(f"{d.name} ({type(d.layer).__name__}): {d.reason}"
                      for d in decisions[:shown])
    return named + (f"; and {len(decisions) - shown} more" if len(decisions) > shown else "")


def warn_of_whole_layers(model, decisions, tensor):
    """Warns, once before training, of every layer with a matrix or table
    (a weight of rank >= 2) that `tensor` leaves whole on every device,
    with the reason and the share of the model's parameters that stays whole
    (layer norms and biases, replicated by design, are counted but not named).

    Example:

    ```python
    model.fit(...)   # UserWarning: tensor=2 leaves 1 layer whole ... out (Dense): ...
    ```
    """
    total = sum(math.prod(w.shape) for w in model.trainable_weights)
    unsplit = [d for d in decisions if not d.layout.weight_axes(d.layer)]  # per-slice too
    matrices = [d for d in unsplit if isinstance(d.layout, Replicated)
                and any(len(w.shape) >= 2 for w in d.layer.trainable_weights)]
    if not matrices or not total:
        return
    whole = sum(math.prod(w.shape) for d in unsplit for w in d.layer.trainable_weights)
    warnings.warn(
        f"tensor={tensor} leaves {len(matrices)} layer{'s' * (len(matrices) > 1)} with "
        f"matrices whole on every device ({whole / total:.0%} of the parameters stay "
        f"whole): {_listed(matrices)}. `strategy.describe(model)` lists every layer.",
        stacklevel=2)


def sharded_classifier(model):
    """Whether `model`'s final classifier is split by classes (its loss sharded).

    Example:

    ```python
    sharded_classifier(model)   # True after the first step under
                                # Strategy(tensor=2, vocab_parallel_classifier=True)
    ```
    """
    entries = compiled_losses(model) or []
    return any(isinstance(e.loss, ShardedSoftmaxCrossEntropy) for e in entries)
