"""A deadline over each step of a multi-worker job, kept by one thread per process.

TensorFlow's own bound on a collective (`CommunicationOptions(timeout_seconds=)`)
costs a thread per collective op: each op schedules its timeout with
`Env::SchedClosureAfter`, a new thread that sleeps for the whole timeout. At a
few collectives a step, a job accumulates thousands of sleeping threads a
minute until the host has no process ids left. `MultiWorkerStrategy` therefore
runs its collectives without one, and bounds every wait on other tasks so:

- a task that dies or freezes: TensorFlow's coordination service, which
  `MultiWorkerMirroredStrategy` starts, misses its heartbeats and aborts the
  collectives of the others within about 10 s, naming the task;
- a task that is alive but does not take part (stuck in its input pipeline or
  in code of its own, or with fewer batches than the others): every call of
  the step functions `fit`, `evaluate` and `predict` run is watched by
  `Watchdog.deadline`, which aborts this process's collectives once a call
  outlives `timeout_seconds`; the call then raises a `TimeoutError` saying so.

Example:

```python
with process_watchdog().deadline(300, "a step of fit"):
    logs = model.train_function(iterator)
```
"""

import contextlib
import functools
import re
import threading
import time

import tensorflow as tf

from tfdist._compat import patches
from tfdist._compat.tf_collectives import abort_collectives


class StepTimeoutError(TimeoutError):
    """A watched call outlived its deadline; the process's collectives are aborted."""


class TasksDivergedError(RuntimeError):
    """The tasks of a job issued different collectives at the same point of a step."""


# What TensorFlow says when the members of a collective disagree on it.
_DIVERGED = re.compile(r"Collective instance \d+ expected|Shape mismatch in the collective "
                       r"instance|another member in the group expected")


STEP_CAUSES = (
    "a task with fewer batches than the others (every task must run the same "
    "number of steps), one stuck in its input pipeline or in code of its own, "
    "or one running a different program. Raise `timeout_seconds` if a step may "
    "legitimately take longer (the first one includes tracing).")


class Watchdog:
    """Deadlines over calls that wait on other processes, kept by one thread.

    Args:
        expire: called with a message when a deadline passes (default: abort
            this process's collectives, which fails the watched call).

    Example:

    ```python
    watchdog = Watchdog()
    with watchdog.deadline(60, "a step of fit"):
        run_step()
    ```
    """

    def __init__(self, expire=abort_collectives):
        self._expire = expire
        self._condition = threading.Condition()
        self._deadlines = {}  # token -> (monotonic deadline, message)
        self._thread = None

    @contextlib.contextmanager
    def deadline(self, seconds: float, what: str, causes: str = STEP_CAUSES):
        """Calls `expire` if the block runs longer than `seconds`; the block
        then raises `StepTimeoutError` (whatever error the expiry caused it).

        Args:
            seconds: the deadline, a number > 0.
            what: what the block does, for the message ("a step of fit").
            causes: what may keep the other tasks away, for the message.
        """
        message = (
            f"{what} did not finish within {seconds:g} s (the strategy's "
            f"`timeout_seconds`): another task of the job is alive but has not "
            f"taken part in its collectives - {causes}")
        token = object()
        with self._condition:
            self._deadlines[token] = (time.monotonic() + seconds, message)
            self._start()
            self._condition.notify()
        try:
            yield
        except Exception as error:
            with self._condition:
                expired = token not in self._deadlines
            if expired:
                raise StepTimeoutError(message) from error
            raise
        finally:
            with self._condition:
                self._deadlines.pop(token, None)

    @property
    def watching(self) -> int:
        """How many calls are being watched now."""
        with self._condition:
            return len(self._deadlines)

    def _start(self):
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._watch, name="tfdist-watchdog", daemon=True)
            self._thread.start()

    def _watch(self):
        with self._condition:
            while True:
                if not self._deadlines:
                    self._condition.wait()
                    continue
                token, (deadline, message) = min(
                    self._deadlines.items(), key=lambda item: item[1][0])
                remaining = deadline - time.monotonic()
                if remaining > 0:
                    self._condition.wait(remaining)
                    continue
                del self._deadlines[token]  # marks the call expired
                self._expire(message)


_process_watchdog = None
_process_lock = threading.Lock()


def process_watchdog() -> Watchdog:
    """This process's one `Watchdog` (created on first use).

    Example:

    ```python
    process_watchdog().deadline(300, "a step of fit")
    ```
    """
    global _process_watchdog
    with _process_lock:
        if _process_watchdog is None:
            _process_watchdog = Watchdog()
        return _process_watchdog


class _WatchedFunction:
    """A Keras step function whose every call is under a deadline; other
    attributes are the function's own."""

    def __init__(self, function, seconds, what):
        self.__wrapped__ = function
        self._seconds = seconds
        self._what = what

    def __call__(self, *args, **kwargs):
        try:
            with process_watchdog().deadline(self._seconds, self._what):
                return self.__wrapped__(*args, **kwargs)
        except tf.errors.OpError as error:
            if not _DIVERGED.search(str(error)):
                raise
            said = next(line for line in str(error).splitlines() if _DIVERGED.search(line))
            raise TasksDivergedError(
                f"In {self._what}, the tasks of the job issued different collectives "
                f"at the same point ({said.strip()}). Most often their data differ in "
                f"length: every task must run the same number of steps per epoch "
                f"(give each the same number of examples, or set `steps_per_epoch`); "
                f"or the tasks run different code.") from error

    def __getattr__(self, name):
        if name == "__wrapped__":  # not yet set (a copy being made)
            raise AttributeError(name)
        return getattr(self.__wrapped__, name)


_WATCHED = (
    (patches.TRAINER_MAKE_TRAIN_FUNCTION, "train_function", "a step of fit"),
    (patches.TRAINER_MAKE_TEST_FUNCTION, "test_function", "a step of evaluate"),
    (patches.TRAINER_MAKE_PREDICT_FUNCTION, "predict_function", "a step of predict"),
)


def watch_step_functions(strategy_class):
    """Puts every call of `fit`'s, `evaluate`'s and `predict`'s step functions
    under a deadline of the strategy's `timeout_seconds`, for models whose
    strategy is a `strategy_class`.

    Example:

    ```python
    watch_step_functions(MultiWorkerStrategy)
    ```
    """
    for patch, attribute, what in _WATCHED:
        patches.install_for_strategy(patch, strategy_class, functools.partial(
            _make_watched, attribute=attribute, what=what))


def _make_watched(original, model, strategy, force=False, *, attribute, what):
    return patches.wrap_made_function(original, model, force, attribute, _WatchedFunction,
                                      strategy.timeout_seconds, what)
