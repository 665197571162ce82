"""`tfdist.ChiefStrategy`: pipeline stages on different worker processes.

Jobs run under `tfdist launch --chief --workers N` (tests/scripts/chief_fit.py):
the chief trains, each worker serves its stage and ends with the chief.
"""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import (
    TFDIST,
    assert_parity,
    data,
    make_model,
    output_tail,
    train,
    wait_until_answering,
)
from tfdist.cluster.tf_config import free_ports

SCRIPT = pathlib.Path(__file__).parents[1] / "scripts" / "chief_fit.py"


@pytest.mark.multiprocess
def test_stages_on_two_workers_match_one_device_and_live_there(tmp_path):
    out, saved = tmp_path / "chief.json", tmp_path / "saved.weights.h5"
    checkpoint = tmp_path / "checkpoint"
    job = [*TFDIST, "launch", "--chief", "--workers=2", "--timeout=240", "--pipeline=2",
           "--microbatches=2", "--schedule=1f1b", "--", sys.executable, str(SCRIPT),
           f"--checkpoint={checkpoint}"]
    done = subprocess.run([*job, f"--out={out}", f"--weights={saved}"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, output_tail(done.stdout) + output_tail(done.stderr)
    # The workers end by themselves once the chief has.
    assert "[launch] worker:0 finished" in done.stdout
    assert "[launch] worker:1 finished" in done.stdout
    chief = json.loads(out.read_text())
    reference = train()  # one device, the same model, weights and batches
    assert_parity((chief["losses"], [np.array(w) for w in chief["weights"]], None),
                  reference, rtol=1e-5)
    for value, ref in zip(chief["optimizer"], reference[2].optimizer.variables):
        np.testing.assert_allclose(value, ref.numpy(), rtol=1e-5, atol=1e-6)
    # Stage k's weights and their momentum on worker k alone; none on the chief.
    where = {path: {d.split("/device:")[0] for d in devices}
             for path, devices in chief["weight_devices"].items()}
    first, last = "/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1"
    paths = list(where)  # the chief's weights in order (the reference's paths
    # carry the counts of the models built earlier in this process)
    assert where[paths[0]] == where[paths[1]] == {first}   # the first Dense
    assert where[paths[-1]] == where[paths[-2]] == {last}  # the classifier
    assert all(len(hosts) == 1 and not hosts & {"/job:chief/replica:0/task:0"}
               for hosts in where.values())
    assert "stage 0  [worker:0/CPU:0]" in chief["describe"]
    assert "stage 1  [worker:1/CPU:0]" in chief["describe"]
    for path, devices in chief["slot_devices"]:
        assert {d.split("/device:")[0] for d in devices} == where[path]
    # evaluate and predict read each stage's weights from its worker.
    x, y = data()
    np.testing.assert_allclose(chief["evaluate"],
                               reference[2].evaluate(x, y, batch_size=32, verbose=0), rtol=1e-5)
    np.testing.assert_allclose(chief["predict"],
                               reference[2].predict(x[:64], batch_size=32, verbose=0),
                               rtol=1e-5, atol=1e-6)
    # A new job reads the sharded checkpoint back: weights and optimizer state.
    restored = tmp_path / "restored.json"
    done = subprocess.run([*job, f"--out={restored}", "--restore"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, output_tail(done.stdout) + output_tail(done.stderr)
    restored = json.loads(restored.read_text())
    for value, ref in zip(restored["weights"] + restored["optimizer"],
                          chief["weights"] + chief["optimizer"]):
        np.testing.assert_array_equal(value, ref)
    # save_weights wrote whole tensors: a one-device model loads them.
    model = make_model()
    model.load_weights(saved)
    for value, ref in zip(model.get_weights(), reference[1]):
        np.testing.assert_allclose(value, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
def test_a_chief_killed_mid_fit_resumes_from_its_backup(tmp_path):
    out, backup = tmp_path / "resumed.json", tmp_path / "backup"
    job = [*TFDIST, "launch", "--chief", "--workers=2", "--timeout=240", "--pipeline=2",
           "--microbatches=2", "--", sys.executable, str(SCRIPT), f"--backup={backup}",
           f"--out={out}"]
    crashed = subprocess.run([*job, "--crash"], capture_output=True, text=True, timeout=300)
    assert "[launch] chief:0 failed with exit code 3" in crashed.stdout, \
        output_tail(crashed.stdout) + output_tail(crashed.stderr)
    done = subprocess.run(job, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, output_tail(done.stdout) + output_tail(done.stderr)
    resumed = json.loads(out.read_text())
    # Epoch 0 came from the backup (epoch 1's too, if its save had ended:
    # saves are written while training goes on).
    assert resumed["epochs_run"] in ([1, 2], [2]), resumed["epochs_run"]
    _, weights, model = train(epochs=3)  # uninterrupted, one device
    assert resumed["iterations"] == int(model.optimizer.iterations.numpy()) == 60
    for value, ref in zip(resumed["weights"], weights):
        np.testing.assert_allclose(value, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
def test_a_frozen_worker_ends_the_chief_naming_it():
    launcher = subprocess.Popen(
        [*TFDIST, "launch", "--chief", "--workers=2", "--timeout=240", "--pipeline=2",
         "--microbatches=2", "--", sys.executable, str(SCRIPT), "--epochs=100000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    try:
        for line in launcher.stdout:
            output.append(line)
            if line.startswith("[chief:0] epoch 2"):
                break
        pid = int(re.search(r"started worker:1 \(pid (\d+)\)", "".join(output)).group(1))
        for child in [pid] + _children(pid):  # the worker's process, not only its supervisor
            os.kill(child, signal.SIGSTOP)
        stopped = time.monotonic()
        rest, _ = launcher.communicate(timeout=120)
        waited = time.monotonic() - stopped
    finally:
        if launcher.poll() is None:
            launcher.kill()
    output = "".join(output) + rest
    assert launcher.returncode == 1, output_tail(output)
    assert re.search(r"Task worker:1 \(127\.0\.0\.1:\d+, no answer for \d+ s\) stopped "
                     r"answering during training", output), output_tail(output)
    assert "[launch] chief:0 failed with exit code 1" in output
    assert waited < 60, waited


@pytest.mark.multiprocess
def test_a_worker_ends_after_a_chief_that_lived_less_than_a_probe_interval():
    # A worker serves until the chief, having answered, is gone. A chief whose
    # server lives 0.3 s, less than the worker's 1 s between probes, must still
    # be seen, or the worker waits out its timeout.
    chief_port, worker_port = free_ports(2)
    cluster = {"chief": [f"127.0.0.1:{chief_port}"], "worker": [f"127.0.0.1:{worker_port}"]}

    def task(kind, code):
        tf_config = {"cluster": cluster, "task": {"type": kind, "index": 0}}
        return subprocess.Popen([sys.executable, "-c", code], text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, "TF_CONFIG": json.dumps(tf_config)})

    worker = task("worker", "import tfdist; tfdist.ChiefStrategy(timeout_seconds=60)")
    chief = None
    try:
        wait_until_answering(cluster["worker"][0], worker)
        chief = task("chief", "import os, time, tensorflow as tf\n"
                              "tf.distribute.Server(tf.train.ClusterSpec("
                              f"{cluster!r}), 'chief', 0)\n"
                              "time.sleep(0.3)\n"
                              "os._exit(0)")
        assert chief.wait(timeout=60) == 0, chief.stdout.read()
        output, _ = worker.communicate(timeout=20)  # (before: its timeout, 60 s)
    finally:
        for process in (worker, chief):
            if process is not None and process.poll() is None:
                process.kill()
    assert worker.returncode == 0, output_tail(output)


def _children(pid):
    """Every process below `pid`."""
    found = []
    for line in subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True,
                               text=True).stdout.splitlines():
        child, parent = map(int, line.split())
        if parent == pid:
            found += [child] + _children(child)
    return found
