"""`PipelineSchedule` and `PipelineCompute`: phase 1 of the step with `pipeline` > 1.

Each replica's batch is split into `microbatches` slices that flow through the
model's stages (`tfdist.pipeline.stages`), stage s computing on its own device.
The step engine, not TensorFlow's executor, decides the order in which each
stage runs its units (the forward or the backward of one microbatch): every
unit of a stage waits (control dependencies) for that stage's previous unit, in
the schedule's order:

- "gpipe": all forwards, then all backwards;
- "1f1b": `p - s - 1` warm-up forwards, then one forward and one backward in
  turn, then the remaining backwards: at most `p - s` microbatches' activations
  are held by stage s at any time (GPipe holds all `m`).

Each unit computes its stage alone: the forward records a tape over the
stage's inputs and weights; the backward turns the gradients of the stage's
outputs (summed over every later stage that reads them) into those of its
inputs and weights. With `remat=True` a forward keeps only its inputs and the
backward recomputes it. The last stage's forward ends in the microbatch's loss,
weighted by its share of the batch, so the summed gradients are the batch's.

With `tensor` > 1 each unit of stage s runs under `TensorMesh.stage(s)`: the
split layers' all-reduces are among the tensor group's stage-s devices.

Ops are named `tfdist/stage{s}/{fwd|bwd}/mb{i}/...`.
"""

import contextlib
import functools

import tensorflow as tf
from keras.src import tree
from keras.src.losses import loss as loss_module
from keras.src.models.functional import operation_fn

from tfdist.pipeline.placement import place_stages
from tfdist.pipeline.stages import graph_of, plan_stages
from tfdist.tensor.softmax import sharded_logits
from tfdist.tensor.plan import sharded_classifier


def schedule(kind: str, stages: int, microbatches: int) -> list[list[tuple[str, int]]]:
    """Each stage's units in order: ("F", i) forward, ("B", i) backward of microbatch i.

    Example:

    >>> schedule("1f1b", 2, 3)[0]
    [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
    """
    per_stage = []
    for s in range(stages):
        if kind == "gpipe":
            order = [("F", i) for i in range(microbatches)]
            order += [("B", i) for i in range(microbatches)]
        else:
            warm = min(stages - s - 1, microbatches)
            order = [("F", i) for i in range(warm)]
            for i in range(microbatches - warm):
                order += [("F", warm + i), ("B", i)]
            order += [("B", i) for i in range(microbatches - warm, microbatches)]
        per_stage.append(order)
    return per_stage


def emission_order(per_stage):
    """The units of every stage merged into one order that respects both each
    stage's order and the data dependencies (forward from stage s-1, backward
    from stage s+1): the clock of the pipeline.

    Example:

    >>> emission_order(schedule("gpipe", 2, 1))
    [(0, 'F', 0), (1, 'F', 0), (1, 'B', 0), (0, 'B', 0)]
    """
    stages = len(per_stage)
    done, position, order = set(), [0] * stages, []
    total = sum(len(units) for units in per_stage)
    while len(order) < total:
        progressed = False
        for s in range(stages):
            if position[s] == len(per_stage[s]):
                continue
            kind, i = per_stage[s][position[s]]
            ready = ((s == 0 or (s - 1, "F", i) in done) if kind == "F"
                     else (s, "F", i) in done and (s == stages - 1 or (s + 1, "B", i) in done))
            if ready:
                order.append((s, kind, i))
                position[s] += 1
                progressed = True
        done.update(order)
        if not progressed:
            raise RuntimeError(f"pipeline schedule deadlocks: {per_stage}")
    return order


