"""Remote profiling: each task's profiler server, and capturing many at once.

A task whose `$TFDIST_PROFILER_PORT` is set starts a TensorFlow profiler server on
that port when it creates a tfdist strategy (`tfdist tfjob --profiler-port`
exposes the port on every pod; `tfdist launch --profiler-port P` gives task k the
port P + k). `capture` (and `tfdist profile`) then records a trace of every
listed task at once into one TensorBoard run, one host file per task.
"""

import glob
import os
import re

from tfdist.config import PROFILER_PORT_ENV

_started_port = None
_TASK = re.compile(r"^[A-Za-z0-9._-]+:(\d{1,5})$")


def start_profiler_server(port=None):
    """Starts this process's profiler server (once); returns its port or None.

    Args:
        port: the port; default: `$TFDIST_PROFILER_PORT`, and nothing starts
            when that is not set.

    Example:

    >>> start_profiler_server(6009)  # doctest: +SKIP
    6009
    """
    global _started_port
    if port is None:
        text = os.environ.get(PROFILER_PORT_ENV)
        if not text:
            return None
        if not text.isdigit() or not 1 <= int(text) <= 65535:
            raise ValueError(
                f"${PROFILER_PORT_ENV} must be a port number in 1..65535, got {text!r}.")
        port = int(text)
    if _started_port is None:
        import tensorflow as tf

        tf.profiler.experimental.server.start(port)
        _started_port = port
    elif _started_port != port:
        raise ValueError(
            f"This process's profiler server already listens on {_started_port}; "
            f"it cannot also listen on {port}.")
    return _started_port


def capture(tasks, logdir, duration_ms, attempts=3):
    """Records `duration_ms` of every task's profile at once; returns the files.

    Args:
        tasks: "host:port" addresses of running profiler servers.
        logdir: the TensorBoard log directory; the traces land in one run,
            `logdir/plugins/profile/<run>/`, one `.xplane.pb` per task, each
            with tfdist's phase rows (`tfdist.trace_phases`).
        duration_ms: how long to record, in milliseconds (> 0).
        attempts: how many times to try when a task does not answer, fails
            the capture, or answers with no events (then the partial run is
            discarded).

    Returns:
        The host files written, one per task, all in one run.

    Raises:
        ValueError: `tasks` or `duration_ms` is not valid (checked before
            TensorFlow is imported).
        RuntimeError: a task gave no trace after `attempts` tries, or the
            profiler client failed (its error's message).

    Example:

    ```python
    capture(["10.0.0.2:6009", "10.0.0.3:6009"], "gs://bucket/logs", 2000)
    ```
    """
    if isinstance(tasks, str) or not tasks:
        raise ValueError(f"`tasks` must be a non-empty list of 'host:port', got {tasks!r}.")
    for task in tasks:
        match = _TASK.match(task) if isinstance(task, str) else None
        if match is None or not 1 <= int(match[1]) <= 65535:
            raise ValueError(f"`tasks` has {task!r}; each task is 'host:port'.")
    if isinstance(duration_ms, bool) or not isinstance(duration_ms, int) or duration_ms <= 0:
        raise ValueError(f"`duration_ms` must be an int > 0, got {duration_ms!r}.")
    import tensorflow as tf

    from tfdist.trace_phases import add_phases

    addresses = ",".join(f"grpc://{task}" for task in tasks)
    for attempt in range(attempts):
        before = set(_xplanes(logdir))
        try:
            tf.profiler.experimental.client.trace(
                addresses, os.fspath(logdir), duration_ms, num_tracing_attempts=attempts)
        except tf.errors.OpError as error:
            # A task that stopped answering (one that TensorFlow's profiler
            # aborted may be restarted by its job): try again, then say so.
            if attempt + 1 == attempts:
                raise RuntimeError(error.message.strip()) from error
            continue
        written = sorted(set(_xplanes(logdir)) - before)
        # A task that answers with no events gets no file, and the client
        # retries only when no task answered: check every task is there.
        hosts = {os.path.basename(path).split(".xplane.pb")[0] for path in written}
        silent = [task for task in tasks if task.replace(":", "_") not in hosts]
        if not silent:
            for path in written:
                add_phases(path)
            return written
        for path in written:  # keep runs whole: drop the partial one
            os.remove(path)
        for run in {os.path.dirname(path) for path in written}:
            if not os.listdir(run):
                os.rmdir(run)
    raise RuntimeError(
        f"No trace from {silent} after {attempts} attempts of {duration_ms} ms: "
        f"each task must run TensorFlow work while it is captured.")


def _xplanes(logdir):
    return glob.glob(os.path.join(os.fspath(logdir), "plugins", "profile", "*", "*.xplane.pb"))
