"""`StagedCompute`, the one executor of a replica's instructions
(`tfdist.pipeline.program`: pipeline stages, ZeRO-3's units), and
`PipelineCompute`, phase 1 of the step with `pipeline` > 1.

Each replica's batch is split into `microbatches` slices that flow through the
model's stages (`tfdist.pipeline.stages`), stage s computing on its own device.
The step engine, not TensorFlow's executor, decides the order in which each
device runs its actions (the forward or the backward of one microbatch on one
stage): the schedule's emission order (`tfdist.pipeline.schedule`), written
as a program (`pipeline_program`), every action of a device waiting (control
dependencies) for that device's previous action. Each action is its
stage's `StageRunner`'s (`tfdist.pipeline.runner`). The last stage's
forward ends in the microbatch's loss, weighted by its share of the batch, so
the summed gradients are the batch's.

A zero-bubble schedule ("zb1", "zbv") splits each backward: its "B" builds the
whole backward pass of the stage, and the ops only the weight gradients need
wait for the stage's "W" (`StageGradients.start_weights`), so the input
gradients the previous stage waits for come first. With virtual stages
("interleaved") stage s runs on device s mod p; with "zbv", device d runs
stages d and 2p - 1 - d (`stage_device`).

With `tensor` > 1 each action of device d runs under `TensorMesh.stage(d)`: the
split layers' all-reduces are among the tensor group's device-d devices.

A program whose every block runs on the replica's one device (ZeRO-3's units
without pipeline stages) is traced once and called by every replica, as the
layers' calls are (`ReplicaSharedFunction`); a pipeline's, whose blocks run
on the replica's several devices, is traced by each replica.

Ops are named `tfdist/stage{s}/{fwd|bwd}/mb{i}/...`, a zero-bubble schedule's
`fwd`, `bwd_input` and `bwd_weight`; the gradient ops themselves are named
after the forward op they differentiate (`gradient_tape/tfdist/stage{s}/fwd/...`),
for a "B" and a "W" alike; a "W"'s ops wait for its `bwd_weight/mb{i}/start`,
and its gradients are added to the stage's totals under `bwd_weight/mb{i}`.
"""

import contextlib
import functools

import tensorflow as tf
from keras import tree

from tfdist import sparse_gradients
from tfdist._compat import keras_functional
from tfdist._compat.tf_distribute import local_replica_id
from tfdist._compat.tf_function import ReplicaSharedFunction
from tfdist.engine.microbatch import Microbatch, MicrobatchLoss, waiting_for
from tfdist.pipeline.placement import place_stages
from tfdist.pipeline.program import REDUCE_SCATTER, WEIGHTS, Program, pipeline_program
from tfdist.pipeline.runner import StageRunner
from tfdist.pipeline.schedule import stage_device, stage_orders
from tfdist.pipeline.stages import plan_stages, stage_devices


def _accumulate(totals, weights, grads):
    """Adds `grads` (one per (index, variable) of `weights`) into `totals[index]`
    (an embedding's slices are concatenated, `tfdist.sparse_gradients.add`)."""
    for (index, _), grad in zip(weights, grads):
        totals[index] = sparse_gradients.add(totals[index], grad)


