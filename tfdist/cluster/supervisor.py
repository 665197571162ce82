"""The per-task supervisor of `tfdist launch`: a task and everything it starts die together.

    python supervisor.py LAUNCHER_PID COMMAND...

`launch` runs each task as `supervisor.py` (as a script, so that it does not
import TensorFlow), which runs COMMAND as its child and:

- adopts every process COMMAND leaves behind, detached ones included (Linux
  `PR_SET_CHILD_SUBREAPER`: orphaned descendants become its children, not
  init's);
- is told when the launcher dies, even by SIGKILL (`PR_SET_PDEATHSIG`), and
  then stops the task; the task in turn dies if the supervisor is killed;
- on SIGTERM (the launcher stopping the job) or when COMMAND ends, stops every
  remaining descendant: SIGTERM, then SIGKILL after `GRACE_SECONDS`; on
  SIGUSR1 (a second Ctrl-C to the launcher), SIGKILL at once;
- exits with COMMAND's exit code (or dies of the signal that killed it).

Example:

```python
subprocess.Popen([sys.executable, supervisor.__file__, str(os.getpid()),
                  "python", "train.py"], start_new_session=True)
```
"""

import ctypes
import os
import signal
import subprocess
import sys
import time

GRACE_SECONDS = 5.0  # below the launcher's own grace, so cleanup finishes first
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


class _Stop(Exception):
    """SIGTERM: the launcher stops the job, or died."""


_state = {"stopping": False, "urgent": False}


def _raise_stop(signum, frame):
    # Once: a second signal arriving while the first one's _Stop unwinds (or
    # while cleanup runs) must not raise again outside the `try`.
    if not _state["stopping"]:
        _state["stopping"] = True
        raise _Stop()


def _stop_now(signum, frame):
    _state["urgent"] = True
    _raise_stop(signum, frame)


def descendants(pid=None):
    """Pids of every live descendant of `pid` (default: this process), from /proc.

    Example:

    >>> descendants(os.getpid())  # doctest: +SKIP
    [4242, 4243]
    """
    found, pending = [], [os.getpid() if pid is None else pid]
    while pending:
        parent = pending.pop()
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for thread in threads:
            try:
                with open(f"/proc/{parent}/task/{thread}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            found += children
            pending += children
    return found


def _signal_all(sig, skip_group=False):
    """Sends `sig` to every descendant (with `skip_group`, not to those of this
    process group, which the launcher signals itself)."""
    for pid in descendants():
        try:
            if not (skip_group and os.getpgid(pid) == os.getpgrp()):
                os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _reap():
    """Collects exited children (adopted orphans too); returns {pid: status}."""
    statuses = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return statuses
        if pid == 0:
            return statuses
        statuses[pid] = status


def _stop_descendants(launcher_signalled_group):
    """SIGTERM to every descendant, SIGKILL to those left after the grace."""
    _state["stopping"] = True
    _signal_all(signal.SIGTERM, skip_group=launcher_signalled_group)
    deadline = time.monotonic() + GRACE_SECONDS
    while descendants() and time.monotonic() < deadline and not _state["urgent"]:
        _reap()
        time.sleep(0.05)
    deadline = time.monotonic() + GRACE_SECONDS
    while descendants() and time.monotonic() < deadline:
        _signal_all(signal.SIGKILL)
        time.sleep(0.05)
        _reap()
    left = descendants()
    if left:  # uninterruptible (in the kernel): nothing more a signal can do
        print(f"processes {sorted(left)} did not end {GRACE_SECONDS:g} s after SIGKILL",
              file=sys.stderr)


def main(argv):
    launcher, command = int(argv[1]), argv[2:]
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    task = status = None
    stopped = False
    try:
        signal.signal(signal.SIGTERM, _raise_stop)
        signal.signal(signal.SIGUSR1, _stop_now)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher:  # the launcher died before prctl
            raise _Stop()
        try:
            # The task dies with this supervisor too (killed on its own, as
            # a fault drill does to the pid the launcher prints).
            task = subprocess.Popen(
                command, preexec_fn=lambda: libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL))
        except OSError as error:
            print(f"cannot run {command[0]!r}: {error.strerror}", file=sys.stderr)
            return 127
        while status is None:
            pid, code = os.waitpid(-1, 0)
            if pid == task.pid:
                status = code
    except _Stop:
        stopped = True
    finally:
        _stop_descendants(launcher_signalled_group=stopped and os.getppid() == launcher)
        if task is not None:
            status = _reap().get(task.pid, status)
    if status is None:
        return 128 + signal.SIGTERM
    if os.WIFSIGNALED(status):  # die of the same signal, for the launcher to see
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those cannot be handled
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
