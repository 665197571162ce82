"""A MultiWorkerStrategy whose peer never starts, or dies while starting,
fails within its timeout, naming the peer."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from tfdist.cluster.tf_config import free_ports

pytestmark = pytest.mark.multiprocess

# The constructor times itself: the bound is on it, not on importing TensorFlow
# (which a loaded machine can make take tens of seconds).
def timed(strategy):
    """A script that makes tfdist's `strategy` with `timeout_seconds=4`,
    printing 'connected' if it returns, and the seconds it took to stderr
    (TensorFlow imported before the clock starts)."""
    return ("import sys, time\n"
            "import tfdist\n"
            f"strategy = tfdist.{strategy}  # (imports TensorFlow)\n"
            "start = time.monotonic()\n"
            "try:\n"
            "    strategy(timeout_seconds=4)\n"
            "    print('connected')\n"
            "finally:\n"
            "    print(f'constructor: {time.monotonic() - start} s', file=sys.stderr)\n")


CREATE_STRATEGY = timed("MultiWorkerStrategy")


def constructor_seconds(stderr):
    """The seconds a `timed` script's constructor took, from its output."""
    return float(re.search(r"^constructor: (\S+) s$", stderr, re.MULTILINE).group(1))


@pytest.mark.parametrize("index, missing", [(0, 1), (1, 0)])
def test_missing_peer_fails_the_constructor_within_its_timeout(index, missing):
    """Worker `index` starts alone; worker `missing` (the leader, or not) never does."""
    addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
    tf_config = {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}
    env = dict(os.environ, TF_CONFIG=json.dumps(tf_config), TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", CREATE_STRATEGY], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "connected" not in done.stdout
    assert constructor_seconds(done.stderr) < 30, done.stderr[-2000:]
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
        done = subprocess.run([sys.executable, "-c", CREATE_STRATEGY], env=env,
                              capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "connected" not in done.stdout
    assert constructor_seconds(done.stderr) < 30, done.stderr[-2000:]
    assert (f"worker:0's address {addresses[0]} (TF_CONFIG) is in use by another "
            f"process") in done.stderr, done.stderr[-2000:]


def test_a_parameter_server_chief_names_the_tasks_that_never_start():
    """The chief waited without end (240 s+, no message) for a ps task that never started."""
    chief, worker, ps = (f"127.0.0.1:{port}" for port in free_ports(3))
    tf_config = {"cluster": {"chief": [chief], "worker": [worker], "ps": [ps]},
                 "task": {"type": "chief", "index": 0}}
    env = dict(os.environ, TF_CONFIG=json.dumps(tf_config), TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run(
        [sys.executable, "-c", timed("ParameterServerStrategy")],
        env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "connected" not in done.stdout
    assert constructor_seconds(done.stderr) < 30, done.stderr[-2000:]
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
        done = subprocess.run([sys.executable, "-c", CREATE_STRATEGY], env=env(0),
                              capture_output=True, text=True, timeout=120)
        assert dying.wait(timeout=30) == 3
    finally:
        dying.kill()
    assert done.returncode != 0 and "connected" not in done.stdout
    assert constructor_seconds(done.stderr) < 40, done.stderr[-2000:]
    assert ("TimeoutError: worker:0 waited 4 s for every task to register with TensorFlow, "
            "but worker:1 did not") in done.stderr, done.stderr[-2000:]