class StagedCompute:
    """The one executor of a replica's `Program` (`tfdist.pipeline.program`):
    the refreshes of tied copies, gathers, forwards, backwards, deferred
    weight gradients and reduce-scatters of pipeline stages or ZeRO-3 units,
    each block of instructions on its device after the work its program says
    it waits for, and the BatchNormalization statistics' step end. Subclasses
    give the program (`program(microbatches)`) and, to gather or
    reduce-scatter, `gather` and `scatter`.

    Args:
        model: the compiled Keras model.
        stages: its `Stage`s.
        devices: `devices[r][d]`, device d of data replica r.
        device_of: the device index (into `devices[r]`) of each stage.
        runners: each stage's `StageRunner`.
        mesh: the strategy's `replica_mesh` (tensor groups inside stages).

    Attributes:
        gather: for `GATHER`, a function from a stage's weights to their
            full values (in the dtypes its layers compute with).
        scatter: for `REDUCE_SCATTER`, a function from (indices in the
            model's trainable weights, their gradients) to this replica's
            shards of the reduced gradients.
        peak_held: after a step is traced, the largest number of (stage,
            microbatch) activations each device held at once.

    Example:

    ```python
    grads, metrics = compute(slices)   # inside strategy.run: one (x, y, sw, share, size)
                                       # per microbatch
    ```
    """

    gather = scatter = None

    def __init__(self, model, stages, devices, device_of, runners, mesh):
        self.model = model
        self.graph = stages[0].graph
        self.stages = stages
        self.devices = devices
        self.device_of = device_of
        self.runners = runners
        self.mesh = mesh
        self.loss = MicrobatchLoss(model, mesh)
        self.peak_held = [0] * (1 + max(device_of))
        self._per_replica = {}  # (local replica, update part) -> what runs its actions
        self._shared = {}  # update part -> the actions' trace every replica shares

    def program(self, microbatches: int, update=None) -> Program:
        """The instructions of a replica's step of `microbatches` microbatches;
        with `UPDATE`s if it applies the step's `update` part itself."""
        raise NotImplementedError

    def __call__(self, slices, update=None):
        """(summed gradients aligned with `model.trainable_weights`, metrics).

        `slices` gives each microbatch's (x, y, sample_weight, share, size).
        `update` is the step's update part, given when the whole step runs:
        the weights a program's `UPDATE` applies (`update.apply(weights,
        gradients)`) have None for gradient.

        A program whose every block runs on the replica's one device (ZeRO-3's
        units) is traced once for every replica (`ReplicaSharedFunction`: its
        ops on the caller's device, its collectives with the caller's keys);
        else, or where that trace cannot serve every replica, each replica
        traces its own (`TensorMesh.in_own_function`).
        """
        local = self._local_replica()
        if max(self.device_of) == 0 and len(self.devices[local]) == 1:
            run = self._shared_actions(update)
        else:
            run = self._own_actions(update)
        return self._finish(*run(slices), local)

    def _local_replica(self) -> int:
        strategy = self.model.distribute_strategy
        replica = tf.get_static_value(
            tf.distribute.get_replica_context().replica_id_in_sync_group)
        if replica is None:
            raise RuntimeError("pipeline: the replica id is not known while tracing.")
        return int(local_replica_id(strategy.extended, replica))

    def _own_actions(self, update):
        """The calling replica's own trace of its actions."""
        key = self._local_replica(), update
        if key not in self._per_replica:
            self._per_replica[key] = self.mesh.in_own_function(functools.partial(
                self._replica_actions, local=key[0], mesh=self.mesh, update=update))
        return self._per_replica[key]

    def _shared_actions(self, update):
        """The actions' trace every replica shares."""
        if update not in self._shared:
            def actions(slices):  # (`local` None: no device of its own)
                return self._replica_actions(slices, local=None, mesh=self.mesh, update=update)

            def own(slices):
                return self._own_actions(update)(slices)

            self._shared[update] = ReplicaSharedFunction(actions, unshared=own)
        return self._shared[update]

    def _finish(self, totals, metrics, starts, moved, local):
        """The step's end for the stages' BatchNormalization statistics (one
        update per step, equal on every replica: `MovingStatistics`)."""
        for s, runner in enumerate(self.runners):
            with tf.device(self.devices[local][self.device_of[s]]):
                runner.moving.finish(starts[s], moved[s])
        return totals, metrics

    def _replica_actions(self, slices, local, mesh, update):
        # A class-split classifier gives its logit slice to the sharded loss.
        devices = [None] if local is None else self.devices[local]
        with self.loss.logits():
            return _Run(self, slices, devices, local, mesh, update).result()

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


