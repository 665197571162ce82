"""`tfdist.cluster.liveness`: a frozen TensorFlow server is told from a live or a dead one.

The server runs in a subprocess, frozen with SIGSTOP (its port keeps
accepting connections).
"""

import contextlib
import signal
import subprocess
import sys
import time

import psutil
import pytest

from helpers import wait_until_answering
from tfdist.cluster.liveness import TaskMonitor, TaskUnresponsiveError, probe
from tfdist.cluster.tf_config import free_ports

SERVER = """
import sys
import tensorflow as tf
cluster = tf.train.ClusterSpec({"ps": [sys.argv[1]]})
tf.distribute.Server(cluster, job_name="ps", task_index=0, protocol="grpc").join()
"""


@pytest.fixture(scope="module")
def server():  # one server: the frozen test thaws it, the dead test kills it
    address = f"127.0.0.1:{free_ports(1)[0]}"
    process = subprocess.Popen([sys.executable, "-c", SERVER, address],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_answering(address, process)
        yield process, address
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait()


def wait_until_stopped(pid, timeout=10.0):
    """Waits until every thread of process `pid` is stopped (state T)."""
    deadline = time.monotonic() + timeout
    threads = psutil.Process(pid).threads()
    while any(psutil.Process(t.id).status() != psutil.STATUS_STOPPED for t in threads):
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.05)


def test_a_frozen_server_is_named_and_a_live_one_is_not(server):
    process, address = server
    monitor = TaskMonitor({"ps:0": address}, interval=0.2, timeout=1.0, misses=2)
    with monitor:
        time.sleep(3)  # several rounds: a live task is never frozen
        monitor.check()
        process.send_signal(signal.SIGSTOP)
        # The signal is asynchronous: on a busy host the server answered one
        # more probe before it stopped (1 CI run in many).
        wait_until_stopped(process.pid)
        assert probe(address, timeout=1.0) == "frozen"
        deadline = time.monotonic() + 10
        while not monitor.frozen:
            assert time.monotonic() < deadline, "the frozen task was not found"
            time.sleep(0.2)
    process.send_signal(signal.SIGCONT)
    with pytest.raises(TaskUnresponsiveError,
                       match=rf"Task ps:0 \({address}, no answer for \d+ s\) stopped answering"):
        monitor.check()


def test_a_dead_server_is_down_not_frozen(server):
    process, address = server
    process.kill()
    process.wait()
    assert probe(address, timeout=1.0) == "down"
