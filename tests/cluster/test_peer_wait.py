"""A MultiWorkerStrategy whose peer never starts, or dies while starting,
fails within its timeout, naming the peer."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tfdist.cluster.tf_config import free_ports

pytestmark = pytest.mark.multiprocess

CREATE_STRATEGY = ("import tfdist\n"
                   "tfdist.MultiWorkerStrategy(timeout_seconds=4)\n"
                   "print('connected')\n")


@pytest.mark.parametrize("index, missing", [(0, 1), (1, 0)])
def test_missing_peer_fails_the_constructor_within_its_timeout(index, missing):
    """Worker `index` starts alone; worker `missing` (the leader, or not) never does."""
    addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
    tf_config = {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}
    env = dict(os.environ, TF_CONFIG=json.dumps(tf_config), TF_CPP_MIN_LOG_LEVEL="2")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", CREATE_STRATEGY], env=env,
                          capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - start
    assert done.returncode != 0 and "connected" not in done.stdout
    assert seconds < 30, seconds
    assert (f"TimeoutError: worker:{index} waited 4 s for the other tasks of the job, "
            f"but worker:{missing} ({addresses[missing]}) did not start") in done.stderr


def test_a_port_taken_by_another_process_fails_the_constructor_at_once():
    """TensorFlow would fail "Could not start gRPC server" only after the
    peers answered; the peers would wait for this task meanwhile."""
    addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
    tf_config = {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": 0}}
    env = dict(os.environ, TF_CONFIG=json.dumps(tf_config), TF_CPP_MIN_LOG_LEVEL="2")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", int(addresses[0].rsplit(":", 1)[1])))
        taken.listen(1)
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-c", CREATE_STRATEGY], env=env,
                              capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "connected" not in done.stdout
    assert time.monotonic() - start < 30
    assert (f"worker:0's address {addresses[0]} (TF_CONFIG) is in use by another "
            f"process") in done.stderr, done.stderr[-2000:]


def test_a_parameter_server_chief_names_the_tasks_that_never_start():
    """The chief waited without end (240 s+, no message) for a ps task that never started."""
    chief, worker, ps = (f"127.0.0.1:{port}" for port in free_ports(3))
    tf_config = {"cluster": {"chief": [chief], "worker": [worker], "ps": [ps]},
                 "task": {"type": "chief", "index": 0}}
    env = dict(os.environ, TF_CONFIG=json.dumps(tf_config), TF_CPP_MIN_LOG_LEVEL="2")
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", "import tfdist\n"
         "tfdist.ParameterServerStrategy(timeout_seconds=4)\nprint('connected')\n"],
        env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "connected" not in done.stdout
    assert time.monotonic() - start < 30
    assert (f"TimeoutError: chief:0 waited 4 s for the other tasks of the job, but "
            f"worker:0 ({worker}), ps:0 ({ps}) did not start") in done.stderr, \
        done.stderr[-2000:]


def test_a_peer_dying_after_answering_fails_the_constructor_within_its_timeout():
    """Worker 1 answers the start's wait, then dies before registering with
    TensorFlow: worker 0 waited in TensorFlow's registration without end."""
    addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]

    def env(index):
        tf_config = {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}
        return dict(os.environ, TF_CONFIG=json.dumps(tf_config), TF_CPP_MIN_LOG_LEVEL="2")

    dying = subprocess.Popen(
        [sys.executable, "-c", "import os\nfrom tfdist.cluster.rendezvous import wait_for_peers\n"
         "wait_for_peers(60)\nos._exit(3)\n"], env=env(1))
    try:
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-c", CREATE_STRATEGY], env=env(0),
                              capture_output=True, text=True, timeout=120)
        seconds = time.monotonic() - start
        assert dying.wait(timeout=30) == 3
    finally:
        dying.kill()
    assert done.returncode != 0 and "connected" not in done.stdout
    assert seconds < 40, seconds
    assert ("TimeoutError: worker:0 waited 4 s for every task to register with TensorFlow, "
            "but worker:1 did not") in done.stderr, done.stderr[-2000:]