class _Run:
    """One replica's run of its compute's `Program`: the values, activations
    and gradients its instructions hand on, and each device's blocks' work.

    Example:

    ```python
    totals, metrics, starts, moved = _Run(compute, slices, devices, local, mesh).result()
    ```
    """

    def __init__(self, compute, slices, devices, local, mesh, step_update=None):
        self.compute = compute
        self.step_update = step_update  # what `UPDATE` applies with
        self.slices = slices
        self.devices = devices
        self.local = local
        self.mesh = mesh
        self.last = len(compute.stages) - 1
        weights = len(compute.model.trainable_weights)
        self.env = [compute._inputs(x_i) for x_i, *_ in slices]  # values by id(symbolic)
        self.out_grads = [{} for _ in slices]                   # gradients by id(symbolic)
        self.held = [{} for _ in devices]                       # (stage, mb) -> Activations
        self.deferred = {}                                      # (stage, mb) -> StageGradients
        self.gathered = {}                                      # stage -> full parameters
        self.totals = [[None] * weights for _ in compute.stages]  # whole, per stage
        self.shards = [None] * weights                          # reduce-scattered
        self.metrics = None
        self.moved = [None] * len(compute.stages)               # BatchNormalization statistics
        self.starts = []
        self.done = [[] for _ in devices]                       # each device's blocks' work
        for s, runner in enumerate(compute.runners):
            with tf.device(devices[compute.device_of[s]]):
                self.starts.append(runner.moving.start())

    def result(self):
        """(gradients, metrics, each stage's statistics at the start, their
        moves) after running every block of the program."""
        program = self.compute.program(len(self.slices), self.step_update)
        self.last_scatter = {index: i.stage for i in program.instructions
                             if i.op == REDUCE_SCATTER
                             for index, _ in self.compute.runners[i.stage].weights}
        for block in program.blocks():
            self._run_block(program, block)
        met = meet_on_stage_devices(self.totals, [self.devices[self.compute.device_of[s]]
                                                  for s in range(len(self.totals))])
        grads = [shard if shard is not None else g for shard, g in zip(self.shards, met)]
        return grads, self.metrics, self.starts, self.moved

    def _run_block(self, program, block):
        d = block[0].device
        done = self.done[d]
        waits = done[-program.window] if len(done) >= program.window else []
        recording = (_recording(self.devices[d]) if program.wait_for_all_ops
                     else contextlib.nullcontext())
        lead = program.lead(block)
        with tf.name_scope(lead.scope(program.name)), tf.device(self.devices[d]), \
                waiting_for(waits), self.mesh.stage(d), recording as built:
            results = []
            for instruction in block:
                with tf.name_scope(instruction.kind) if instruction is not lead \
                        else contextlib.nullcontext():
                    results = getattr(self, instruction.op)(instruction) or results
            if not program.wait_for_all_ops:  # (else `built` says when it is done)
                results = [done for value in results for done in _run_when_done(value)]
        if program.wait_for_all_ops:
            done.append(built)
        else:
            done.append(results or (done[-1] if done else []))

    def _head(self, s, i, track):
        """The last stage's loss of microbatch i (`_last_stage_loss`); None elsewhere."""
        if s != self.last:
            return None
        return functools.partial(self.compute._last_stage_loss, self.slices[i], track)

    def refresh(self, instruction):
        return self.compute.runners[instruction.stage].refresh_copies(self.local)

    def gather(self, instruction):
        runner = self.compute.runners[instruction.stage]
        full = self.compute.gather([v for _, v in runner.weights])
        self.gathered[instruction.stage] = full
        return full

    def forward(self, instruction):
        s, i, d = instruction.stage, instruction.microbatch, instruction.device
        runner = self.compute.runners[s]
        runner.moving.reset(self.starts[s])  # every microbatch from the step's start
        # The loss is tracked by the forward, not again by a remat replay.
        kept = runner.forward(self.env[i], self._head(s, i, True), remat=instruction.remat,
                              full=self.gathered.pop(s, None))
        self.moved[s] = runner.moving.add(self.moved[s], self.slices[i][4])
        self.held[d][s, i] = kept
        peak = self.compute.peak_held
        peak[d] = max(peak[d], len(self.held[d]))
        self.env[i].update((id(sym), value) for sym, value in
                           zip(runner.stage.outputs, kept.outputs))
        if s == self.last:
            self.metrics = kept.metrics
        return tf.nest.flatten([kept.loss] if s == self.last else kept.outputs)

    def backward(self, instruction):
        s, i, d = instruction.stage, instruction.microbatch, instruction.device
        runner = self.compute.runners[s]
        kept = self.held[d][s, i] if instruction.defer else self.held[d].pop((s, i))
        if instruction.remat:
            kept = runner.replay(kept, self._head(s, i, False), full=self.gathered.pop(s, None))
        grads = runner.backward(kept, self.out_grads[i], instruction.defer)
        if instruction.defer:
            self.deferred[s, i] = grads
            return grads.inputs
        return self._add(s, grads.weights)

    def weights(self, instruction):
        s, i, d = instruction.stage, instruction.microbatch, instruction.device
        del self.held[d][s, i]
        start = tf.no_op(name="start")
        weights = self.deferred.pop((s, i)).start_weights(start)
        return self._add(s, weights) or [start]

    def reduce_scatter(self, instruction):
        runner = self.compute.runners[instruction.stage]
        totals = self.totals[instruction.stage]
        indices = [index for index, _ in runner.weights]
        grads = [totals[index] for index in indices]
        for index in indices:
            totals[index] = None
        if all(g is None for g in grads):
            return []
        shards = self.compute.scatter(indices, grads)
        _accumulate(self.shards, runner.weights, shards)
        return [g for g in tf.nest.flatten(shards, expand_composites=True) if g is not None]

    def update(self, instruction):
        """Applies the update of the weights whose last reduce-scatter was
        this stage's, from their complete shards, and drops the shards (the
        step's update part then skips them)."""
        weights = [(index, v) for index, v in self.compute.runners[instruction.stage].weights
                   if self.last_scatter[index] == instruction.stage]
        shards = [self.shards[index] for index, _ in weights]
        for index, _ in weights:
            self.shards[index] = None
        self.step_update.apply([v for _, v in weights], shards)

    def _add(self, s, weights):
        """Adds a backward's weight gradients to stage s's totals; returns
        the totals' tensors after the addition: the next block on the device
        waits for them, so a microbatch's gradients are added (and released)
        before the next backward makes its own, instead of every microbatch's
        being held until the additions catch up."""
        totals = self.totals[s]
        indices = [index for index, _ in self.compute.runners[s].weights]
        _accumulate(totals, self.compute.runners[s].weights, weights)
        return [g for g in tf.nest.flatten([totals[i] for i in indices], expand_composites=True)
                if g is not None]


