"""How Keras 3's `model.fit` runs under tfdist's `ParameterServerStrategy`.

Keras 3's TensorFlow trainer calls its step functions where it runs; under a
parameter-server strategy a training step must instead be *scheduled* on a
worker. `install()` wraps five methods of Keras's `TensorFlowTrainer`; for a
model whose strategy is a tfdist `ParameterServerStrategy` (and only then):

- `fit` first refuses, before any step, input that workers cannot rebuild
  and data of unknown size without `steps_per_epoch`, and takes a dataset
  function (`fn(input_context) -> tf.data.Dataset`) run on each worker;
- `make_train_function` makes each call of the train function schedule
  `steps_per_execution` steps, as one function, on the next free worker; it
  returns the logs of a step that finished earlier instead of waiting;
- `_get_metrics_result_or_logs` (end of an epoch, of `evaluate`) first waits
  for every scheduled step, so epoch metrics are exact;
- every wait of the chief for steps raises `TaskUnresponsiveError` naming a
  task that froze meanwhile (the strategy's `task_monitor` probes the
  tasks during `fit`; a dead task TensorFlow reports itself);
- `make_test_function` / `make_predict_function` run Keras's own functions on
  the chief (the variables are read from the ps tasks).

The optimizer's step counter and the metrics' accumulators are also made to
add atomically on the ps tasks (Keras's `Variable.assign_add` reads, adds and
writes back, losing concurrent updates), so step counts are exact.
"""

import collections
import contextlib
import functools
import inspect
import time
import types

import keras
import tensorflow as tf
from absl import logging

from tfdist._compat import keras_trainer, patches
from tfdist._compat.tf_parameter_server import (
    is_ps_failure,
    is_worker_failure,
    running_without_coordinator,
    wait_for_result,
)
from tfdist._compat.tf_variables import storage_of
from tfdist.cluster.liveness import probe
from tfdist.ps.ledger import StepLedger

# Steps in flight per worker before a train-function call waits for the oldest
# (bounds how stale the per-step logs are; enough to keep every worker busy).
_IN_FLIGHT_PER_WORKER = 4
# How often the chief's waits for steps look whether a task has frozen.
_POLL_SECONDS = 0.5
# How long a probe of a ps task waits, after an error, to tell if it is down.
_PROBE_SECONDS = 2.0


def install(strategy_class):
    """Wraps Keras's trainer methods for the models of a `strategy_class`
    (tfdist's `ParameterServerStrategy`), once.

    Example:

    ```python
    install(ParameterServerStrategy)   # ParameterServerStrategy() does it
    ```
    """
    for patch, ps_version in (
        (patches.TRAINER_FIT, _fit),
        (patches.TRAINER_MAKE_TRAIN_FUNCTION, _make_train_function),
        (patches.TRAINER_MAKE_TEST_FUNCTION, _on_chief("test_function")),
        (patches.TRAINER_MAKE_PREDICT_FUNCTION, _on_chief("predict_function")),
        (patches.TRAINER_METRICS_RESULT, _metrics_after_join),
    ):
        patches.install_for_strategy(patch, strategy_class, ps_version)


def _fit(original, model, strategy, *args, **kwargs):
    call = inspect.signature(original).bind(model, *args, **kwargs)
    x = call.arguments.get("x")
    if callable(x) and not isinstance(x, tf.data.Dataset):  # a dataset function
        if call.arguments.get("steps_per_epoch") is None:
            raise ValueError(
                "`steps_per_epoch` is required when `fit` gets a dataset function "
                "under ParameterServerStrategy: each worker builds its own dataset.")
        call.arguments["x"] = strategy.dataset_from_function(x)
    check_fit_input(call.arguments.get("x"), call.arguments.get("steps_per_epoch"),
                    model.steps_per_execution)
    with strategy.task_monitor:
        history = original(*call.args, **call.kwargs)
        join(strategy)
    return history


def join(strategy):
    """`strategy.coordinator.join()`, which also raises `TaskUnresponsiveError`
    if a task freezes meanwhile (the coordinator would wait for it forever).

    Example:

    ```python
    join(strategy)   # every scheduled step has run
    ```
    """
    while not strategy.coordinator.done():
        strategy.task_monitor.check()
        time.sleep(_POLL_SECONDS)


