"""`PipelineCompute`: phase 1 of the step with `pipeline` > 1.

Each replica's batch is split into `microbatches` slices that flow through the
model's stages (`tfdist.pipeline.stages`), stage s computing on its own device.
The step engine, not TensorFlow's executor, decides the order in which each
device runs its actions (the forward or the backward of one microbatch on one
stage): the schedule's emission order (`tfdist.pipeline.schedule`), every
action of a device waiting (control dependencies) for that device's previous
action. Each action is its stage's `StageRunner`'s (`tfdist.pipeline.runner`).
The last stage's forward ends in the microbatch's loss, weighted by its share
of the batch, so the summed gradients are the batch's.

A zero-bubble schedule ("zb1", "zbv") splits each backward: its "B" builds the
whole backward pass of the stage, and the ops only the weight gradients need
wait for the stage's "W" (`StageGradients.start_weights`), so the input
gradients the previous stage waits for come first. With virtual stages
("interleaved") stage s runs on device s mod p; with "zbv", device d runs
stages d and 2p - 1 - d (`stage_device`).

With `tensor` > 1 each action of device d runs under `TensorMesh.stage(d)`: the
split layers' all-reduces are among the tensor group's device-d devices.

Ops are named `tfdist/stage{s}/{fwd|bwd}/mb{i}/...`, a zero-bubble schedule's
`fwd`, `bwd_input` and `bwd_weight`; the gradient ops themselves are named
after the forward op they differentiate (`gradient_tape/tfdist/stage{s}/fwd/...`),
for a "B" and a "W" alike; a "W"'s ops wait for its `bwd_weight/mb{i}/start`,
and its gradients are added to the stage's totals under `bwd_weight/mb{i}`.
"""

import functools

import tensorflow as tf
from keras import tree

from tfdist import sparse_gradients
from tfdist._compat import keras_functional
from tfdist._compat.tf_distribute import local_replica_id
from tfdist.engine.microbatch import Microbatch, MicrobatchLoss
from tfdist.pipeline.placement import place_stages
from tfdist.pipeline.runner import StageRunner
from tfdist.pipeline.schedule import (
    BACKWARD,
    FORWARD,
    WEIGHTS,
    emission_order,
    stage_device,
    stage_orders,
)
from tfdist.pipeline.stages import plan_stages, stage_devices


def _accumulate(totals, weights, grads):
    """Adds `grads` (one per (index, variable) of `weights`) into `totals[index]`
    (an embedding's slices are concatenated, `tfdist.sparse_gradients.add`)."""
    for (index, _), grad in zip(weights, grads):
        totals[index] = sparse_gradients.add(totals[index], grad)


def _meet(per_stage):
    """Each weight's gradient summed over the stages (a tied weight has two;
    Megatron's embedding all-reduce), per stage accumulated on its device."""
    return [functools.reduce(sparse_gradients.add, grads, None)
            for grads in zip(*per_stage)]