@contextlib.contextmanager
def _recording(device):
    """Yields a list it fills, at the block's end, with the last ops of what
    the block built on `device` (those no other op of the block reads; its
    gradients included): once they have run, the block's work is over and
    its gathered values released."""
    graph = tf.compat.v1.get_default_graph()
    built = len(graph.get_operations())
    last = []
    yield last
    # (Other replicas' ops, built in between at a merge call, are on their
    # devices; this task's devices differ in type or index. With no device,
    # a trace of the replica's own.)
    ops = graph.get_operations()[built:]
    if device is not None:
        here = _local_device(device)
        ops = [op for op in ops if _local_device(op.device) == here]
    read = {t.op for op in ops for t in op.inputs} | {c for op in ops for c in op.control_inputs}
    last += [done for op in ops if op not in read for done in _run_when_done(op)]


# Function call ops: TensorFlow inlines their bodies before running a step.
_CALLS = ("PartitionedCall", "StatefulPartitionedCall")


def _run_when_done(value):
    """What has run only once `value`'s work is done (an op, or a tensor's):
    `value`, and for a function call an identity of each output (once
    TensorFlow inlines the call, a control edge from it waits only for its
    body's stateful ops: a pure forward's would wait for nothing)."""
    op = getattr(value, "op", value)
    if getattr(op, "type", None) not in _CALLS:
        return [value]
    return [value] + [tf.identity(t).op for t in op.outputs]


@functools.cache  # a step's ops name a few devices, thousands of times
def _local_device(name):
    spec = tf.DeviceSpec.from_string(name)
    return spec.device_type, spec.device_index


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
        pipeline = len(stages) // virtual_stages
        device_of = [stage_device(kind, s, pipeline) for s in range(len(stages))]
        self._program = pipeline_program(
            stage_orders(kind, pipeline, microbatches, virtual_stages), device_of, remat)
        split_backward = any(i.op == WEIGHTS for i in self._program.instructions)
        # The replicas share one trace of each stage's layers, unless its
        # backward is split in two (zero-bubble "B" and "W": a function's
        # gradient is one call) or XLA compiles its tensor layers' collectives
        # (with their keys).
        shared = not split_backward and not (xla and mesh.tensor > 1)
        super().__init__(
            model, stages, devices, device_of,
            [StageRunner(stage, model.trainable_weights, xla=xla, copies=copies, shared=shared)
             for stage in stages], mesh)
        self._program = self._program.first_refreshing(
            [s for s, runner in enumerate(self.runners) if runner.copies], device_of)

    def program(self, microbatches, update=None):
        return self._program

    def gather_stages(self, gather):
        """Gathers each stage's parameters (`gather`: the `gather` attribute)
        for each of its forwards and replays (ZeRO-3's stages)."""
        self.gather = gather
        self._program = self._program.then_gather()

    def reduce_scatter_stages(self, scatter):
        """Reduce-scatters each stage's gradients on its device once every
        microbatch's are summed (`scatter`: the `scatter` attribute), instead
        of meeting them whole on the replica's device (ZeRO-3's stages)."""
        self.scatter = scatter
        self._program = self._program.then_reduce_scatter(self.device_of)

    def split_copies(self):
        """After tensor groups split the model: splits the tied weights' copies
        alike (`StageRunner.split_copies`)."""
        for runner in self.runners:
            runner.split_copies(self.model.distribute_strategy)


def meet_on_stage_devices(totals, devices):
    """Each weight's gradient from the stages' `totals` (one list per stage,
    aligned with the model's trainable weights), summed on the device of the
    first stage that has one (`devices[s]`: this replica's device of stage
    s), which holds the weight: a tied weight's two (Megatron's embedding
    all-reduce) meet there, and no gradient leaves its stage's device (under
    `tfdist.ChiefStrategy` another host's). The data-parallel reduce takes
    them from there.

    Example:

    ```python
    grads = meet_on_stage_devices(totals, ["/device:CPU:0", "/device:CPU:1"])
    ```
    """
    met = []
    for grads in zip(*totals):
        held = [(stage, g) for stage, g in enumerate(grads) if g is not None]
        if not held:
            met.append(None)
            continue
        with tf.device(devices[held[0][0]]):
            met.append(functools.reduce(sparse_gradients.add, [g for _, g in held]))
    return met


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
