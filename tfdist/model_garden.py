"""tfdist's step inside the TensorFlow Model Garden's own trainer (`official.core`).

`official.core.base_trainer.Trainer` runs its task's `train_step` (a
GradientTape step of the task's own) in `strategy.run`, so under a tfdist
strategy it would train as plain data parallelism, which the strategy refuses
when its config asks for more. `Trainer` is that trainer with tfdist's step in
its place: the task's loss (the model's compiled loss and `model.losses`
plus `Task.build_losses`, as `Task.train_step` computes it), its metrics
(`Task.process_metrics`, the compiled metrics, the trainer's training loss),
the trainer's optimizer (a tf_keras `LossScaleOptimizer` too), and the
strategy's `microbatches`, `precision`, `xla` and `zero` 1/2 (with a
v2.11+ tf_keras optimizer: in the task's optimizer config, type
'sgd_experimental', 'adam_experimental' or 'adamw_experimental').
`pipeline`, `tensor` and `zero=3` are refused (tf_keras models:
`tfdist.engine.modes`).

The Model Garden is an optional dependency of tfdist: `pip install
'tfdist[model-garden]'` (tf-models-official, which also brings `orbit`).

Example:

```python
from tfdist.model_garden import Trainer

with strategy.scope():                   # tfdist.Strategy(data=2, microbatches=2)
    model = task.build_model()
    optimizer = task.create_optimizer(config.trainer.optimizer_config, config.runtime)
    trainer = Trainer(config, task, model, optimizer, evaluate=False)
orbit.Controller(trainer=trainer, strategy=strategy, global_step=trainer.global_step,
                 steps_per_loop=100).train(steps=1000)
# or: official.core.train_lib.run_experiment(..., trainer=trainer)
```
"""

import tensorflow as tf

try:
    from official.core import base_trainer
except ImportError as missing:
    raise ImportError(
        "tfdist.model_garden needs the TensorFlow Model Garden (`official.core`), which "
        "tfdist leaves optional: pip install 'tfdist[model-garden]' (or "
        f"tf-models-official~=2.20.0). The import failed with: {missing}") from missing

from tfdist.engine import modes
from tfdist.engine.step import TrainStep
from tfdist.engine.tf_keras import TfKerasLoss


class TaskLoss(TfKerasLoss):
    """A Model Garden task's training loss on one microbatch, and its metrics
    (the interface of `tfdist.engine.microbatch.MicrobatchLoss`).

    Args:
        task: the `official.core.base_task.Task`.
        model: its tf_keras model.
        optimizer: the trainer's optimizer (its loss scale applies).
        metrics: the trainer's training metrics.
        train_loss: the trainer's `Mean` of the training loss.

    Example:

    ```python
    loss_of = TaskLoss(task, model, optimizer, trainer.train_metrics, trainer.train_loss)
    ```
    """

    def __init__(self, task, model, optimizer, metrics, train_loss):
        super().__init__(model, optimizer)
        self.task, self.metrics, self.train_loss = task, metrics, train_loss

    def loss(self, microbatch, y_pred):
        """`Task.train_step`'s loss, divided by the replicas as it does."""
        labels = _labels(microbatch)
        if self.model.compiled_loss:
            loss = self.model.compiled_loss(labels, y_pred,
                                            regularization_losses=self.model.losses)
            loss += self.task.build_losses(labels=labels, model_outputs=y_pred,
                                           aux_losses=None)
        else:
            loss = self.task.build_losses(labels=labels, model_outputs=y_pred,
                                          aux_losses=self.model.losses)
        return loss / tf.distribute.get_replica_context().num_replicas_in_sync

    def record(self, microbatch, loss, y_pred):
        """Updates the trainer's training loss (weighted by the microbatch's
        rows) and metrics; returns the metrics' results."""
        labels = _labels(microbatch)
        replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        self.train_loss.update_state(loss * replicas,
                                     sample_weight=tf.cast(microbatch.size, tf.float32))
        self.task.process_metrics(self.metrics, labels, y_pred)
        if self.model.compiled_metrics:
            self.task.process_compiled_metrics(self.model.compiled_metrics, labels, y_pred)
        return {metric.name: metric.result() for metric in self.metrics}


def _labels(microbatch):
    """`Task.train_step`'s labels: the second of (features, labels), or the
    whole input when it is not such a pair."""
    return microbatch.x if microbatch.y is None else microbatch.y


class Trainer(base_trainer.Trainer):
    """`official.core.base_trainer.Trainer` whose training step is tfdist's.

    Takes the same arguments; build it inside the tfdist strategy's scope.
    With `train=True` it checks the model against the strategy's config when
    it is built (`pipeline`, `tensor` refused for tf_keras models).

    Example:

    ```python
    with strategy.scope():
        trainer = tfdist.model_garden.Trainer(config, task, model, optimizer)
    ```
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._step = self._tfdist_step() if hasattr(self, "_train_metrics") else None

    def train_step(self, iterator):
        """One step of tfdist's step on every replica; advances `global_step`."""
        inputs = self.next_train_inputs(iterator)
        self.strategy.run(self._step, args=(inputs,), options=self._runtime_options)
        self.global_step.assign_add(1)

    def _tfdist_step(self):
        """The step, after checking the model and the strategy (before training)."""
        config = getattr(self.strategy, "config", None)
        if config is None:
            raise ValueError(
                f"tfdist.model_garden.Trainer runs tfdist's step, but its strategy is a "
                f"{type(self.strategy).__name__}: build the trainer inside a tfdist "
                f"strategy's scope (tfdist.Strategy, tfdist.MultiWorkerStrategy), or use "
                f"official.core.base_trainer.Trainer.")
        modes.check(self.model, config, self.optimizer)
        loss = TaskLoss(self.task, self.model, self.optimizer, self.train_metrics,
                        self.train_loss)
        return TrainStep(self.model, config,
                         parts=modes.assemble(self.model, config, loss=loss,
                                              optimizer=self.optimizer))