class StagedCompute:
    """What computes a replica's gradients stage by stage shares: the
    replica's stage runners, the last stage's loss, the BatchNormalization
    statistics' step end. Subclasses implement `_run_actions`.

    Args:
        model: the compiled Keras model.
        stages: its `Stage`s.
        devices: `devices[r][d]`, device d of data replica r.
        device_of: the device index (into `devices[r]`) of each stage.
        runners: each stage's `StageRunner`.
        mesh: the strategy's `replica_mesh` (tensor groups inside stages).

    Example:

    ```python
    grads, metrics = compute(slices)   # inside strategy.run: one (x, y, sw, share, size)
                                       # per microbatch
    ```
    """

    def __init__(self, model, stages, devices, device_of, runners, mesh):
        self.model = model
        self.graph = stages[0].graph
        self.stages = stages
        self.devices = devices
        self.device_of = device_of
        self.runners = runners
        self.mesh = mesh
        self.loss = MicrobatchLoss(model, mesh)
        self._per_replica = {}  # with tensor groups: local replica -> its tf.function

    def __call__(self, slices):
        """(summed gradients aligned with `model.trainable_weights`, metrics).

        `slices` gives each microbatch's (x, y, sample_weight, share, size).
        """
        strategy = self.model.distribute_strategy
        replica = tf.get_static_value(
            tf.distribute.get_replica_context().replica_id_in_sync_group)
        if replica is None:
            raise RuntimeError("pipeline: the replica id is not known while tracing.")
        local = int(local_replica_id(strategy.extended, replica))
        mesh = self.mesh
        if mesh.tensor == 1:
            return self._finish(*self._replica_actions(slices, local, mesh), local)
        # With tensor groups, actions all-reduce with the other replicas. The
        # replicas are traced into one graph, in which TensorFlow chains
        # every stateful op without a resource (such as a loss's shape
        # assert) in trace order: replica 0's second loss before replica 1's
        # first, which (1F1B) waits for a backward whose all-reduce needs
        # replica 0's second forward: a cycle. One function call per replica
        # keeps each replica's chain inside its own call.
        if local not in self._per_replica:
            self._per_replica[local] = tf.function(
                functools.partial(self._replica_actions, local=local, mesh=mesh),
                autograph=False)
        return self._finish(*self._per_replica[local](slices), local)

    def _finish(self, totals, metrics, starts, moved, local):
        """The step's end for the stages' BatchNormalization statistics (one
        update per step, equal on every replica: `MovingStatistics`)."""
        for s, runner in enumerate(self.runners):
            with tf.device(self.devices[local][self.device_of[s]]):
                runner.moving.finish(starts[s], moved[s])
        return totals, metrics

    def _replica_actions(self, slices, local, mesh):
        # A class-split classifier gives its logit slice to the sharded loss.
        with self.loss.logits():
            return self._run_actions(slices, local, mesh)

    def _run_actions(self, slices, local, mesh):
        """(totals, metrics, each stage's statistics at the start, their
        moves) of this replica's microbatches `slices`."""
        raise NotImplementedError

    @staticmethod
    def _add(totals, runner, weights):
        """Adds a backward's weight gradients to the stage's totals; returns
        their tensors."""
        _accumulate(totals, runner.weights, weights)
        return [g for g in tf.nest.flatten(weights, expand_composites=True) if g is not None]

    def _last_stage_loss(self, microbatch, track, values):
        """The last stage's loss of `microbatch` (its (x, y, sample_weight,
        share, size)) from the stage's `values`: (loss, loss weighted by the
        microbatch's share and scaled by the optimizer, metrics). With `track`
        (the first forward, not a remat replay) it also updates the loss
        tracker and the compiled metrics; otherwise metrics is None."""
        part = Microbatch(*microbatch)
        outputs = [values[id(sym)] for sym in self.graph.outputs]
        structure = keras_functional.outputs_structure(self.graph.model)
        y_pred = tree.pack_sequence_as(structure, outputs)
        loss = self.loss.loss(part, y_pred)
        scaled = self.loss.target(loss, part.share)
        if not track:
            return loss, scaled, None
        return loss, scaled, self.loss.record(part, loss, y_pred)

    def _inputs(self, x):
        return {id(sym): value for sym, value in
                zip(self.graph.inputs,
                    tree.flatten(keras_functional.standardize_inputs(self.graph.model, x)))}


