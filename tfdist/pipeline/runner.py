"""`StageRunner`: one pipeline stage's forward, backward and remat replay of a
microbatch.

Each runs its stage alone: the forward records a tape over the stage's inputs
and weights and keeps it in `Activations`; the backward turns the gradients of
the stage's outputs (summed over every later stage that reads them) into those
of its inputs and weights. With remat the forward keeps only its inputs (and
the stage's state as it found it) and `replay` recomputes it under a tape. The
order, devices and name scopes of the actions are `PipelineCompute`'s
(`tfdist.pipeline.compute`).
"""

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import tensorflow as tf
from keras import tree

from tfdist import sparse_gradients
from tfdist._compat.keras_functional import node_call
from tfdist._compat.tf_function import ReplicaSharedFunction
from tfdist._compat.tf_graph import run_after
from tfdist._compat.tf_variables import set_storage, storage_of
from tfdist.engine.moving_statistics import MovingStatistics
from tfdist.pipeline.placement import split_like


@dataclasses.dataclass
class Activations:
    """What a stage's forward of one microbatch keeps for its backward.

    Attributes:
        inputs: the stage's input values by `id` of their symbolic tensor.
        sources: the same values, in the order of `stage.inputs`.
        outputs: the stage's output values, in the order of `stage.outputs`.
        tape: the tape recorded over `sources` and the weights; None when
            the forward was not recorded (remat: `replay` records it).
        state: with remat, the stage's non-trainable state (seed counters,
            normalisation statistics) as the forward found it.
        loss: last stage only: the microbatch's loss.
        scaled: last stage only: the loss weighted by the microbatch's share
            and scaled by the optimizer: what the backward differentiates.
        metrics: last stage only, when tracked: the model's metrics after
            this microbatch.
        weights: with a `gather` (sharded parameters), the full values of the
            stage's weights the forward computed with, which the tape
            differentiates; None: the weights themselves.

    Example:

    ```python
    activations = runner.forward(values)
    activations.outputs   # what the next stage reads
    ```
    """

    inputs: dict
    sources: list
    outputs: list
    tape: tf.GradientTape | None = None
    state: list | None = None
    loss: Any = None
    scaled: Any = None
    metrics: Any = None
    weights: list | None = None


@contextlib.contextmanager
def substituted(copies):
    """Inside, each Keras variable of `copies` ((variable, copy) pairs) reads
    and is differentiated as its copy (a tied layer on the last stage; a
    tensor: a sharded parameter's gathered value).

    Example:

    ```python
    with substituted([(layer.kernel, full_kernel)]):
        y = layer(x)          # computes with full_kernel
    ```
    """
    copies = list(copies)
    held = [storage_of(v) for v, _ in copies]
    for v, copy in copies:
        set_storage(v, copy)
    try:
        yield
    finally:
        for (v, _), storage in zip(copies, held):
            set_storage(v, storage)


def _call_layers(stage, copies, sources):
    """The stage's layer calls on its input values; its output values.

    A value is also filed under the ids of its tensor's aliases (a nested
    model's inputs and outputs, `LayerGraph`), which its nodes' arguments use.
    Tied layers compute with the stage's `copies` of their weights.
    """
    with substituted(copies):
        return _run_nodes(stage, sources)


def _run_nodes(stage, sources):
    values = {}

    def put(sym, value):
        values[id(sym)] = value
        values.update(dict.fromkeys(stage.graph.aliases(sym), value))

    for sym, value in zip(stage.inputs, sources):
        put(sym, value)
    for node in stage.nodes:
        args, kwargs = node.arguments.fill_in(values)
        op = node_call(node.operation, training=True)
        outputs = op(*args, **kwargs)
        for sym, value in zip(node.outputs, tree.flatten(outputs)):
            put(sym, value)
    return [values[id(sym)] for sym in stage.outputs]


@dataclasses.dataclass
class StageGradients:
    """What a stage's backward of one microbatch gives.

    Attributes:
        weights: the gradients of the stage's weights (`StageRunner.weights`).
        inputs: the gradients of its floating inputs (None left out).
        weight_ops: with deferred weight gradients, the ops that only
            `weights` need, not `inputs`; None otherwise.

    Example:

    ```python
    grads = runner.backward(activations, out_grads, defer_weights=True)
    ...                                    # later: the schedule's "W"
    weights = grads.start_weights(tf.no_op())
    ```
    """

    weights: list
    inputs: list
    weight_ops: list | None = None

    def start_weights(self, trigger) -> list:
        """Makes the weight gradients' own ops wait for the op `trigger`;
        returns the weight gradients."""
        group = set(self.weight_ops)
        run_after([op for op in self.weight_ops if _first_of(op, group)], trigger)
        return self.weights


