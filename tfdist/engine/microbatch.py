"""What every compute part does per microbatch: slicing, the loss, the bookkeeping.

Both ways of computing a step's gradients (`tfdist.engine.compute.LocalCompute`,
one microbatch after another on the replica's device, and the pipelined
compute, microbatches flowing through stages) cut the per-replica batch the same
way and treat each microbatch's loss the same way:

- `split`: microbatch i of k is rows `[i*n//k, (i+1)*n//k)` of the batch, so
  uneven and empty slices are fine; its `share` is its part of the global
  batch (its size over the global batch's, times the replicas, as Keras
  divides each replica's loss by their number), so replicas holding
  different numbers of examples (a global batch that does not split evenly,
  a last partial batch) weight every example alike.
- `MicrobatchLoss`: the loss of one microbatch as Keras's `train_step` computes
  it, the part of it whose gradient is taken (times `share`, then the
  optimizer's loss scale), and the loss tracker and compiled metrics updated
  with it. For batch-mean losses the shares make the summed gradients exactly
  the global batch's, and Keras's streaming metrics updated per microbatch equal
  one update with the whole batch.
- `add_gradients`: the running sum of the microbatches' gradients (sparse
  ones concatenated: together the microbatches' slices are the batch's).
- `waiting_for`: what a microbatch's ops wait on, the work before it, as one
  grouped op.
"""

import contextlib
import dataclasses

import tensorflow as tf
from keras import tree

from tfdist import sparse_gradients
from tfdist._compat import keras_trainer
from tfdist._compat.keras_losses import unscale_loss_for_distribution
from tfdist._compat.tf_distribute import summed_across_replicas
from tfdist.tensor.plan import sharded_classifier
from tfdist.tensor.softmax import sharded_logits

# Loss reductions that are a mean over the batch: the full-batch loss is the
# size-weighted sum of the microbatch losses.
MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


@dataclasses.dataclass
class Microbatch:
    """One slice of a replica's batch: its inputs, targets, sample weights,
    its share of the batch (None: the whole batch) and its size (a scalar
    tensor)."""

    x: object
    y: object
    sample_weight: object
    share: object
    size: object


def split(x, y, sample_weight, microbatches: int, global_rows=None,
          replicas: int = 1) -> list[Microbatch]:
    """The batch cut into `microbatches` consecutive slices (one: itself),
    each with its share of the global batch.

    A slice of `s` rows has share `replicas * s / global_rows`: Keras divides
    each replica's loss by the number of replicas, so summed over the replicas
    the shares weight every example of the global batch alike, however the
    batch was split over them (uneven or empty replica batches included).
    `global_rows` is the global batch's row count (default: this batch's own,
    `replicas` then being 1). With one slice and no `global_rows` the share
    is None: the batch is the whole.

    Example:

    >>> parts = split(tf.zeros((5, 2)), tf.zeros((5,)), None, 2)
    >>> [int(p.size) for p in parts], [round(float(p.share), 1) for p in parts]
    ([2, 3], [0.4, 0.6])
    >>> [float(p.share) for p in split(tf.zeros((3, 2)), None, None, 1, 12, 4)]
    [1.0]
    """
    batch_size = batch_size_of(x)
    if microbatches == 1 and global_rows is None:
        return [Microbatch(x, y, sample_weight, None, batch_size)]
    if global_rows is None:
        global_rows = batch_size
    global_rows = tf.maximum(tf.cast(global_rows, tf.float32), 1.0)
    if microbatches == 1:
        share = tf.cast(replicas * batch_size, tf.float32) / global_rows
        return [Microbatch(x, y, sample_weight, share, batch_size)]
    parts = []
    for i in range(microbatches):
        start = (i * batch_size) // microbatches
        stop = ((i + 1) * batch_size) // microbatches
        x_i, y_i, sw_i = tree.map_structure(
            lambda t, start=start, stop=stop: None if t is None else t[start:stop],
            (x, y, sample_weight))
        share = tf.cast(replicas * (stop - start), tf.float32) / global_rows
        parts.append(Microbatch(x_i, y_i, sw_i, share, stop - start))
    return parts


