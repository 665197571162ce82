"""Records a process's native stacks when it stays in a span too long.

The test processes (`conftest.py`) start one watcher each and tell it on its
stdin where they are, one line each:

    start <key> <seconds> <label>    a span begins (one open span per key)
    end <key>                        it ended

A span still open `seconds` after it began gets the watched process's native
stacks, every thread's (`py-spy dump --native`), written to `--dir`, once.
The watcher is a process of its own because a stalled test may stall while
holding Python's lock (a garbage collection inside TensorFlow's destructor),
where no thread of its process can run. It ends when its stdin closes.

    python tests/scripts/stall_watcher.py --pid=1234 --dir=.pytest_cache/native-stacks
"""

import argparse
import os
import select
import shutil
import subprocess
import sys
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    py_spy = shutil.which("py-spy", path=os.path.dirname(sys.executable))
    spans = {}  # key -> (deadline, label)
    unread = b""  # (read from the descriptor itself: a buffered reader would
    # keep lines that `select` then no longer sees)
    while True:
        now = time.monotonic()
        timeout = max(0.0, min((d for d, _ in spans.values()), default=now + 3600) - now)
        if select.select([sys.stdin], [], [], timeout)[0]:
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:
                return
            *lines, unread = (unread + chunk).split(b"\n")
            for line in lines:
                kind, key, *rest = line.decode().split(" ", 3)
                if kind == "start":
                    spans[key] = (time.monotonic() + float(rest[0]), rest[1])
                else:
                    spans.pop(key, None)
            continue
        for key, (deadline, label) in list(spans.items()):
            if deadline <= time.monotonic():
                del spans[key]
                _record(py_spy, args.pid, args.dir, key, label)


def _record(py_spy, pid, directory, key, label):
    done = (subprocess.run([py_spy, "dump", "--native", "--pid", str(pid)],
                           capture_output=True, text=True, timeout=120)
            if py_spy else None)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{pid}-{key}-{time.time_ns()}.txt"), "w") as f:
        f.write(f"{label}; native stacks (py-spy):\n")
        f.write(f"{done.stdout}{done.stderr}\n" if done else "py-spy is not installed\n")


if __name__ == "__main__":
    main()
