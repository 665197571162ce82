"""Local multi-process clusters for tests: free ports, TF_CONFIG, hard timeouts."""

import json
import os
import socket
import subprocess
import sys


def free_ports(n):
    """`n` distinct free TCP ports on 127.0.0.1."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def run_workers(script, num_workers, args=(), timeout=240):
    """Runs `script` as every worker of a localhost cluster; kills all on failure.

    Returns the list of (returncode, output) per worker; raises AssertionError
    naming the workers still running when `timeout` seconds pass.
    """
    addresses = [f"127.0.0.1:{port}" for port in free_ports(num_workers)]
    processes = []
    try:
        for index in range(num_workers):
            tf_config = {"cluster": {"worker": addresses},
                         "task": {"type": "worker", "index": index}}
            env = dict(os.environ, TF_CONFIG=json.dumps(tf_config),
                       TF_CPP_MIN_LOG_LEVEL="2")
            processes.append(subprocess.Popen(
                [sys.executable, str(script), *args], env=env, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        results = []
        for index, process in enumerate(processes):
            try:
                output, _ = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                running = [i for i, p in enumerate(processes) if p.poll() is None]
                raise AssertionError(
                    f"workers {running} still running after {timeout}s") from None
            results.append((process.returncode, output))
        return results
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