class PipelineCompute(StagedCompute):
    """Gradients of one replica's batch through the stages, in schedule order.

    Args:
        model: the compiled Keras model.
        stages: its `Stage`s (`plan_stages`).
        devices: `devices[r][d]`, pipeline device d of data replica r (stage
            s runs on device `stage_device(kind, s, p)`: s mod p, or ZB-V's V).
        microbatches: microbatches per replica batch.
        mesh: the strategy's `replica_mesh`.
        kind: the schedule, a key of `tfdist.pipeline.schedule.SCHEDULES`.
        remat: recompute each stage's forward in its backward.
        xla: compile each stage's layers with XLA.
        virtual_stages: stages per device ("interleaved", "zbv").

    After a step is traced, `peak_held[d]` is the largest number of (stage,
    microbatch) activations device d held at once (`held_activations` of
    the schedule).

    Example:

    ```python
    compute = PipelineCompute(model, plan_stages(model, 2), [["CPU:0", "CPU:1"]], 4,
                              strategy.replica_mesh, "1f1b")
    grads, metrics = compute(slices)   # inside strategy.run: one (x, y, sw, share, size)
                                       # per microbatch
    ```
    """

    def __init__(self, model, stages, devices, microbatches, mesh, kind, remat=False,
                 xla=False, copies=None, virtual_stages=1):
        self.pipeline = len(stages) // virtual_stages
        self.order = emission_order(stage_orders(kind, self.pipeline, microbatches,
                                                 virtual_stages))
        self.split_backward = any(action.kind == WEIGHTS for action in self.order)
        # The replicas share one trace of each stage's layers, unless its
        # backward is split in two (zero-bubble "B" and "W": a function's
        # gradient is one call) or XLA compiles its tensor layers' collectives
        # (with their keys).
        shared = not self.split_backward and not (xla and mesh.tensor > 1)
        super().__init__(
            model, stages, devices,
            [stage_device(kind, s, self.pipeline) for s in range(len(stages))],
            [StageRunner(stage, model.trainable_weights, xla=xla, copies=copies, shared=shared)
             for stage in stages], mesh)
        # The stages' gradient totals -> each weight's (`meet_on_replica_device`).
        self.gradients_out = meet_on_replica_device
        self.remat = remat
        self.peak_held = [0] * self.pipeline

    def split_copies(self):
        """After tensor groups split the model: splits the tied weights' copies
        alike (`StageRunner.split_copies`)."""
        for runner in self.runners:
            runner.split_copies(self.model.distribute_strategy)

    def _run_actions(self, slices, local, mesh):
        """Every action of the schedule, in emission order, each on its
        stage's device after the device's previous action."""
        devices = self.devices[local]
        p, last = self.pipeline, len(self.stages) - 1
        names = {FORWARD: "fwd", BACKWARD: "bwd_input" if self.split_backward else "bwd",
                 WEIGHTS: "bwd_weight"}
        env = [self._inputs(x_i) for x_i, *_ in slices]   # values by id(symbolic)
        out_grads = [{} for _ in slices]                   # gradients by id(symbolic)
        held = [{} for _ in range(p)]                      # device -> (stage, mb) -> Activations
        deferred = {}                                      # (stage, mb) -> StageGradients
        previous = [[] for _ in range(p)]                  # device's last action's tensors
        totals = [[None] * len(self.model.trainable_weights) for _ in self.stages]
        metrics = None
        starts, moved = [], [None for _ in self.stages]   # BatchNormalization statistics
        for s, runner in enumerate(self.runners):
            with tf.device(devices[self.device_of[s]]):
                starts.append(runner.moving.start())
                previous[self.device_of[s]] += runner.refresh_copies(local)
        for action in self.order:
            s, i, d = action.stage, action.microbatch, self.device_of[action.stage]
            runner = self.runners[s]
            # The loss is tracked by the forward, not again by a remat replay.
            head = (functools.partial(self._last_stage_loss, slices[i], action.kind == FORWARD)
                    if s == last else None)
            with tf.name_scope(f"stage{s}/{names[action.kind]}/mb{i}"), \
                    tf.device(devices[d]), tf.control_dependencies(previous[d]), \
                    mesh.stage(d):
                if action.kind == FORWARD:
                    runner.moving.reset(starts[s])  # every microbatch from the step's start
                    kept = runner.forward(env[i], head, remat=self.remat)
                    moved[s] = runner.moving.add(moved[s], slices[i][4])
                    held[d][s, i] = kept
                    self.peak_held[d] = max(self.peak_held[d], len(held[d]))
                    env[i].update((id(sym), value) for sym, value in
                                  zip(runner.stage.outputs, kept.outputs))
                    if s == last:
                        metrics = kept.metrics
                    previous[d] = tf.nest.flatten([kept.loss] if s == last else kept.outputs)
                elif action.kind == BACKWARD:
                    kept = held[d][s, i] if self.split_backward else held[d].pop((s, i))
                    if self.remat:
                        kept = runner.replay(kept, head)
                    grads = runner.backward(kept, out_grads[i], self.split_backward)
                    if self.split_backward:
                        deferred[s, i] = grads
                        previous[d] = grads.inputs or previous[d]
                    else:
                        previous[d] = self._add(totals[s], runner, grads.weights) or previous[d]
                else:  # the weight gradients a zero-bubble "B" left for now
                    del held[d][s, i]
                    start = tf.no_op(name="start")
                    weights = deferred.pop((s, i)).start_weights(start)
                    previous[d] = self._add(totals[s], runner, weights) or [start]
        return self.gradients_out(totals, devices), metrics, starts, moved


def meet_on_replica_device(totals, devices):
    """Each weight's gradient from the stages' `totals` (one list per stage,
    aligned with the model's trainable weights), on the replica's own device
    `devices[0]`: the data-parallel reduce is then one packed all-reduce, as
    without stages.

    Example:

    ```python
    grads = meet_on_replica_device(totals, strategy.pipeline_devices[0])
    ```
    """
    with tf.device(devices[0]):
        return [None if g is None else tf.identity(g) for g in _meet(totals)]


def pipeline_compute(model, strategy, sequence_length=None) -> PipelineCompute:
    """Plans `model`'s stages, moves their variables onto the stages' devices,
    and returns the compute that runs them (strategy's `pipeline`,
    `virtual_stages`, `stage_boundaries`, `microbatches`, `schedule`, `remat`).
    `sequence_length` (from the first batch) sizes the stages' cost estimates.

    Example:

    ```python
    compute = pipeline_compute(model, tfdist.Strategy(pipeline=2, microbatches=4))
    ```
    """
    config = strategy.config
    stages = plan_stages(model, config.model_stages, config.stage_boundaries, sequence_length)
    devices = strategy.pipeline_devices
    copies = place_stages(model, stages, stage_devices(config, devices), strategy)
    return PipelineCompute(model, stages, devices, config.microbatches, strategy.replica_mesh,
                           config.schedule, remat=config.remat, xla=config.xla,
                           copies=copies, virtual_stages=config.virtual_stages)