def global_rows(rows):
    """The global batch's row count and the number of replicas, in replica
    context: `(rows summed over the replicas, replicas)`, or `(None, 1)` with
    one replica. One scalar all-reduce.

    Example:

    ```python
    total, replicas = global_rows(batch_size_of(x))   # in strategy.run
    ```
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None, 1
    total = summed_across_replicas(tf.cast(rows, tf.float32))
    return total, context.num_replicas_in_sync


def batch_size_of(x):
    """The number of rows of a batch's inputs, as a scalar int32 tensor.

    Example:

    >>> int(batch_size_of({"a": tf.zeros((3, 4))}))
    3
    """
    first = next(t for t in tree.flatten(x) if t is not None)
    return tf.shape(first, out_type=tf.int32)[0]


def check_divides(per_replica_batch, microbatches, num_replicas):
    """A batch size known before the step must split into equal microbatches.

    Batches whose size is only known at run time (such as a last, partial
    batch) are split as evenly as possible and weighted exactly instead.

    Example:

    >>> check_divides(6, 4, 2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: `microbatches=4` must divide the per-replica batch size, which is 6: ...
    """
    if per_replica_batch is not None and per_replica_batch % microbatches:
        raise ValueError(
            f"`microbatches={microbatches}` must divide the per-replica batch "
            f"size, which is {per_replica_batch}: use a divisor of "
            f"{per_replica_batch} or a global batch size divisible by "
            f"{microbatches * num_replicas}."
        )


def check_mean_losses(model, microbatches: int):
    """Microbatching is exact for batch-mean losses; anything else is refused.

    Example:

    ```python
    check_mean_losses(model, 2)   # ValueError for a loss with reduction="sum"
    ```
    """
    for entry in keras_trainer.compiled_losses(model) or []:
        reduction = getattr(entry.loss, "reduction", "sum_over_batch_size")
        if reduction not in MEAN_REDUCTIONS:
            raise ValueError(
                f"`microbatches={microbatches}` needs losses that average over "
                f"the batch (reduction in {MEAN_REDUCTIONS}), but loss "
                f"{entry.name or entry.loss!r} has reduction={reduction!r}. Use "
                f"a mean reduction, or microbatches=1."
            )


class MicrobatchLoss:
    """A compiled model's loss on one microbatch, and its bookkeeping.

    Args:
        model: the compiled Keras model.
        mesh: the strategy's `replica_mesh`. When the model's final
            classifier is split by classes, the loss is computed on each
            rank's slice of the logits (`logits()` is the context for the
            forward pass) and the metrics see the gathered logits.

    Example:

    ```python
    loss_of = MicrobatchLoss(model, strategy.replica_mesh)
    with tf.GradientTape() as tape, loss_of.logits():
        y_pred = model(mb.x, training=True)
        loss = loss_of.loss(mb, y_pred)
        target = loss_of.target(loss, mb.share)
    metrics = loss_of.record(mb, loss, y_pred)
    ```
    """

    def __init__(self, model, mesh):
        self.model = model
        self.mesh = mesh

    def _sharded(self):
        return sharded_classifier(self.model)

    def logits(self):
        """The context of a forward pass whose logits the loss takes."""
        return sharded_logits() if self._sharded() else contextlib.nullcontext()

    def loss(self, microbatch: Microbatch, y_pred):
        """Keras's training loss of the microbatch (mean over it, plus
        `model.losses`, scaled for distribution as Keras does)."""
        return keras_trainer.compute_loss(self.model,
            x=microbatch.x, y=microbatch.y, y_pred=y_pred,
            sample_weight=microbatch.sample_weight, training=True)

    def target(self, loss, share):
        """What to differentiate: the loss times its share of the batch,
        times the optimizer's loss scale."""
        part = loss if share is None else loss * tf.cast(share, loss.dtype)
        return self.model.optimizer.scale_loss(part)

    def record(self, microbatch: Microbatch, loss, y_pred):
        """Updates the loss tracker and the compiled metrics; returns the
        metric results."""
        model = self.model
        keras_trainer.loss_tracker(model).update_state(
            unscale_loss_for_distribution(loss),
            sample_weight=microbatch.size)
        if self._sharded() and keras_trainer.has_compiled_metrics(model):
            y_pred = self.mesh.gather_last(y_pred)  # metrics see every class
        return model.compute_metrics(microbatch.x, microbatch.y, y_pred,
                                     sample_weight=microbatch.sample_weight)


def add_gradients(total, grads):
    """`total + grads`, element by element (`tfdist.sparse_gradients.add`: None
    meaning no gradient, the slices of sparse gradients concatenated).

    Example:

    >>> [g.numpy().tolist() if g is not None else None
    ...  for g in add_gradients([tf.ones(2), None], [tf.ones(2), None])]
    [[2.0, 2.0], None]
    """
    if total is None:
        return list(grads)
    return [sparse_gradients.add(a, b) for a, b in zip(total, grads)]


def waiting_for(values):
    """`tf.control_dependencies` on one op grouping `values` (ops or tensors;
    none when empty): every op made inside runs after all of them.

    Given the values themselves, TensorFlow adds to each op made inside that
    has no input of its own (every constant, every variable read) one control
    edge per value: with a microbatch waiting on the previous one's
    gradients, the step's graph grew with the square of the model's depth
    (0.26 GiB per microbatch on an 8-block GPT-2).

    Example:

    ```python
    with waiting_for(previous_gradients):
        ...   # the next microbatch's forward and backward
    ```
    """
    return tf.control_dependencies([tf.group(values, name="after")] if values else [])