class PipelineCompute:
    """Gradients of one replica's batch through the stages, in schedule order.

    Args:
        model: the compiled Keras model.
        stages: its `Stage`s (`plan_stages`).
        devices: `devices[r][s]`, the device of stage s in data replica r.
        microbatches: microbatches per replica batch.
        kind: "gpipe" or "1f1b".
        remat: recompute each stage's forward in its backward.
        xla: compile each stage's layers with XLA.

    After a step is traced, `peak_held[s]` is the largest number of
    microbatches whose activations stage s held at once.

    Example:

    ```python
    compute = PipelineCompute(model, plan_stages(model, 2), [["CPU:0", "CPU:1"]], 4, "1f1b")
    grads, metrics = compute(slices)   # inside strategy.run: one (x, y, sw, share, size)
                                       # per microbatch
    ```
    """

    def __init__(self, model, stages, devices, microbatches, kind, remat=False, xla=False):
        self.model = model
        self.graph = graph_of(model)
        self.stages = stages
        self.devices = devices
        self.order = emission_order(schedule(kind, len(stages), microbatches))
        self.remat = remat
        self.peak_held = [0] * len(stages)
        self._per_replica = {}  # with tensor groups: local replica -> its tf.function
        # With xla, each stage's layers are one XLA computation (per stage,
        # replica and microbatch shape); the schedule stays the engine's.
        self._run = [functools.partial(self._run_nodes, stage) for stage in stages]
        if xla:
            self._run = [tf.function(run, jit_compile=True, reduce_retracing=True)
                         for run in self._run]
        self._state = [[v for layer in stage.layers
                        for v in getattr(layer, "non_trainable_variables", ())]
                       for stage in stages]
        weights = {id(v): i for i, v in enumerate(model.trainable_weights)}
        self._weights = [[(weights[id(v)], v) for layer in stage.layers
                          for v in getattr(layer, "trainable_weights", ())] for stage in stages]

    def __call__(self, slices):
        """(summed gradients aligned with `model.trainable_weights`, metrics).

        `slices` gives each microbatch's (x, y, sample_weight, share, size).
        """
        strategy = self.model.distribute_strategy
        replica = tf.get_static_value(
            tf.distribute.get_replica_context().replica_id_in_sync_group)
        if replica is None:
            raise RuntimeError("pipeline: the replica id is not known while tracing.")
        local = int(strategy.extended._get_local_replica_id(replica))
        mesh = getattr(strategy, "tensor_mesh", None)
        if mesh is None:
            return self._replica_units(slices, local, mesh)
        # With tensor groups, units all-reduce with the other replicas. The
        # replicas are traced into one graph, in which TensorFlow chains
        # every stateful op without a resource (such as a loss's shape
        # assert) in trace order: replica 0's second loss before replica 1's
        # first, which (1F1B) waits for a backward whose all-reduce needs
        # replica 0's second forward: a cycle. One function call per replica
        # keeps each replica's chain inside its own call.
        if local not in self._per_replica:
            self._per_replica[local] = tf.function(
                functools.partial(self._replica_units, local=local, mesh=mesh))
        return self._per_replica[local](slices)

    def _replica_units(self, slices, local, mesh):
        devices = self.devices[local]
        # A class-split classifier gives its logit slice to the sharded loss.
        sharded = mesh is not None and sharded_classifier(self.model)
        with sharded_logits() if sharded else contextlib.nullcontext():
            return self._units(slices, devices, mesh, sharded)

    def _units(self, slices, devices, mesh, sharded):
        """Every unit of the schedule, in emission order (see `__call__`)."""
        last = len(self.stages) - 1
        env = [self._inputs(x_i) for x_i, *_ in slices]   # values by id(symbolic)
        out_grads = [{} for _ in slices]                   # gradients by id(symbolic)
        held = [dict() for _ in self.stages]               # stage -> mb -> saved
        previous = [[] for _ in self.stages]               # stage's last unit's tensors
        totals = [None] * len(self.model.trainable_weights)
        metrics = None
        for s, kind, i in self.order:
            stage = self.stages[s]
            _, y_i, sw_i, share, size = slices[i]
            scope = f"stage{s}/{'fwd' if kind == 'F' else 'bwd'}/mb{i}"
            with tf.name_scope(scope), tf.device(devices[s]), \
                    tf.control_dependencies(previous[s]), \
                    mesh.stage(s) if mesh else contextlib.nullcontext():
                if kind == "F":
                    # remat replays this forward later: keep the stage's state
                    # (random-seed counters) as it was before it.
                    state = ([tf.identity(v.value) for v in self._state[s]]
                             if self.remat else None)
                    saved = self._forward(stage, env[i], s == last, slices[i], record=not self.remat)
                    saved["state"] = state
                    held[s][i] = saved
                    self.peak_held[s] = max(self.peak_held[s], len(held[s]))
                    outputs = saved["outputs"]
                    if s == last:
                        loss, y_pred = saved["loss"], saved["y_pred"]
                        self.model._loss_tracker.update_state(
                            loss_module.unscale_loss_for_distribution(loss),
                            sample_weight=size)
                        if sharded and self.model._compile_metrics is not None:
                            y_pred = mesh.gather_last(y_pred)  # metrics see every class
                        metrics = self.model.compute_metrics(
                            slices[i][0], y_i, y_pred, sample_weight=sw_i)
                        outputs = [loss]
                    env[i].update((id(sym), value) for sym, value in
                                  zip(stage.outputs, saved["outputs"]))
                    previous[s] = tf.nest.flatten(outputs)
                else:
                    saved = held[s].pop(i)
                    if self.remat:
                        saved = self._replay(stage, saved, s == last, slices[i])
                    grads = self._backward(stage, saved, out_grads[i], s == last)
                    for (index, _), grad in zip(self._weights[s], grads):
                        if grad is not None:
                            grad = tf.convert_to_tensor(grad)  # embeddings: IndexedSlices
                            totals[index] = grad if totals[index] is None else totals[index] + grad
                    previous[s] = [g for g in tf.nest.flatten(grads, expand_composites=True)
                                   if g is not None] or previous[s]
        # The gradients meet on the replica's own device: the data-parallel
        # reduce is then one packed all-reduce, as without stages.
        with tf.device(devices[0]):
            totals = [None if g is None else tf.identity(g) for g in totals]
        return totals, metrics

    def _replay(self, stage, saved, is_last, microbatch):
        """The remat forward: the stage's forward again, under a tape, with its
        state (seed counters, normalisation statistics) set to what the first
        run saw and restored afterwards, so dropout draws the same masks and no
        statistic is updated twice."""
        state = self._state[stage.index]
        now = [tf.identity(v.value) for v in state]
        with tf.control_dependencies(now):
            started = [v.assign(value) for v, value in zip(state, saved["state"])]
        with tf.control_dependencies(tf.nest.flatten(started)):
            replayed = self._forward(stage, saved["inputs"], is_last, microbatch, record=True)
        with tf.control_dependencies(tf.nest.flatten(replayed["outputs"])):
            for v, value in zip(state, now):
                v.assign(value)
        return replayed

    def _inputs(self, x):
        return {id(sym): value for sym, value in
                zip(self.graph.inputs, tree.flatten(self.graph._standardize_inputs(x)))}

    def _forward(self, stage, env, is_last, microbatch, record):
        """Runs the stage's nodes on `env`; returns what its backward needs."""
        inputs = {id(sym): env[id(sym)] for sym in stage.inputs}
        sources = [inputs[id(sym)] for sym in stage.inputs]
        tape = tf.GradientTape()
        saved = {"inputs": inputs}
        with tape if record else contextlib.nullcontext():
            if record:
                tape.watch([t for t in sources if t.dtype.is_floating])
            saved["outputs"] = self._run[stage.index](sources)
            if is_last:
                x_i, y_i, sw_i, share, _ = microbatch
                values = dict(inputs)
                values.update((id(sym), value) for sym, value in
                              zip(stage.outputs, saved["outputs"]))
                y_pred = self._predictions(values)
                loss = self.model._compute_loss(
                    x=x_i, y=y_i, y_pred=y_pred, sample_weight=sw_i, training=True)
                part = loss if share is None else loss * tf.cast(share, loss.dtype)
                saved["scaled"] = self.model.optimizer.scale_loss(part)
                saved["loss"], saved["y_pred"] = loss, y_pred
        saved["tape"] = tape if record else None
        saved["sources"] = sources
        return saved

    def _run_nodes(self, stage, sources):
        """The stage's layer calls on its input values; its output values."""
        values = {id(sym): value for sym, value in zip(stage.inputs, sources)}
        for node in stage.nodes:
            args, kwargs = node.arguments.fill_in(values)
            op = operation_fn(node.operation, training=True)
            outputs = op(*args, **kwargs)
            for sym, value in zip(node.outputs, tree.flatten(outputs)):
                values[id(sym)] = value
        return [values[id(sym)] for sym in stage.outputs]

    def _predictions(self, values):
        outputs = [values[id(sym)] for sym in self.graph.outputs]
        return tree.pack_sequence_as(self.graph._outputs_struct, outputs)

    def _backward(self, stage, saved, out_grads, is_last):
        """Gradients of the stage's weights; adds its inputs' gradients to `out_grads`."""
        weights = [v for _, v in self._weights[stage.index]]
        sources = saved["sources"]
        floating = [t for t in sources if t.dtype.is_floating]
        if is_last:
            targets, seeds = saved["scaled"], None
        else:
            pairs = [(out, out_grads.get(id(sym))) for sym, out in
                     zip(stage.outputs, saved["outputs"]) if out_grads.get(id(sym)) is not None]
            targets = [out for out, _ in pairs]
            seeds = [g for _, g in pairs]
        if is_last or targets:
            grads = saved["tape"].gradient(targets, floating + weights, output_gradients=seeds)
        else:
            grads = [None] * (len(floating) + len(weights))
        input_grads = iter(grads[:len(floating)])
        for sym, value in zip(stage.inputs, sources):
            if value.dtype.is_floating:
                grad = next(input_grads)
                if grad is not None:
                    grad = tf.convert_to_tensor(grad)
                    known = out_grads.get(id(sym))
                    out_grads[id(sym)] = grad if known is None else known + grad
        return grads[len(floating):]


def pipeline_compute(model, strategy) -> PipelineCompute:
    """Plans `model`'s stages, moves their variables onto the stages' devices,
    and returns the compute that runs them (strategy's `pipeline`,
    `stage_boundaries`, `microbatches`, `schedule`, `remat`).

    Example:

    ```python
    compute = pipeline_compute(model, tfdist.Strategy(pipeline=2, microbatches=4))
    ```
    """
    config = strategy.config
    stages = plan_stages(model, config.pipeline, config.stage_boundaries)
    devices = strategy.pipeline_devices
    per_stage = [[replica[s] for replica in devices] for s in range(config.pipeline)]
    place_stages(model, stages, per_stage, strategy)
    return PipelineCompute(model, stages, devices, config.microbatches,
                           config.schedule, remat=config.remat, xla=config.xla)
