"""`TrainStep`: the training step tfdist runs in place of Keras's `train_step`.

One call is one optimizer step on one replica (it runs in replica context, inside
`strategy.run`), in three phases that later modes extend:

1. **compute**: the per-replica batch is split into `microbatches` slices; each
   slice's forward pass, loss and gradients are computed (XLA-compiled when
   `xla=True`) and the gradients summed locally, each slice's loss weighted by its
   share of the batch, so the sum equals the full batch's gradient.
2. **reduce**: the summed gradients cross devices once: one batched all-reduce per
   step, whatever the number of microbatches.
3. **apply**: the model's own optimizer applies the reduced gradients (its own
   reduction is switched off for that call: the gradients are already reduced).
   Under loss scaling, every replica sees the same reduced gradients (with
   `tensor` > 1, a non-finite gradient is shared across the tensor group), so
   a non-finite gradient on any replica skips the step on every replica.

With `zero` > 0, phases 2 and 3 are `tfdist.optim.zero.ZeroUpdate`'s: the
gradients are all-reduced (zero=1) or reduce-scattered (zero=2), each replica
updates its shard of the optimizer state and parameters, and the parameters are
all-gathered (`tfdist/reduce`, `tfdist/apply`, `tfdist/gather`).

Losses, metrics and sample weights behave as in Keras's `train_step`: the loss
tracker and compiled metrics are updated once per microbatch, which for Keras's
streaming metrics equals one update with the whole batch.

The phases' ops are named `tfdist/microbatch{i}/...`, `tfdist/reduce/...` and
`tfdist/apply/...`, so a profiler trace shows which phase each op belongs to.
"""

import contextlib
import threading

import keras
import tensorflow as tf
from keras.src import tree
from keras.src.losses import loss as loss_module
from keras.src.trainers.data_adapters import data_adapter_utils

from tfdist.config import ParallelConfig
from tfdist.optim.zero import ZeroUpdate, check_shardable
from tfdist.pipeline.compute import pipeline_compute
from tfdist.tensor.partition import sharded_logits
from tfdist.tensor.plan import partition_model, sharded_classifier

# Loss reductions that are a mean over the batch: the full-batch loss is the
# size-weighted sum of the microbatch losses.
_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