def _weight_only(ops, input_grads, weight_grads):
    """The ops of `ops` (a backward pass's) that `weight_grads` need and
    `input_grads` do not."""
    ops = set(ops)

    def ancestors(tensors):  # (a weight the stage never reads has no gradient: None)
        seen, pending = set(), [t.op for t in tensors if t is not None]
        while pending:
            op = pending.pop()
            if op in ops and op not in seen:
                seen.add(op)
                pending.extend([t.op for t in op.inputs] + list(op.control_inputs))
        return seen

    needed = ancestors(input_grads)
    return [op for op in ancestors(weight_grads) if op not in needed]


def _first_of(op, group):
    """Whether `op` reads nothing (data or control) from another op of `group`."""
    return not any(t.op in group for t in op.inputs) and not any(
        c in group for c in op.control_inputs)


class StageRunner:
    """Runs one pipeline stage's forward, backward and remat replay.

    Args:
        stage: the `Stage` it runs (`plan_stages`).
        trainable_weights: the model's trainable weights, to which the
            backward's gradients are aligned (`weights`).
        xla: compile the stage's layer calls with XLA (one computation per
            stage, replica and microbatch shape; the order stays the engine's).
        copies: the copies of the stage's `tied` layers' weights, by `id` of
            the Keras variable (`place_stages`).
        shared: trace the stage's layer calls once for every replica,
            microbatch and replay, each calling that trace with its own
            variables and collective keys (`ReplicaSharedFunction`; tensor
            layers' collectives, their gradients' too, take the caller's).

    Attributes:
        weights: (index in `trainable_weights`, variable) of each of the
            stage's trainable weights, in the order `backward` returns their
            gradients; a tied weight's entry holds its copy.
        copies: (Keras variable, copy) of each tied weight.
        state: the stage's non-trainable variables.
        moving: the stage's BatchNormalization statistics (`MovingStatistics`).

    Example:

    ```python
    runner = StageRunner(plan_stages(model, 2)[0], model.trainable_weights)
    activations = runner.forward(values)          # values by id(symbolic tensor)
    grads = runner.backward(activations, out_grads).weights
    ```
    """

    def __init__(self, stage, trainable_weights, xla=False, copies=None, shared=False):
        self.stage = stage
        self.state = [v for layer in stage.layers
                      for v in getattr(layer, "non_trainable_variables", ())]
        self.moving = MovingStatistics(stage.layers)
        index = {id(v): i for i, v in enumerate(trainable_weights)}
        self._index = index
        own = {id(v): (index[id(v)], v) for layer in stage.layers
               for v in getattr(layer, "trainable_weights", ())}  # a shared one once
        self._own = list(own.values())
        self.copies = [(v, copies[id(v)]) for layer in stage.tied for v in layer.trainable_weights]

        def stage_layers(sources, full):  # XLA's modules: a_forward_stage_layers_*, *backward*
            """The layer calls, with `full` values of the weights if given."""
            variables = [v for _, v in self.weights] if full is not None else []
            with substituted(zip(variables, full or [])):
                return _call_layers(stage, self.copies, sources)

        self._call = stage_layers
        if shared:
            # One trace of the layers (and one of their gradient) for every
            # replica, microbatch and replay: each call swaps in its replica's
            # variables; ZeRO-3's gathered values are arguments.
            self._call = ReplicaSharedFunction(stage_layers, jit_compile=xla, one_copy_too=True,
                                               no_lookups=True)
        elif xla:
            self._call = tf.function(stage_layers, jit_compile=True, reduce_retracing=True,
                                     autograph=False)

    @property
    def weights(self):
        """(index, variable) of the stage's trainable weights; copies for tied ones."""
        return self._own + [(self._index[id(v)], copy) for v, copy in self.copies]

    def split_copies(self, strategy):
        """Splits the tied weights' copies as tensor groups split the weights
        (`placement.split_like`), before the first step is traced."""
        self.copies = [(v, split_like(v, copy, strategy)) for v, copy in self.copies]

    def refresh_copies(self, local: int) -> list:
        """Sets this replica's copies of the tied weights (replica `local` on
        this task) to the first stage's values: once per step, before the
        stage's first action. Returns the assigns."""
        return [copy.values[local].assign(tf.convert_to_tensor(storage_of(v)))
                for v, copy in self.copies]

    def forward(self, values: dict, head: Callable | None = None,
                remat: bool = False, full=None) -> Activations:
        """The stage's forward on `values` (by `id` of symbolic tensor).

        `head`, given for the last stage, maps the stage's input and output
        values to (loss, scaled loss, metrics); it runs under the tape. With
        `remat` nothing is recorded: `replay` computes it again. `full`, with
        sharded parameters (ZeRO-3), are the full values of `weights`
        (gathered for this call): the layers compute with them and the
        backward differentiates them.
        """
        # remat replays this forward later: keep the stage's state (random-seed
        # counters) as it was before it.
        state = [tf.identity(v.value) for v in self.state] if remat else None
        activations = self._record(values, head, record=not remat, full=full)
        activations.state = state
        return activations

    def replay(self, activations: Activations, head: Callable | None = None,
               full=None) -> Activations:
        """The remat forward: the stage's forward again (with `full` as in
        `forward`), under a tape, with its state set to what the first run
        saw and restored afterwards, so dropout draws the same masks and no
        statistic is updated twice."""
        now = [tf.identity(v.value) for v in self.state]
        with tf.control_dependencies(now):
            started = [v.assign(value) for v, value in zip(self.state, activations.state)]
        with tf.control_dependencies(tf.nest.flatten(started)):
            replayed = self._record(activations.inputs, head, record=True, full=full)
        with tf.control_dependencies(tf.nest.flatten(replayed.outputs)):
            for v, value in zip(self.state, now):
                v.assign(value)
        return replayed

    def backward(self, activations: Activations, out_grads: dict,
                 defer_weights: bool = False) -> "StageGradients":
        """The gradients of the stage's weights (aligned with `weights`; a
        fixed lookup's dense, `sparse_gradients.sum_fixed_lookups`) and of
        its inputs, which it also adds to `out_grads` (by `id` of symbolic
        tensor; it holds the gradients of the stage's outputs).

        One backward pass computes both. With `defer_weights` (a zero-bubble
        schedule's "B"), the ops that only the weight gradients need are
        found, to be started later (`StageGradients.start_weights`, its "W").
        """
        stage = self.stage
        weights = activations.weights
        if weights is None:
            weights = [v for _, v in self.weights]
        sources = activations.sources
        floating = [t for t in sources if t.dtype.is_floating]
        is_last = activations.scaled is not None
        if is_last:
            targets, seeds = activations.scaled, None
        else:
            pairs = [(out, out_grads.get(id(sym))) for sym, out in
                     zip(stage.outputs, activations.outputs)
                     if out_grads.get(id(sym)) is not None]
            targets = [out for out, _ in pairs]
            seeds = [g for _, g in pairs]
        graph = tf.compat.v1.get_default_graph()
        built = len(graph.get_operations()) if defer_weights else None
        if is_last or targets:
            grads = activations.tape.gradient(targets, floating + weights,
                                              output_gradients=seeds)
        else:
            grads = [None] * (len(floating) + len(weights))
        input_grads = [g if g is None or isinstance(g, tf.RaggedTensor) else
                       tf.convert_to_tensor(g) for g in grads[:len(floating)]]
        weight_grads = grads[len(floating):]
        if activations.weights is not None:  # gathered, maybe in a compute dtype:
            # back to each weight's dtype, as the gradient of Keras's cast is
            weight_grads = [None if g is None else sparse_gradients.map_values(
                g, lambda t, v=v: tf.cast(t, v.dtype)) for g, (_, v) in zip(weight_grads,
                                                                            self.weights)]
        result = StageGradients(
            sparse_gradients.sum_fixed_lookups(weight_grads),
            [g for g in input_grads if g is not None])
        if defer_weights:
            result.weight_ops = _weight_only(graph.get_operations()[built:],
                                             tf.nest.flatten(result.inputs,
                                                             expand_composites=True),
                                             tf.nest.flatten(result.weights,
                                                             expand_composites=True))
        input_grads = iter(input_grads)
        for sym, value in zip(stage.inputs, sources):
            if value.dtype.is_floating:
                grad = next(input_grads)
                if grad is not None:
                    known = out_grads.get(id(sym))
                    out_grads[id(sym)] = grad if known is None else known + grad
        return result

    def _record(self, values, head, record, full):
        """Runs the stage (and `head`) on `values`, with the weights' `full`
        values if given, under a tape if `record`."""
        inputs = {id(sym): values[id(sym)] for sym in self.stage.inputs}
        sources = [inputs[id(sym)] for sym in self.stage.inputs]
        tape = tf.GradientTape() if record else None
        with tape if record else contextlib.nullcontext():
            if record:
                tape.watch([t for t in sources if t.dtype.is_floating] + (full or []))
            outputs = self._call(sources, full)
            activations = Activations(inputs, sources, outputs, tape, weights=full)
            if head is not None:
                seen = dict(inputs)
                seen.update((id(sym), value) for sym, value in
                            zip(self.stage.outputs, activations.outputs))
                activations.loss, activations.scaled, activations.metrics = head(seen)
        return activations
