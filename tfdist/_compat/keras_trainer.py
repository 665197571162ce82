"""Keras trainer internals: the compiled loss and metrics, building, the train step.

Keras 3's `Trainer` keeps what `compile` set up (the loss container, its loss
tracker, the compiled metrics) and the step machinery of its TensorFlow
backend (`TensorFlowTrainer`) in private attributes; tfdist's step computes
the same loss and updates the same trackers as Keras's.
"""

import keras
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
from keras.src.utils.python_utils import pythonify_logs


def uses_keras_train_step(model) -> bool:
    """Whether `model`'s class runs Keras's own `train_step` (does not override it).

    Example:

    ```python
    uses_keras_train_step(keras.Sequential([keras.layers.Dense(1)]))   # True
    ```
    """
    return type(model).train_step is TensorFlowTrainer.train_step


def python_logs(logs):
    """`logs` with every tensor value made a Python number, as Keras gives
    them to callbacks (Keras's `pythonify_logs`).

    Example:

    ```python
    python_logs({"loss": tf.constant(0.5)})   # {'loss': 0.5}
    ```
    """
    return pythonify_logs(logs)


def compiled_losses(model):
    """The compiled loss entries of `model` (its loss container's
    `_flat_losses`, named tuples with a `loss`), or None before `compile`
    builds them. The list itself: an entry may be replaced in place.

    Example:

    ```python
    [entry.loss for entry in compiled_losses(model) or []]
    ```
    """
    return getattr(getattr(model, "_compile_loss", None), "_flat_losses", None)


def compute_loss(model, **kwargs):
    """Keras's training loss of a batch: the compiled loss plus `model.losses`,
    scaled for distribution (the model's `_compute_loss`, which honours an
    overridden `compute_loss`).

    Example:

    ```python
    loss = compute_loss(model, x=x, y=y, y_pred=y_pred, sample_weight=None,
                        training=True)
    ```
    """
    return model._compute_loss(**kwargs)


def loss_tracker(model):
    """The `Mean` metric Keras's `fit` reports as "loss" (`_loss_tracker`).

    Example:

    ```python
    float(loss_tracker(model).count)   # examples seen this epoch
    ```
    """
    return model._loss_tracker


def has_compiled_metrics(model) -> bool:
    """Whether `compile` was given metrics (`_compile_metrics`' user metrics,
    empty lists not counted).

    Example:

    ```python
    has_compiled_metrics(model)   # True after compile(metrics=["accuracy"])
    ```
    """
    metrics = model._compile_metrics
    given = [] if metrics is None else [metrics._user_metrics, metrics._user_weighted_metrics]
    return any(m is not None for m in keras.tree.flatten(given))


def call_has_training_arg(model) -> bool:
    """Whether `model.call` takes a `training` argument (Keras's
    `_call_has_training_arg`; a tf_keras model takes it in any case).

    Example:

    ```python
    y = model(x, training=True) if call_has_training_arg(model) else model(x)
    ```
    """
    return getattr(model, "_call_has_training_arg", True)


def symbolic_build(model, data):
    """Builds `model`, its compiled loss and metrics and its optimizer from
    one batch spec, without running a step (Keras's `_symbolic_build`).

    Example:

    ```python
    symbolic_build(model, dataset.element_spec)
    ```
    """
    model._symbolic_build(data_batch=data)


def dataset_of(iterator):
    """The `tf.data.Dataset` a TensorFlow iterator reads, or None.

    Example:

    ```python
    dataset_of(iter(tf.data.Dataset.range(3)))   # the range dataset
    ```
    """
    return getattr(iterator, "_dataset", None)


def epoch_input(iterator):
    """(the dataset this task reads, its number of batches or None if not
    known) for the epoch iterator Keras's `fit` or `evaluate` made of its
    input (a `TFEpochIterator`), when that input went through
    `experimental_distribute_dataset`; else (None, None).

    The dataset is the task's own after distribution (auto-sharded across
    workers, each batch split for the replicas): its element spec is one
    replica's batch, and reading it with a plain iterator reads what this
    task's replicas would.

    Example:

    ```python
    dataset, batches = epoch_input(epoch_iterator)   # (<_RebatchDataset ...>, 20)
    ```
    """
    distributed = getattr(iterator, "_distributed_dataset", None)
    local = getattr(distributed, "_cloned_datasets", None)
    if not local:
        return None, None
    return local[0], iterator.data_adapter.num_batches


def is_validation_iterator(model, iterator) -> bool:
    """Whether `iterator` is the epoch iterator `fit` made of its
    `validation_data` (Keras's `_eval_epoch_iterator`).

    Example:

    ```python
    is_validation_iterator(model, iterator)   # False outside `fit`'s validation
    ```
    """
    return iterator is not None and iterator is getattr(model, "_eval_epoch_iterator", None)


def predicted_no_batch(error) -> bool:
    """Whether `error`, raised by Keras's `predict`, says it read no batch:
    its loop never ran, which leaves its `batch_outputs` unassigned.

    Example:

    ```python
    try:
        model.predict(x)
    except UnboundLocalError as error:
        predicted_no_batch(error)   # True when `x` has no examples
    ```
    """
    return isinstance(error, UnboundLocalError) and "batch_outputs" in str(error)


def resume_at_epoch(model, epoch: int):
    """Makes `model`'s running `fit` start at `epoch` (0-based), as Keras's
    `BackupAndRestore` does after restoring a backup (`model._initial_epoch`).

    Example:

    ```python
    resume_at_epoch(model, 3)   # called in on_train_begin: fit goes on from epoch 4
    ```
    """
    model._initial_epoch = epoch
