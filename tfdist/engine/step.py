"""`TrainStep`: the training step tfdist runs in place of Keras's `train_step`.

One call is one optimizer step on one replica (it runs in replica context,
inside `strategy.run`), made of three parts chosen once per model by
`tfdist.engine.modes.assemble` from the strategy's config:

    metrics = step(batch)  ==  update(reduce(compute(batch)))

1. **compute** (`tfdist.engine.compute`): the replica's batch in, its local
   gradients (summed over `microbatches`, each microbatch's loss weighted by its
   share of the batch) and the metric results out; on the replica's device, or
   through pipeline stages.
2. **reduce** (`tfdist.engine.reduce`): the gradients cross devices once per
   step: all-reduce, all-reduce over the data group, or ZeRO's
   reduce-scatter into shards; the metric states are summed over the global
   batch in the same collective where there is one (`tfdist.engine.metrics`).
3. **update** (`tfdist.engine.update`, `tfdist.optim.zero`): the model's own
   Keras optimizer applies them, or ZeRO's sharded update runs on the shards
   and the parameters are gathered.

Losses, metrics and sample weights behave as in Keras's `train_step`.

The parts' ops are named `tfdist/split/...` (the batch cut, its rows
counted), `tfdist/microbatch{i}/...` (or `tfdist/stage{s}/...` when
pipelined), `tfdist/metrics/...` (results over every replica),
`tfdist/reduce/...` and `tfdist/apply/...`, so a profiler trace shows which
part each op belongs to.
"""

import keras
import tensorflow as tf

from tfdist import batch_statistics
from tfdist._compat.keras_trainer import symbolic_build
from tfdist._compat.tf_function import eagerly_outside_the_trace
from tfdist.config import ParallelConfig
from tfdist.engine import build, modes, tf_keras
from tfdist.engine.metrics import local_states, synced_results


class TrainStep:
    """tfdist's per-replica training step for one compiled Keras model.

    Strategies build one per model the first time `model.fit` runs a step, and
    call it in replica context instead of `model.train_step`. It can also be
    called from a custom loop (such as an `orbit` trainer) inside
    `strategy.run`.

    Args:
        model: a compiled `keras.Model` (or tf_keras model:
            `tfdist.engine.tf_keras`) built under the strategy's scope.
        config: the strategy's `ParallelConfig`.
        parts: (compute, reduce, update) chosen by the caller, which has
            checked the model (`tfdist.model_garden.Trainer`); default: the
            model is checked and `modes.assemble` chooses them.

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

    def __init__(self, model: keras.Model, config: ParallelConfig, parts=None):
        if parts is None:
            build.check_model(model, config)
        self.model = model
        self.config = config
        self.compute, self.reduce, self.update = parts or (None, None, None)
        self.synced = frozenset()  # the names of the results every replica shares

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
            if tf_keras.is_tf_keras(self.model):
                tf_keras.build(self.model, data)
            else:
                symbolic_build(self.model, data)
        self.prepare()

    def prepare(self, data=None):
        """Chooses the step's parts and readies the state they keep, before
        the step is traced: pipeline stages placed on their devices, layers
        split over tensor groups, the optimizer's state moved into shards
        (values kept). Strategies call it when they run the step, with the
        first batch (`data`), whose shapes give the sequence length the
        pipeline stages are balanced for; it is idempotent.

        Example:

        ```python
        step = strategy.train_step(model)
        step.build(dataset.element_spec)   # builds, then prepares
        ```
        """
        if self.compute is None:
            batch_statistics.use_global_router_losses(self.model)
            with eagerly_outside_the_trace():  # when the first trace calls it: one trace
                self.compute, self.reduce, self.update = modes.assemble(
                    self.model, self.config, first_batch=data)

    def __call__(self, data):
        """Runs one step on this replica's batch; returns the metric results."""
        with tf.name_scope("tfdist"):  # one scope: the parts' ops are tfdist/<part>/...
            # (the compute may apply some updates itself: ZeRO-3's units)
            grads, metrics = self._gradients(data, self.update)
            self.update(grads)
        return metrics

    def gradients(self, data):
        """Compute and reduce alone: (reduced gradients, metric results).

        For callers that decide whether to apply them, such as the
        parameter-server mode, which skips re-runs of steps already applied.

        Example:

        ```python
        grads, metrics = strategy.run(step.gradients, args=(batch,))
        strategy.run(step.apply_gradients, args=(grads,))
        ```
        """
        with tf.name_scope("tfdist"):
            return self._gradients(data)

    def apply_gradients(self, grads):
        """The update part alone, on what `gradients` returned."""
        with tf.name_scope("tfdist"):
            self.update(grads)

    def _gradients(self, data, update=None):
        if self.compute is None:
            raise RuntimeError(
                "Run the step with the tfdist strategy's `run` (or call "
                "`TrainStep.prepare()` first): its parts are chosen, and their "
                "state readied, before the first step.")
        grads, results = self.compute(data, update)
        context = tf.distribute.get_replica_context()
        replicas = context.num_replicas_in_sync if context is not None else 1
        batch_statistics.warn_of_per_replica_losses(
            self.model, replicas // self.config.tensor, self.config.microbatches)
        with tf.name_scope("metrics") as metrics_scope:
            metrics, states = local_states(self.model)
        with tf.name_scope("reduce"):  # the metric states in the gradients' collective
            grads, summed = self.reduce.with_states(grads, states)
        with tf.name_scope(metrics_scope):  # the same scope again: tfdist/metrics/
            synced = synced_results(metrics, summed)
        self.synced = frozenset(synced)  # equal on every replica
        return grads, {**results, **synced}
