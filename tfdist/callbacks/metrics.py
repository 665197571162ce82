"""`Metrics`: TensorBoard scalars of what a tfdist strategy is doing."""

import collections
import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf

from tfdist._compat.keras_trainer import loss_tracker
from tfdist.cluster.tf_config import read_tf_config


class Metrics(keras.callbacks.Callback):
    """Writes tfdist's training scalars to TensorBoard every `every_n_steps` steps
    and at the end of every epoch (as Keras's `TensorBoard` callback does), so a
    short run still gets its throughput.

    Scalars (tags under `tfdist/`):

    - `examples_per_second` and `examples_per_second_per_replica`: examples
      trained since the last write (counted exactly, partial batches included:
      the loss tracker's example count) over wall time;
    - `step_time_seconds`: the mean step time since the last write;
    - `peak_memory_bytes`: this task's peak resident memory so far (the
      process's VmHWM: what a memory limit is checked against);
    - `loss_scale`: the dynamic loss scale, under `mixed_float16`;
    - `microbatches`: the strategy's microbatches per step;
    - `optimizer_state_bytes/<device>`: the bytes of optimizer state (slots,
      iteration counter, ...) each device holds, summed over every physical
      component of every optimizer variable (measured after the first step).

    The last two are constants, written at every write (a line in TensorBoard,
    not a lone point).

    Each task of a multi-worker job writes its own run, `tfdist-<task>`
    (`tfdist` for a single process), under `logdir`.

    Args:
        logdir: the TensorBoard log directory.
        every_n_steps: steps between writes, an int >= 1.

    Example:

    ```python
    model.fit(dataset, epochs=3,
              callbacks=[tfdist.callbacks.Metrics("logs", every_n_steps=50)])
    ```
    """

    def __init__(self, logdir, every_n_steps=100):
        super().__init__()
        if (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
                or every_n_steps < 1):
            raise ValueError(
                f"`every_n_steps` must be an int >= 1, got {every_n_steps!r}.")
        task = read_tf_config()
        run = "tfdist" if task is None else f"tfdist-{task.task.replace(':', '-')}"
        self.logdir = os.path.join(os.fspath(logdir), run)
        self.every_n_steps = every_n_steps
        self._writer = None

    def on_train_begin(self, logs=None):
        self._writer = tf.summary.create_file_writer(self.logdir)
        self._done = 0  # steps completed
        self._earlier_epochs = 0.0  # examples of epochs whose count was reset
        self._epoch_examples = 0.0  # the count at the last epoch's end
        self._last = None  # (time, examples, steps done) at the last write

    # The work happens before a step, not after one: Keras 3 dispatches steps
    # asynchronously only while no callback has a batch-end hook, and a hook
    # that starts a step has no logs to wait for. Reading the example count
    # waits for the steps before it, and happens only every n steps.
    def on_train_batch_begin(self, batch, logs=None):
        if self._done == 1:  # the first step traces: measure from its end
            self._last = (time.perf_counter(), self._examples(), self._done)
            self._write_static()
        elif (self._done > 1 and self._done % self.every_n_steps == 0
              and self._last[2] != self._done):  # the epoch's end may have written it
            self._write_rates()
        self._done += 1

    def on_epoch_end(self, epoch, logs=None):
        self._epoch_examples = float(loss_tracker(self.model).count.numpy())
        if self._last is not None and self._last[2] != self._done:
            self._write_rates()

    def on_epoch_begin(self, epoch, logs=None):
        # Keras has just reset the loss tracker, whose count `_examples` reads.
        self._earlier_epochs += self._epoch_examples
        self._epoch_examples = 0.0

    def on_train_end(self, logs=None):
        if self._last is not None and self._last[2] != self._done:
            self._write_rates()
        if self._writer is not None:
            self._writer.close()

    def _examples(self):
        """Examples trained so far (summed over replicas by the tracker's read)."""
        return self._earlier_epochs + float(loss_tracker(self.model).count.numpy())

    def _write_static(self):
        """The strategy's constants, read once; written at every write so
        that TensorBoard draws them as lines."""
        strategy = self.model.distribute_strategy
        microbatches = getattr(getattr(strategy, "config", None), "microbatches", 1)
        self._static = {"tfdist/microbatches": microbatches}
        for device, size in optimizer_state_bytes(self.model.optimizer).items():
            self._static[f"tfdist/optimizer_state_bytes/{device}"] = size
        with self._writer.as_default(step=self._done):
            for tag, value in self._static.items():
                tf.summary.scalar(tag, value)

    def _write_rates(self):
        now, examples = time.perf_counter(), self._examples()
        last_time, last_examples, last_step = self._last
        seconds = now - last_time
        rate = (examples - last_examples) / seconds
        replicas = self.model.distribute_strategy.num_replicas_in_sync
        with self._writer.as_default(step=self._done):
            tf.summary.scalar("tfdist/examples_per_second", rate)
            tf.summary.scalar("tfdist/examples_per_second_per_replica", rate / replicas)
            tf.summary.scalar("tfdist/step_time_seconds", seconds / (self._done - last_step))
            scale = getattr(self.model.optimizer, "dynamic_scale", None)
            if scale is not None:
                tf.summary.scalar("tfdist/loss_scale", float(scale.numpy()))
            for tag, value in self._static.items():
                tf.summary.scalar(tag, value)
            peak = peak_memory_bytes()
            if peak is not None:
                tf.summary.scalar("tfdist/peak_memory_bytes", peak)
        self._writer.flush()
        self._last = (now, examples, self._done)


def peak_memory_bytes() -> int | None:
    """This process's peak resident memory so far (Linux's VmHWM), in bytes;
    None where the platform does not report it.

    Example:

    >>> peak_memory_bytes() > 0
    True
    """
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # (kilobytes on Linux)


def optimizer_state_bytes(optimizer) -> dict:
    """{device: bytes} of every physical component of the optimizer's
    variables (a Keras 3 or a tf_keras optimizer).

    Example:

    >>> with tfdist.Strategy(data=2, devices=["CPU:0", "CPU:1"]).scope():
    ...     optimizer = keras.optimizers.SGD(momentum=0.9)
    ...     optimizer.build([keras.Variable(np.zeros((10, 10), "float32"))])
    >>> optimizer_state_bytes(optimizer)  # momentum 400 + iterations 8 + learning rate 4
    {'CPU:0': 412, 'CPU:1': 412}
    """
    return variable_bytes(optimizer.variables)


def variable_bytes(variables) -> dict:
    """{device: bytes} of every physical component of `variables` (Keras or
    TensorFlow variables): a mirrored variable counts on each of its devices,
    a split or sharded one its part on each.

    Example:

    >>> strategy = tfdist.Strategy(data=2, devices=["CPU:0", "CPU:1"])
    >>> with strategy.scope():
    ...     weight = keras.Variable(np.zeros((10, 10), "float32"))
    >>> variable_bytes([weight])
    {'CPU:0': 400, 'CPU:1': 400}
    """
    sizes = collections.Counter()
    for variable in variables:
        value = variable.value if isinstance(variable, keras.Variable) else variable
        for component in getattr(value, "values", (value,)):
            device = tf.DeviceSpec.from_string(component.device)
            name = f"{device.device_type}:{device.device_index}"
            sizes[name] += int(np.prod(component.shape)) * component.dtype.size
    return dict(sizes)
