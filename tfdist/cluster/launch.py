"""`launch`: a local cluster, one process per task, as a TFJob would run it.

Every task runs the same command with its own `TF_CONFIG` (the Kubeflow training
operator's shape, all addresses 127.0.0.1 on free ports) and, when a
`ParallelConfig` is given, `TFDIST_CONFIG`. Each output line is prefixed with its
task (`[worker:1] ...`); the launcher's own lines with `[launch]`.

The job succeeds when its training tasks finish with exit code 0: all chief and
worker tasks, or, in a parameter-server job with a chief (ps and worker tasks
serve until stopped), the chief. Tasks still running then (ps, evaluator) get a
few seconds to finish and are stopped. The first task to fail (after its
restarts, if any) stops every other task, and its exit code is returned. A
timeout, SIGINT or SIGTERM stops every task too (a second SIGINT kills them at
once). Each task runs in its own process group, stopped as a group (SIGTERM,
then SIGKILL). On Linux each task runs under `supervisor.py`, which also stops
the processes the task started (detached ones included) when the task ends or
is stopped, and stops the task if the launcher dies, even by SIGKILL.

The tasks run in a private network (`private_network.py`, Linux): they reach
each other on 127.0.0.1 and nothing else, and nothing outside reaches their
TensorFlow servers, which listen on every interface; the profiler ports are
forwarded from this host's 127.0.0.1. `host_network=True` runs them in this
host's network instead.

The launcher never waits for a task's output beyond the job's end: output
still buffered a moment after a task's process has exited is dropped.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

from tfdist.cluster.private_network import PrivateNetwork
from tfdist.cluster.release_memory import release_memory_env
from tfdist.cluster.tf_config import TF_CONFIG_ENV, TFConfig, local_tf_configs
from tfdist.config import CONFIG_ENV, PROFILER_PORT_ENV, ParallelConfig

TIMEOUT_EXIT_CODE = 124
INTERRUPTED_EXIT_CODE = 130
_STOP_GRACE_SECONDS = 10.0  # SIGTERM -> SIGKILL
_DRAIN_SECONDS = 5.0  # after success, for tasks that were about to finish
_OUTPUT_SECONDS = 1.0  # for a task's last output after its process exited
_SUPERVISOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "supervisor.py")
_SUPERVISED = sys.platform.startswith("linux")


class _Task:
    """One task: its TF_CONFIG, its current process and the thread copying its output."""

    def __init__(self, config: TFConfig):
        self.config = config
        self.process = None
        self.reader = None
        self.restarts = 0
        self.exit_code = None

    @property
    def name(self):
        return self.config.task

    @property
    def running(self):
        return self.process is not None and self.exit_code is None


class _Cluster:
    def __init__(self, command, configs, parallel_config, profiler_port, network, output,
                 environment):
        self.command = list(command)
        self.environment = environment  # added to every task's, beside TF_CONFIG
        self.tasks = [_Task(c) for c in configs]
        self.parallel_config = parallel_config
        self.profiler_port = profiler_port
        self.network = network
        self.output = output
        self.lock = threading.Lock()
        self.changed = threading.Event()  # some process exited

    def say(self, name, line):
        with self.lock:
            self.output.write(f"[{name}] {line.rstrip(chr(10))}\n")
            self.output.flush()

    def start(self, task):
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.environment)
        env[TF_CONFIG_ENV] = task.config.to_json()
        if self.parallel_config is not None:
            env[CONFIG_ENV] = self.parallel_config.to_json()
        if self.profiler_port is not None:
            env[PROFILER_PORT_ENV] = str(self.profiler_port + self.tasks.index(task))
        task.exit_code = None
        task.reader = None
        command = self.command
        if self.network is not None:
            command = self.network.command(command)
        if _SUPERVISED:
            command = [sys.executable, _SUPERVISOR, str(os.getpid())] + command
        task.process = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, errors="replace",
            start_new_session=True)
        task.reader = threading.Thread(target=self._copy_output,
                                       args=(task, task.process), daemon=True)
        task.reader.start()
        threading.Thread(target=self._notice_exit, args=(task.process,), daemon=True).start()
        self.say("launch", f"started {task.name} (pid {task.process.pid})")

    def _copy_output(self, task, process):
        for line in process.stdout:
            self.say(task.name, line)

    def _notice_exit(self, process):
        # Apart from the output: a process the task left behind may hold its
        # output pipe open long after the task ended.
        process.wait()
        self.changed.set()

    def collect_exits(self):
        """Tasks that exited since the last call (their `exit_code` set)."""
        exited = []
        for task in self.running_tasks():
            if task.process.poll() is not None:
                task.reader.join(_OUTPUT_SECONDS)
                task.exit_code = task.process.returncode
                exited.append(task)
        return exited

    def running_tasks(self):
        return [t for t in self.tasks if t.running]

    def succeeded(self):
        """The training tasks finished: chief and workers, or the chief of a PS job."""
        types = {t.config.task_type for t in self.tasks}
        finishers = {"chief"} if {"ps", "chief"} <= types else {"chief", "worker"}
        return all(t.exit_code == 0 for t in self.tasks
                   if t.config.task_type in finishers)

    def wait_for_exits(self, deadline):
        """Blocks until a process exits or `deadline` (monotonic) passes."""
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.changed.wait(remaining)
        self.changed.clear()

    def kill(self):
        """Kills every running task now (a second Ctrl-C): its supervisor kills
        the task and what it started; without one, SIGKILL to the group."""
        for task in self.running_tasks():
            if _SUPERVISED:
                task.process.send_signal(signal.SIGUSR1)
            else:
                _signal_group(task.process, signal.SIGKILL)

    def stop(self):
        """Stops every running task: SIGTERM to its group, SIGKILL after a grace."""
        running = self.running_tasks()
        for task in running:
            _signal_group(task.process, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_SECONDS
        for task in running:
            try:
                task.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(task.process, signal.SIGKILL)
                task.process.wait()
            if task.reader is not None:  # None if interrupted right after Popen
                task.reader.join(_OUTPUT_SECONDS)
            task.exit_code = task.process.returncode


def _signal_group(process, sig):
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


class _Terminated(Exception):
    """The launcher received SIGTERM."""


def _raise_terminated(signum, frame):
    raise _Terminated()


def launch(command, *, chief=False, workers=1, ps=0, evaluator=False,
           restart_on_failure=0, timeout=None, config=None, profiler_port=None,
           host_network=False, release_memory=False, output=None) -> int:
    """Runs `command` as every task of a local cluster; returns the job's exit code.

    Args:
        command: the command every task runs, as a list (`["python", "train.py"]`).
        chief, workers, ps, evaluator: the tasks (one chief at most, >= 1 worker).
        restart_on_failure: how many times each task is restarted (same
            `TF_CONFIG`) when it exits non-zero, before the job fails.
        timeout: seconds the whole job may take; then every task is stopped and
            124 returned, naming the tasks still running.
        config: a `ParallelConfig` (or dict) passed to every task as
            `$TFDIST_CONFIG`.
        profiler_port: task k (in the order chief, workers, ps, evaluator)
            gets `$TFDIST_PROFILER_PORT` = `profiler_port + k`, where its
            strategy starts a profiler server for `tfdist profile` (forwarded
            from this host's 127.0.0.1 to the task's private network).
        host_network: run the tasks in this host's network, not in a private
            one: they can then reach other hosts and this host's servers, and
            their TensorFlow servers can be reached from every network this
            host is on.
        release_memory: every task's allocators give freed memory back to the
            system (`tfdist.cluster.release_memory`): a lower peak per worker,
            slower steps. Variables the launcher's environment sets win.
        output: where the prefixed output goes (default `sys.stdout`).

    Raises:
        ValueError: a bad argument, or a profiler port taken on this host.
        RuntimeError: no private network can be made here (not Linux, user
            namespaces forbidden), saying why; nothing has started.

    Returns:
        0 if the job succeeded; else the exit code of the first task that
        failed (128 + N for a task killed by signal N), 124 on timeout, 130 if
        the launcher was interrupted.

    Example:

    ```python
    from tfdist.cluster import launch
    code = launch(["python", "train.py"], workers=2, timeout=600)
    ```
    """
    if isinstance(command, str) or not command or not all(
            isinstance(part, str) for part in command):
        raise ValueError(
            f"`command` must be a non-empty list of strings, got {command!r}.")
    if shutil.which(command[0]) is None:
        raise ValueError(
            f"`command` starts with {command[0]!r}, which is not an executable file "
            f"nor a program on $PATH.")
    if isinstance(restart_on_failure, bool) or not isinstance(
            restart_on_failure, int) or restart_on_failure < 0:
        raise ValueError(
            f"`restart_on_failure` must be an int >= 0, got {restart_on_failure!r}.")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(
            timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"`timeout` must be a number of seconds > 0, got {timeout!r}.")
    if not isinstance(release_memory, bool):
        raise ValueError(f"`release_memory` must be True or False, got {release_memory!r}.")
    if isinstance(config, dict):
        config = ParallelConfig.from_dict(config)
    configs = local_tf_configs(chief=chief, workers=workers, ps=ps, evaluator=evaluator)
    if profiler_port is not None and (
            isinstance(profiler_port, bool) or not isinstance(profiler_port, int)
            or not 1 <= profiler_port <= 65535 - len(configs)):
        raise ValueError(
            f"`profiler_port` must be an int in 1..{65535 - len(configs)} (task k "
            f"uses profiler_port + k), got {profiler_port!r}.")
    with contextlib.ExitStack() as stack:
        network = None
        if not host_network:
            ports = [] if profiler_port is None else list(
                range(profiler_port, profiler_port + len(configs)))
            network = stack.enter_context(PrivateNetwork(forward=ports))
        cluster = _Cluster(command, configs, config, profiler_port, network,
                           output or sys.stdout,
                           release_memory_env(os.environ) if release_memory else {})
        if network is not None:
            forwarded = (f"; profiler ports {ports[0]}-{ports[-1]} forwarded from this "
                         f"host's 127.0.0.1" if ports else "")
            cluster.say("launch", f"the tasks run in a private network: they reach each "
                                  f"other on 127.0.0.1 and nothing else (--host-network: "
                                  f"this host's network){forwarded}")
        return _run(cluster, restart_on_failure, timeout)


def _run(cluster, restart_on_failure, timeout):
    """Runs the job, stopping every task when it ends, fails or is interrupted."""
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        signal.signal(signal.SIGTERM, _raise_terminated)
        # Also when started with SIGINT ignored (`tfdist launch ... &` from a
        # script): Python then installs no KeyboardInterrupt, and a SIGINT
        # sent to stop the job would be lost.
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def kill_on_ctrl_c():
        if main_thread:  # while stopping, a second Ctrl-C kills instead of raising
            signal.signal(signal.SIGINT, lambda signum, frame: cluster.kill())

    try:
        return _supervise(cluster, restart_on_failure, timeout)
    except (KeyboardInterrupt, _Terminated):
        kill_on_ctrl_c()  # before the message: the second Ctrl-C may follow it at once
        cluster.say("launch", f"interrupted: stopping every task (up to "
                              f"{_STOP_GRACE_SECONDS:g} s; Ctrl-C again kills them now)")
        return INTERRUPTED_EXIT_CODE
    finally:
        kill_on_ctrl_c()
        try:
            cluster.stop()
        finally:
            if main_thread:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)


def _supervise(cluster, restart_on_failure, timeout):
    deadline = None if timeout is None else time.monotonic() + timeout
    for task in cluster.tasks:
        cluster.start(task)
    while True:
        for task in cluster.collect_exits():
            code = task.exit_code
            if code == 0:
                cluster.say("launch", f"{task.name} finished")
                continue
            code = 128 - code if code < 0 else code
            if task.restarts < restart_on_failure:
                task.restarts += 1
                cluster.say("launch", f"{task.name} exited with code {code}: restart "
                                      f"{task.restarts} of {restart_on_failure}")
                cluster.start(task)
                continue
            running = ", ".join(t.name for t in cluster.running_tasks()) or "none"
            cluster.say("launch", f"{task.name} failed with exit code {code}: stopping "
                                  f"the other tasks (still running: {running})")
            return code
        if cluster.succeeded():
            drain = time.monotonic() + _DRAIN_SECONDS
            while cluster.running_tasks() and time.monotonic() < drain:
                cluster.wait_for_exits(drain)
                for task in cluster.collect_exits():
                    cluster.say("launch", f"{task.name} exited with code {task.exit_code}")
            left = ", ".join(t.name for t in cluster.running_tasks())
            if left:
                cluster.say("launch", f"job succeeded; stopping {left}")
            return 0
        if deadline is not None and time.monotonic() >= deadline:
            running = ", ".join(t.name for t in cluster.running_tasks())
            cluster.say("launch", f"timed out after {timeout:g} s; tasks still "
                                  f"running: {running}")
            return TIMEOUT_EXIT_CODE
        cluster.wait_for_exits(deadline)