def _fetch(remote_value, strategy):
    """`remote_value.fetch()`, raising `TaskUnresponsiveError` if a task
    freezes meanwhile, and the error that made the coordinator cancel it if
    it was cancelled; None if the worker that computed it died before the
    chief copied it (its steps were applied on the ps tasks: only their logs
    are lost with the worker)."""
    while not wait_for_result(remote_value, _POLL_SECONDS):
        strategy.task_monitor.check()
    try:
        return remote_value.fetch()
    except tf.errors.CancelledError:
        # The coordinator cancels the pending steps when one fails for a
        # reason it does not retry (a lost ps): that failure, the cause, is
        # what `done` raises.
        strategy.coordinator.done()
        raise
    except tf.errors.OpError as error:
        if is_worker_failure(error):
            logging.warning("A worker died holding the logs of steps it had applied; "
                            "fit goes on with the previous logs (%s).", _first_line(error))
            return None
        raise


def _first_line(error):
    """The first line of `error`'s message, or its type's name if it has none."""
    return (str(error).strip() or type(error).__name__).splitlines()[0]


def check_fit_input(x, steps_per_epoch, steps_per_execution=1):
    """Input a parameter-server `fit` cannot use, refused before any step.

    Example:

    >>> check_fit_input(tf.data.Dataset.range(4).repeat(), steps_per_epoch=None)
    Traceback (most recent call last):
    ...
    ValueError: ...
    """
    if isinstance(x, (types.GeneratorType, keras.utils.PyDataset)):
        raise ValueError(
            f"Under ParameterServerStrategy, `fit` needs `x` as arrays or a "
            f"tf.data.Dataset, which each worker rebuilds; got a "
            f"{type(x).__name__}. Convert it with tf.data.Dataset.from_tensor_slices "
            f"or write it as a tf.data pipeline."
        )
    if isinstance(x, tf.data.Dataset) and steps_per_epoch is None:
        size = int(x.cardinality())
        if size < 0:
            kind = "infinite" if size == tf.data.INFINITE_CARDINALITY else "unknown"
            raise ValueError(
                f"`steps_per_epoch` is required under ParameterServerStrategy when "
                f"the dataset's size is {kind}: workers read repeated copies of "
                f"the data, so only the step count can end an epoch."
            )
    if steps_per_execution > 1 and (steps_per_epoch or 1) % steps_per_execution:
        raise ValueError(
            f"`steps_per_execution={steps_per_execution}` needs `steps_per_epoch` set "
            f"to a multiple of it (got {steps_per_epoch}) under "
            f"ParameterServerStrategy: each worker "
            f"call runs that many steps from its repeated copy of the data, so "
            f"an epoch must be a whole number of calls."
        )


def _make_train_function(original, model, strategy, force=False):
    if model.train_function is not None and not force:
        return model.train_function
    make_counters_atomic(model)
    model.train_function = ScheduledTrainFunction(model, strategy)
    return model.train_function


class ScheduledTrainFunction:
    """Keras's train function under a parameter-server strategy.

    Called by `fit` with the chief's iterator over the training data; it
    schedules `steps_per_execution` steps on a worker, each worker reading its
    own repeated copy of that dataset, and returns the logs of the oldest step
    still in flight once more than a few per worker are (the first calls of an
    epoch may return the previous logs).
    """

    def __init__(self, model, strategy):
        self._strategy = strategy
        self._ps_tasks = _ps_tasks(strategy)
        self._pending = collections.deque()
        self._latest = {}
        self._depth = _IN_FLIGHT_PER_WORKER * strategy.num_workers
        self._scheduled = 0
        steps = self._steps = model.steps_per_execution
        if keras_trainer.uses_keras_train_step(model):
            step = strategy.train_step(model)
            step.prepare()  # its parts, before the step functions are traced
            ledger = StepLedger(strategy, colocate_with=model.optimizer.iterations.value)

            def one_step(iterator, step_id):
                grads, metrics = strategy.run(step.gradients, args=(next(iterator),))
                ledger.apply_once(
                    step_id, lambda: strategy.run(step.apply_gradients, args=(grads,)))
                return metrics
        else:  # the model's own train_step: applied at least once
            def one_step(iterator, step_id):
                return strategy.run(model.train_step, args=(next(iterator),))

        @tf.function
        def worker_steps(iterator, first_id):
            outputs = one_step(iterator, first_id)
            for i in tf.range(1, steps, dtype=tf.int64):
                outputs = one_step(iterator, first_id + i)
            return outputs

        self._worker_steps = worker_steps

    def __call__(self, iterator):
        dataset = keras_trainer.dataset_of(iterator)
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(
                f"The train function of a ParameterServerStrategy model takes an "
                f"iterator over a tf.data.Dataset, got {type(iterator).__name__}."
            )
        per_worker = self._strategy.per_worker_iterator(dataset)
        first_id = tf.constant(self._scheduled, tf.int64)
        self._scheduled += self._steps
        self._pending.append(
            self._strategy.coordinator.schedule(self._worker_steps, args=(per_worker, first_id))
        )
        with _ps_failure_explained(self._ps_tasks):
            while len(self._pending) > self._depth:
                self._take_oldest()
        return self._latest

    def flush(self):
        """Waits for every scheduled step; returns the newest step's logs."""
        with _ps_failure_explained(self._ps_tasks):
            join(self._strategy)
            while self._pending:
                self._take_oldest()
        return self._latest

    def _take_oldest(self):
        """The oldest scheduled call's logs become the latest (kept as they
        were if they died with their worker)."""
        logs = _fetch(self._pending.popleft(), self._strategy)
        if logs is not None:
            self._latest = keras_trainer.python_logs(logs)