class TrainStep:
    """tfdist's per-replica training step for one compiled Keras model.

    Strategies build one per model the first time `model.fit` runs a step, and
    call it in replica context instead of `model.train_step`. It can also be
    called from a custom loop (such as an `orbit` trainer) inside
    `strategy.run`.

    Args:
        model: a compiled `keras.Model` built under the strategy's scope.
        config: the strategy's `ParallelConfig`.

    Example:

    ```python
    strategy = tfdist.Strategy(data=4, microbatches=2)
    with strategy.scope():
        model = make_model()
        model.compile(optimizer="adam", loss="mse")
    step = strategy.train_step(model)   # the TrainStep fit would use
    step.build(dataset.element_spec)     # create variables before tracing

    @tf.function
    def train(iterator):
        return strategy.run(step, args=(next(iterator),))
    ```
    """

    def __init__(self, model: keras.Model, config: ParallelConfig):
        check_trainable(model, config)
        self.model = model
        self.config = config
        self._compute = self._compute_gradients
        self._zero = None
        self._partitioned = False
        self._pipeline = None
        if config.xla:
            self._compute = tf.function(
                self._compute_gradients, jit_compile=True, reduce_retracing=True
            )
        elif config.tensor > 1 and config.microbatches > 1:
            # The replicas are traced into one graph, in which TensorFlow
            # chains every stateful op without a resource (the loss's shape
            # asserts) in program order: replica 0's microbatch 1, which waits
            # for its microbatch 0's gradient all-reduce, would come before
            # replica 1's microbatch 0 and that all-reduce would never meet
            # its peer. One function call per microbatch keeps each replica's
            # chain inside its own calls.
            self._compute = tf.function(self._compute_gradients, reduce_retracing=True)

    def build(self, data):
        """Creates every variable the step needs, from a batch or its spec.

        `model.fit` does this before its first step. A custom loop must call
        it before tracing the step (a `tf.function` may create variables only
        once): it builds the layers, the compiled loss and metrics, and the
        optimizer, symbolically, from `data` (a batch, or a dataset's
        `element_spec`).

        Example:

        ```python
        step = strategy.train_step(model)
        step.build(dataset.element_spec)
        ```
        """
        with self.model.distribute_strategy.scope():
            self.model._symbolic_build(data_batch=data)
        self.prepare()

    def prepare(self):
        """Readies state the step keeps outside the model, before it is traced.

        With `zero` > 0 this moves the (built) optimizer's state into shards,
        keeping its values. Strategies call it when they run the step; it is
        idempotent.

        Example:

        ```python
        step = strategy.train_step(model)
        step.build(dataset.element_spec)   # builds, then prepares
        ```
        """
        strategy = self.model.distribute_strategy
        if self.config.pipeline > 1 and self._pipeline is None:
            self._pipeline = pipeline_compute(self.model, strategy)
        mesh = self._mesh()
        if mesh is not None and not self._partitioned:
            with tf.init_scope():
                partition_model(self.model, mesh)
            self._partitioned = True
        if self.config.zero and self._zero is None:
            if not self.model.optimizer.built:
                raise RuntimeError(
                    "The optimizer is not built: call `TrainStep.build(...)` "
                    "(or `model.fit`, which builds it) before running the step.")
            with tf.init_scope():
                self._zero = ZeroUpdate(self.model, self.config.zero)

    def _mesh(self):
        return getattr(self.model.distribute_strategy, "tensor_mesh", None)

    def __call__(self, data):
        """Runs one step on this replica's batch; returns the metric results."""
        with tf.name_scope("tfdist"):  # the phases' ops are named tfdist/<phase>/...
            if self._mesh() is not None:
                with tf.name_scope("group_batch"):  # a tensor group shares its batch
                    data, _ = self._mesh().group_batch(data)
            if self.config.zero:  # reduce(-scatter), sharded apply, gather
                if self._zero is None:
                    raise RuntimeError(
                        "Run the step with the tfdist strategy's `run` (or call "
                        "`TrainStep.prepare()` first): with `zero` the "
                        "optimizer state must be sharded before the first step.")
                x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
                grads, metrics = self.accumulate_gradients(x, y, sample_weight)
                self._zero(grads)
                return metrics
            grads, metrics = self._reduced_gradients(data)
            with tf.name_scope("apply"):
                self.apply_gradients(grads)
        return metrics

    def gradients(self, data):
        """Phases 1 and 2 alone: (reduced gradients, metric results) of a batch.

        For callers that decide whether to apply them, such as the
        parameter-server mode, which skips re-runs of steps already applied.

        Example:

        ```python
        grads, metrics = strategy.run(step.gradients, args=(batch,))
        strategy.run(step.apply_gradients, args=(grads,))
        ```
        """
        with tf.name_scope("tfdist"):
            return self._reduced_gradients(data)

    def _reduced_gradients(self, data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        grads, metrics = self.accumulate_gradients(x, y, sample_weight)
        with tf.name_scope("reduce"):
            return self.reduce_gradients(grads), metrics

    def accumulate_gradients(self, x, y, sample_weight):
        """Phase 1: local gradients of the whole batch, summed over microbatches.

        Returns the gradients and the metric results after the last microbatch.
        """
        k = self.config.microbatches
        if k == 1 and self._pipeline is None:
            with tf.name_scope("microbatch0"):
                return self._microbatch(x, y, sample_weight, None, None)
        batch_size = _batch_size(x)
        if k > 1:
            check_microbatches_divide(
                tf.get_static_value(batch_size), k,
                self.model.distribute_strategy.num_replicas_in_sync,
            )
            check_loss_reductions(self.model, k)
        if self._pipeline is not None:
            with tf.name_scope("split"):
                slices = [_microbatch_slice(x, y, sample_weight, i, k, batch_size)
                          for i in range(k)]
            return self._pipeline(slices)
        total = None
        for i in range(k):
            with tf.name_scope(f"microbatch{i}"):
                x_i, y_i, sw_i, share, size = _microbatch_slice(
                    x, y, sample_weight, i, k, batch_size)
                # One microbatch at a time: its forward starts after the previous
                # backward, so only one microbatch's activations are alive.
                with tf.control_dependencies(_tensors(total)):
                    grads, metrics = self._microbatch(x_i, y_i, sw_i, share, size)
                total = grads if total is None else _add(total, grads)
        return total, metrics

    def _microbatch(self, x, y, sample_weight, share, size):
        """Gradients of one microbatch's loss times `share` (None: the whole
        batch); updates the loss tracker and metrics."""
        model = self.model
        loss, y_pred, grads = self._compute(x, y, sample_weight, share)
        if size is None:
            size = _batch_size(x)
        model._loss_tracker.update_state(
            loss_module.unscale_loss_for_distribution(loss), sample_weight=size
        )
        metrics = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return grads, metrics

    def _compute_gradients(self, x, y, sample_weight, share):
        """Forward, loss and gradients of one microbatch.

        The gradients are those of `share * loss`, the microbatch's part of
        the batch loss (the whole loss when `share` is None).
        """
        model = self.model
        mesh = self._mesh()
        sharded = mesh is not None and sharded_classifier(model)
        with tf.GradientTape() as tape, (
                sharded_logits() if sharded else contextlib.nullcontext()):
            if model._call_has_training_arg:
                y_pred = model(x, training=True)
            else:
                y_pred = model(x)
            loss = model._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            part = loss if share is None else loss * tf.cast(share, loss.dtype)
            scaled = model.optimizer.scale_loss(part)
        grads = _gradients(tape, scaled, model.trainable_weights)
        if sharded and model._compile_metrics is not None:
            y_pred = mesh.gather_last(y_pred)  # metrics see every class
        return loss, y_pred, grads

    def reduce_gradients(self, grads):
        """Phase 2: one batched all-reduce (sum) of every gradient across replicas
        (with `tensor` > 1: across the replicas of the same tensor rank)."""
        mesh = self._mesh()
        if mesh is not None:
            grads = mesh.reduce_gradients(grads)
            if isinstance(self.model.optimizer, keras.optimizers.LossScaleOptimizer):
                grads = mesh.share_non_finite(grads)  # the same skip everywhere
            return grads
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return grads
        present = [g for g in grads if g is not None]
        reduced = iter(context.all_reduce(tf.distribute.ReduceOp.SUM, present))
        return [None if g is None else next(reduced) for g in grads]

    def apply_gradients(self, grads):
        """Phase 3: the model's optimizer applies the already-reduced gradients."""
        model = self.model
        with gradients_already_reduced(model.optimizer):
            model.optimizer.apply_gradients(zip(grads, model.trainable_weights))


def check_trainable(model, config: ParallelConfig):
    """Errors that must stop `fit` before its first step, with what to do instead."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise ValueError(
            "The model has no optimizer: call `model.compile(optimizer=...)` "
            "before `model.fit`."
        )
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if inner.gradient_accumulation_steps:
        raise ValueError(
            f"`gradient_accumulation_steps={inner.gradient_accumulation_steps}` "
            f"on the Keras optimizer does not work under tf.distribute (its "
            f"conditional apply contains the gradient all-reduce). Use the "
            f"strategy's `microbatches={inner.gradient_accumulation_steps}` "
            f"instead: it accumulates the same gradients inside one step and "
            f"reduces them once."
        )
    if not model.trainable_weights:
        raise ValueError("The model has no trainable weights: nothing to train.")
    if config.zero:
        check_shardable(optimizer, config.zero)
    if config.tensor > 1:  # split weights are updated shard by shard
        check_shardable(optimizer, config.zero, mode=f"`tensor={config.tensor}`",
                        elementwise_only=True)
    policy = model.dtype_policy.name
    if policy != config.precision:
        raise ValueError(
            f"The model was built with dtype policy {policy!r} but the "
            f"strategy has `precision={config.precision!r}`: build the model "
            f"inside `strategy.scope()`, which sets the policy."
        )
    if config.precision == "mixed_float16" and not isinstance(
        optimizer, keras.optimizers.LossScaleOptimizer
    ):
        raise ValueError(
            "`precision='mixed_float16'` needs loss scaling, but the model's "
            f"optimizer is a {type(optimizer).__name__}: compile with "
            "`auto_scale_loss=True` (the default) or wrap the optimizer in "
            "`keras.optimizers.LossScaleOptimizer`."
        )


def check_microbatches_divide(per_replica_batch, microbatches, num_replicas):
    """A batch size known before the step must split into equal microbatches.

    Batches whose size is only known at run time (such as a last, partial
    batch) are split as evenly as possible and weighted exactly instead.
    """
    if per_replica_batch is not None and per_replica_batch % microbatches:
        raise ValueError(
            f"`microbatches={microbatches}` must divide the per-replica batch "
            f"size, which is {per_replica_batch}: use a divisor of "
            f"{per_replica_batch} or a global batch size divisible by "
            f"{microbatches * num_replicas}."
        )


def check_loss_reductions(model, microbatches: int):
    """Microbatching is exact for batch-mean losses; anything else is refused."""
    compile_loss = getattr(model, "_compile_loss", None)
    for entry in getattr(compile_loss, "_flat_losses", None) or []:
        reduction = getattr(entry.loss, "reduction", "sum_over_batch_size")
        if reduction not in _MEAN_REDUCTIONS:
            raise ValueError(
                f"`microbatches={microbatches}` needs losses that average over "
                f"the batch (reduction in {_MEAN_REDUCTIONS}), but loss "
                f"{entry.name or entry.loss!r} has reduction={reduction!r}. Use "
                f"a mean reduction, or microbatches=1."
            )


def _gradients(tape, target, variables):
    """`tape.gradient` for Keras variables, some maybe partitioned.

    A variable a parameter-server strategy partitioned (a `ShardedVariable`)
    is differentiated through its shards; its gradient is their concatenation,
    for the optimizer to apply to the whole variable.
    """
    sources = [getattr(v.value, "variables", None) or v for v in variables]
    grads = tape.gradient(target, sources)
    return [
        tf.concat([tf.convert_to_tensor(g) for g in grad], axis=0)
        if isinstance(source, list) and grad[0] is not None else
        (None if isinstance(source, list) else grad)
        for source, grad in zip(sources, grads)
    ]


def _microbatch_slice(x, y, sample_weight, i, k, batch_size):
    """Microbatch i of k: (x, y, sample_weight, share of the batch, size);
    with k == 1 the batch itself, share None."""
    if k == 1:
        return x, y, sample_weight, None, batch_size
    start = (i * batch_size) // k
    stop = ((i + 1) * batch_size) // k
    x_i, y_i, sw_i = tree.map_structure(
        lambda t: None if t is None else t[start:stop], (x, y, sample_weight))
    share = tf.cast(stop - start, tf.float32) / tf.maximum(
        tf.cast(batch_size, tf.float32), 1.0)
    return x_i, y_i, sw_i, share, stop - start


def _batch_size(x):
    first = next(t for t in tree.flatten(x) if t is not None)
    return tf.shape(first, out_type=tf.int32)[0]


def _tensors(grads):
    """The tensors of a gradient list (None and IndexedSlices handled)."""
    return tf.nest.flatten([g for g in grads or [] if g is not None],
                           expand_composites=True)


def _add(total, grads):
    def add(a, b):
        if a is None:
            return b
        if b is None:
            return a
        return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)

    return [add(a, b) for a, b in zip(total, grads)]


_reduced_lock = threading.Lock()
_reduced_depth = {}


@contextlib.contextmanager
def gradients_already_reduced(optimizer):
    """Turns off a Keras optimizer's own gradient all-reduce while in effect.

    Keras's TensorFlow optimizer sums gradients across replicas in
    `_all_reduce_sum_gradients` before applying them. tfdist reduces them
    itself (once per step, and differently under ZeRO), so for the apply call
    it makes that method the identity on the optimizer that applies (for a
    `LossScaleOptimizer`, its inner optimizer). Replica threads of one step
    enter this together, so the change is reference-counted.

    Example:

    ```python
    with gradients_already_reduced(model.optimizer):
        model.optimizer.apply_gradients(zip(reduced, model.trainable_weights))
    ```
    """
    target = getattr(optimizer, "inner_optimizer", optimizer)
    key = id(target)
    with _reduced_lock:
        depth = _reduced_depth.get(key, 0)
        if depth == 0:
            target._all_reduce_sum_gradients = list
        _reduced_depth[key] = depth + 1
    try:
        yield
    finally:
        with _reduced_lock:
            _reduced_depth[key] -= 1
            if _reduced_depth[key] == 0:
                del _reduced_depth[key]
                del target._all_reduce_sum_gradients
