"""Which tasks of a cluster still answer: frozen tasks found while a job runs.

A task that dies closes its connections, and TensorFlow reports it at once.
A task that freezes (stopped by SIGSTOP, a debugger, a host that stalls)
keeps its port open: the kernel still accepts connections and nothing
answers, so a parameter-server chief waiting on it would wait forever.
`TaskMonitor` asks every task's TensorFlow server for its status
(`tensorflow.WorkerService/GetStatus`, answered by the server's own threads
however busy the task's training is) every few seconds, from one thread, and
names the tasks that stop answering.

Example:

```python
monitor = TaskMonitor({"ps:0": "10.0.0.3:2222", "worker:0": "10.0.0.4:2222"})
with monitor:
    ...                      # waits that call monitor.check() every second
```
"""

import faulthandler
import os
import sys
import threading
import time

import grpc
from absl import logging

_GET_STATUS = "/tensorflow.WorkerService/GetStatus"


def probe(address: str, timeout: float) -> str:
    """Asks the TensorFlow server at `address` for its status, once.

    Returns "ok" (it answered), "frozen" (it accepted the request but did not
    answer within `timeout` seconds) or "down" (nothing listens: TensorFlow
    reports that itself).

    Example:

    ```python
    probe("127.0.0.1:2222", timeout=5.0)   # "ok"
    ```
    """
    with grpc.insecure_channel(address) as channel:
        try:
            channel.unary_unary(_GET_STATUS)(b"", timeout=timeout)  # an empty request is valid
            return "ok"
        except grpc.RpcError as error:
            return "frozen" if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "down"


class TaskUnresponsiveError(RuntimeError):
    """A task of the job is alive (its port accepts connections) but does not answer."""


class TaskMonitor:
    """Probes tasks every `interval` seconds from one daemon thread while in use.

    A task that fails `misses` probes in a row (each waiting `timeout`
    seconds for an answer) is frozen: `check()` then raises
    `TaskUnresponsiveError` naming it. A task that is down is left to
    TensorFlow, which reports it (or reschedules its work) itself. If no
    `check()` has raised it `exit_after` seconds later (the process is
    blocked inside a TensorFlow call that waits on the frozen task), the
    monitor logs the error and every thread's stack, and ends the process
    with exit code 1.

    Args:
        tasks: task name ("ps:0") -> "host:port".
        interval: seconds between two rounds of probes.
        timeout: seconds a probe waits for an answer.
        misses: failed probes in a row that make a task frozen.
        exit_after: seconds; None: never end the process.

    Example:

    ```python
    with TaskMonitor(tasks) as monitor:
        while not done():
            monitor.check()
            time.sleep(1)
    ```
    """

    def __init__(self, tasks: dict, interval: float = 2.0, timeout: float = 5.0,
                 misses: int = 2, exit_after: float | None = None):
        self.tasks = dict(tasks)
        self.interval, self.timeout, self.misses = interval, timeout, misses
        self.exit_after = exit_after
        self._frozen = {}  # name -> seconds it has not answered
        self._reported = False
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="tfdist-task-monitor",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread = None

    @property
    def frozen(self) -> dict:
        """The frozen tasks found so far: name -> seconds without an answer."""
        return dict(self._frozen)

    def check(self):
        """Raises `TaskUnresponsiveError` if a task is frozen."""
        frozen = self.frozen
        if frozen:
            self._reported = True
            raise TaskUnresponsiveError(self._message(frozen))

    def _message(self, frozen):
        names = ", ".join(f"{name} ({self.tasks[name]}, no answer for {seconds:.0f} s)"
                          for name, seconds in sorted(frozen.items()))
        return (f"Task {names} stopped answering during training: its process is "
                f"alive but frozen (stopped, in a debugger, or its host stalled). The "
                f"job cannot go on without it: restart the job (with "
                f"keras.callbacks.BackupAndRestore, fit resumes from the last "
                f"completed epoch).")

    def _run(self):
        failed = dict.fromkeys(self.tasks, 0)
        since = {}
        while not self._stop.is_set():
            for name, address in self.tasks.items():
                if self._stop.is_set():
                    return
                start = time.monotonic()
                if probe(address, self.timeout) == "frozen":
                    failed[name] += 1
                    since.setdefault(name, start)
                    if failed[name] >= self.misses:
                        self._frozen[name] = time.monotonic() - since[name]
                else:
                    failed[name] = 0
                    since.pop(name, None)
            self._stop.wait(self.interval)
            if self._frozen and self.exit_after is not None:
                self._exit_unless_reported()

    def _exit_unless_reported(self):
        if not self._stop.wait(self.exit_after) and not self._reported:
            logging.error("%s Ending this process: it is blocked waiting on that task "
                          "(where each thread waits follows).", self._message(self.frozen))
            logging.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            os._exit(1)
