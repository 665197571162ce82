"""`Profiler`: a TensorFlow profiler trace of a range of `model.fit` steps."""

import glob
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
import warnings

import keras
import tensorflow as tf

from tfdist.cluster.tf_config import read_tf_config
from tfdist.trace_phases import add_phases

TASKS = ("chief", "all")


class Profiler(keras.callbacks.Callback):
    """Records a profiler trace of steps `[start, stop)` of `model.fit`.

    The trace is written where TensorBoard's profile plugin finds it:
    `logdir/plugins/profile/<run>/<host>.xplane.pb`. In a multi-worker job each
    selected task writes its own host file (named after its task, e.g.
    `worker-1`) into the same run, so TensorBoard shows all hosts together; the
    run is named after the step range and the job's cluster, which every task
    of one job shares. Each profiled step is a `tfdist/step` range (with its
    step number) in the trace, and the ops of tfdist's step are named after its
    phases (`tfdist/microbatch{i}/...`, `tfdist/reduce/...`, `tfdist/apply/...`),
    each of which gets a row of its own at the top of the host's timeline,
    `tfdist/<phase>` (see `tfdist.trace_phases`): search `tfdist/reduce` in
    TensorBoard's trace viewer to find every step's reduce.

    Steps are counted from the start of `fit`, across epochs. A range that the
    run does not reach is reported with a warning when training ends.

    Args:
        logdir: the TensorBoard log directory (created if missing).
        steps: `(start, stop)`, ints with `0 <= start < stop`.
        tasks: "chief" (the chief, or worker 0 without one, or the only
            process) or "all" tasks of a multi-worker job. On TensorFlow 2.20,
            stopping a trace in a task other than the chief can abort it (a
            TensorFlow bug, see the README's limits): keep a BackupAndRestore.
        run_name: the run's name; default: from the step range and the job's
            cluster, or the start time for a single process.

    Example:

    ```python
    model.fit(dataset, epochs=3,
              callbacks=[tfdist.callbacks.Profiler("logs", steps=(20, 25))])
    # then: tensorboard --logdir logs   (Profile tab)
    ```
    """

    def __init__(self, logdir, steps, tasks="chief", run_name=None):
        super().__init__()
        if (not isinstance(steps, (tuple, list)) or len(steps) != 2
                or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps)):
            raise TypeError(f"`steps` must be a pair of ints (start, stop), got {steps!r}.")
        start, stop = steps
        if start < 0 or stop <= start:
            raise ValueError(
                f"`steps` must satisfy 0 <= start < stop, got start={start}, stop={stop}.")
        if tasks not in TASKS:
            raise ValueError(f"`tasks` must be one of {TASKS}, got {tasks!r}.")
        self.logdir = _writable_dir(logdir)
        self.start, self.stop = start, stop
        self.tasks = tasks
        self.task = read_tf_config()
        self.run_name = run_name or _run_name(self.task, start, stop)
        self.trace_path = None  # the host file written, once the range is done
        self._step = 0
        self._session_dir = None
        self._step_trace = None

    @property
    def selected(self) -> bool:
        """Whether this task records a trace."""
        if self.tasks == "all" or self.task is None:
            return True
        head = "chief" if "chief" in self.task.cluster else "worker"
        return self.task.task == f"{head}:0"

    def on_train_begin(self, logs=None):
        self._step = 0

    def on_train_batch_begin(self, batch, logs=None):
        if self._step == self.start and self.selected:
            self._session_dir = tempfile.mkdtemp(prefix=".tfdist-profile-", dir=self.logdir)
            tf.profiler.experimental.start(self._session_dir)
        if self._session_dir is not None:
            self._step_trace = tf.profiler.experimental.Trace(
                "tfdist/step", step_num=self._step, _r=1)
            self._step_trace.__enter__()

    def on_train_batch_end(self, batch, logs=None):
        if self._step_trace is not None:
            self._step_trace.__exit__(None, None, None)
            self._step_trace = None
        self._step += 1
        if self._step == self.stop and self._session_dir is not None:
            self._finish()

    def on_train_end(self, logs=None):
        if self._session_dir is not None:
            self._finish()
            warnings.warn(
                f"Profiler: training ended after {self._step} steps, inside the "
                f"range steps=({self.start}, {self.stop}); the trace holds steps "
                f"{self.start} to {self._step - 1}.", stacklevel=2)
        elif self.trace_path is None and self.selected:
            warnings.warn(
                f"Profiler: steps=({self.start}, {self.stop}) is beyond this run's "
                f"{self._step} steps: no trace was written.", stacklevel=2)

    def _finish(self):
        tf.profiler.experimental.stop()
        (written,) = glob.glob(os.path.join(
            self._session_dir, "plugins", "profile", "*", "*.xplane.pb"))
        run_dir = os.path.join(self.logdir, "plugins", "profile", self.run_name)
        os.makedirs(run_dir, exist_ok=True)
        host = self.task.task.replace(":", "-") if self.task else socket.gethostname()
        self.trace_path = os.path.join(run_dir, f"{host}.xplane.pb")
        shutil.move(written, self.trace_path)
        add_phases(self.trace_path)
        shutil.rmtree(self._session_dir)
        self._session_dir = None


def _writable_dir(logdir):
    path = os.fspath(logdir)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise ValueError(
            f"`logdir` {path!r} is not a writable directory: {error}.") from error
    return path


def _run_name(task, start, stop):
    if task is None:
        return time.strftime("%Y_%m_%d_%H_%M_%S")
    cluster = json.dumps(task.cluster, sort_keys=True).encode()
    return f"steps_{start}-{stop}_{hashlib.sha1(cluster).hexdigest()[:8]}"
