"""Compute parts: a replica's batch in, its local gradients and metrics out.

The first of a step's three parts (`TrainStep` = update(reduce(compute(batch)))).
Every compute part is called in replica context with the replica's batch and
returns `(gradients, metrics)`: the gradients of the replica's whole batch loss
(aligned with `model.trainable_weights`, None where a weight has none), not yet
reduced across replicas, and the compiled metrics' results on this replica's
examples (the step then syncs them over the global batch:
`tfdist.engine.metrics`).

- `LocalCompute`: the batch's microbatches one after another on the replica's
  device (one forward and backward when `microbatches=1`), XLA-compiled with
  `xla=True`.
- `PipelinedCompute`: the microbatches flow through the pipeline stages in the
  schedule's order (`tfdist.pipeline.compute`).

With tensor parallelism the replicas of a tensor group first exchange their
slices of the batch (`TensorMesh.group_batch`): a group computes on the same
examples.
"""

import keras
import tensorflow as tf

from tfdist import sparse_gradients
from tfdist._compat.keras_layers import keras_masks, set_keras_masks
from tfdist._compat.keras_trainer import call_has_training_arg
from tfdist.engine import microbatch
from tfdist.engine.moving_statistics import MovingStatistics


class Compute:
    """The part every compute shares: unpacking the batch, the tensor group's
    batch exchange, and the checks of a microbatched batch. Subclasses
    implement `gradients(x, y, sample_weight)`.

    Args:
        model: the compiled Keras model.
        microbatches: microbatches per replica batch.
        mesh: the strategy's `replica_mesh` (a `TensorMesh`, or a
            `DataOnlyMesh` without tensor parallelism).
        loss: the per-microbatch loss (default: `MicrobatchLoss(model, mesh)`;
            a tf_keras model's: `tfdist.engine.tf_keras.TfKerasLoss`).

    Example:

    ```python
    grads, metrics = compute(batch)   # in replica context
    ```
    """

    def __init__(self, model, microbatches: int, mesh, loss=None):
        self.model = model
        self.microbatches = microbatches
        self.mesh = mesh
        self.loss = loss or microbatch.MicrobatchLoss(model, mesh)

    def __call__(self, data, update=None):
        """(this replica's gradients, metrics) of its batch `data`. `update` is
        the step's update part, given when the whole step runs: a compute
        that applies some weights' updates itself (`PipelinedCompute` running
        ZeRO-3's units) gives None for their gradients."""
        with tf.name_scope("group_batch"):  # a tensor group shares its batch
            data, _ = self.mesh.group_batch(data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        return self.gradients(x, y, sample_weight, update)

    def split(self, x, y, sample_weight):
        """The batch's microbatches, after checking it can be cut into them,
        each weighted by its share of the global batch."""
        k = self.microbatches
        if k > 1:
            groups = self.model.distribute_strategy.num_replicas_in_sync // self.mesh.tensor
            microbatch.check_divides(tf.get_static_value(microbatch.batch_size_of(x)), k, groups)
            microbatch.check_mean_losses(self.model, k)
        with tf.name_scope("count"):
            rows, replicas = microbatch.global_rows(microbatch.batch_size_of(x))
        return microbatch.split(x, y, sample_weight, k, rows, replicas)

    def gradients(self, x, y, sample_weight, update=None):
        raise NotImplementedError


class LocalCompute(Compute):
    """The microbatches one after another on the replica's device.

    Each microbatch's forward starts after the previous one's backward, so
    only one microbatch's activations are alive at a time; its gradients are
    added to the running sum. Ops are named `microbatch{i}/...`.

    Args:
        model: the compiled Keras model.
        microbatches: microbatches per replica batch.
        mesh: the strategy's `replica_mesh` (a `TensorMesh`, or a
            `DataOnlyMesh` without tensor parallelism).
        xla: compile each microbatch's forward and backward with XLA.
        loss: the per-microbatch loss (as `Compute`'s).

    Example:

    ```python
    compute = LocalCompute(model, 4, strategy.replica_mesh)
    grads, metrics = strategy.run(compute, args=(batch,))
    ```
    """

    def __init__(self, model, microbatches: int, mesh, xla=False, loss=None):
        super().__init__(model, microbatches, mesh, loss)
        self.moving = MovingStatistics([model])
        self._runs = mesh.microbatch_runs(self._forward_backward, microbatches, xla)

    def gradients(self, x, y, sample_weight, update=None):
        total = metrics = moved = None
        with tf.name_scope("split"):
            parts = self.split(x, y, sample_weight)
        start = self.moving.start()
        for i, part in enumerate(parts):
            with tf.name_scope(f"microbatch{i}"), microbatch.waiting_for(_tensors(total)):
                self.moving.reset(start)
                loss, y_pred, masks, grads = self._runs[i](
                    part.x, part.y, part.sample_weight, part.share)
                set_keras_masks(y_pred, masks)
                metrics = self.loss.record(part, loss, y_pred)
                total = microbatch.add_gradients(total, grads)
                moved = self.moving.add(moved, part.size)
        with tf.name_scope("moving_statistics"):
            self.moving.finish(start, moved)
        return total, metrics

    def _forward_backward(self, x, y, sample_weight, share):
        """Forward, loss, the predictions' Keras masks and gradients of one
        microbatch: those of `share * loss`, its part of the batch loss (the
        whole loss when `share` is None)."""
        model = self.model
        part = microbatch.Microbatch(x, y, sample_weight, share, None)
        with tf.GradientTape() as tape, self.loss.logits():
            if call_has_training_arg(model):
                y_pred = model(x, training=True)
            else:
                y_pred = model(x)
            loss = self.loss.loss(part, y_pred)
            target = self.loss.target(loss, share)
        grads = _gradients(tape, target, model.trainable_weights)
        return loss, y_pred, keras_masks(y_pred), grads


class PipelinedCompute(Compute):
    """The microbatches through the model's pipeline stages.

    Args:
        model: the compiled Keras model.
        microbatches: microbatches per replica batch.
        pipeline: the `PipelineCompute` that runs the stages' units in
            schedule order (`tfdist.pipeline.compute.pipeline_compute`).
        mesh: the strategy's `replica_mesh` (a `TensorMesh`, or a
            `DataOnlyMesh` without tensor parallelism).

    Example:

    ```python
    compute = PipelinedCompute(model, 4, pipeline_compute(model, strategy),
                               strategy.replica_mesh)
    ```
    """

    def __init__(self, model, microbatches: int, pipeline, mesh):
        super().__init__(model, microbatches, mesh)
        self.pipeline = pipeline

    def gradients(self, x, y, sample_weight, update=None):
        with tf.name_scope("split"):
            parts = self.split(x, y, sample_weight)
        return self.pipeline([(p.x, p.y, p.sample_weight, p.share, p.size) for p in parts],
                             update)


def _gradients(tape, target, variables):
    """`tape.gradient` for Keras variables, some maybe partitioned.

    A variable a parameter-server strategy partitioned (a `ShardedVariable`)
    is differentiated through its shards; its gradient is their concatenation,
    for the optimizer to apply to the whole variable. A lookup of fixed
    indices (positions) gets a dense gradient (`sparse_gradients.sum_fixed_lookups`).
    """
    sources = [getattr(v.value, "variables", None) or v for v in variables]
    grads = tape.gradient(target, sources)
    return sparse_gradients.sum_fixed_lookups([
        tf.concat([tf.convert_to_tensor(g) for g in grad], axis=0)
        if isinstance(source, list) and grad[0] is not None else
        (None if isinstance(source, list) else grad)
        for source, grad in zip(sources, grads)
    ])


def _tensors(grads):
    """The tensors of a gradient list (None and IndexedSlices handled)."""
    return tf.nest.flatten([g for g in grads or [] if g is not None],
                           expand_composites=True)