@contextlib.contextmanager
def _ps_failure_explained(ps_tasks):
    """The coordinator retries steps of failed workers itself; what reaches
    the chief as "unavailable", as a ps failure by TensorFlow's own
    reckoning (a ps restarted on its address before the coordinator noticed),
    or as any error while a ps task of `ps_tasks` (name -> "host:port") is
    down (the coordinator may first see a worker's step cancelled by the
    loss, or its input ended), is a lost parameter server."""
    try:
        yield
    except Exception as e:  # the coordinator also wraps errors (ClosureInputError)
        known = isinstance(e, tf.errors.UnavailableError) or is_ps_failure(e)
        down = [] if known else [f"{name} at {address} is down"
                                 for name, address in ps_tasks.items()
                                 if probe(address, timeout=_PROBE_SECONDS) == "down"]
        if not (known or down):
            raise
        detail = "; ".join(down) or _first_line(e)
        raise RuntimeError(
            f"A parameter server task became unreachable during fit ({detail}). "
            f"The variables it held are lost: restart the job; with "
            f"keras.callbacks.BackupAndRestore, fit resumes from the last "
            f"completed epoch."
        ) from e


def _ps_tasks(strategy):
    """The strategy's ps tasks: name -> "host:port"."""
    return {name: address for name, address in strategy.task_monitor.tasks.items()
            if name.startswith("ps:")}


def _metrics_after_join(original, model, strategy, logs):
    if isinstance(model.train_function, ScheduledTrainFunction):
        logs = model.train_function.flush() or logs
    return original(model, logs)


def _on_chief(attribute):
    """Keras's own test or predict function, allowed to run on the chief."""

    def make(original, model, strategy, force=False):
        return patches.wrap_made_function(original, model, force, attribute,
                                          _ChiefFunction, strategy)

    return make


class _ChiefFunction:
    """Runs a Keras step function on the chief, on purpose (no scheduling)."""

    def __init__(self, function, strategy):
        self._function = function
        self._extended = strategy.extended

    def __call__(self, *args):
        with running_without_coordinator(self._extended):
            return self._function(*args)


def make_counters_atomic(model):
    """Makes the optimizer's step counter and the metrics add atomically.

    Keras's `Variable.assign_add` is `assign(self + value)`: two workers
    adding at once lose one addition. Here these variables add with
    TensorFlow's own `assign_add`, one atomic operation on the ps task.

    Example:

    ```python
    make_counters_atomic(model)   # ScheduledTrainFunction does this
    ```
    """
    optimizer = model.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    counters = [inner.iterations]
    if inner is not optimizer:  # a LossScaleOptimizer's own counter
        counters.append(optimizer.step_counter)
    for metric in model.metrics:
        counters.extend(metric.variables)
    for variable in counters:
        variable.assign_add = functools.partial(_atomic_update, variable, "assign_add")
        variable.assign_sub = functools.partial(_atomic_update, variable, "assign_sub")


def _atomic_update(variable, method, value):
    tf_variable = storage_of(variable)
    getattr(tf_variable, method)(tf.cast(value, tf_variable.dtype))
    return variable
