"""Fault drill: a worker SIGKILLed mid-training; the job restarts and resumes."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from helpers import TFDIST, alive

TRAIN = os.path.join(os.path.dirname(__file__), "..", "keras_examples", "tfjob", "train.py")


@pytest.mark.multiprocess
def test_killed_worker_is_restarted_and_every_task_resumes_from_one_backup(tmp_path):
    env = dict(os.environ, TFDIST_LOGDIR=str(tmp_path))
    launcher = subprocess.Popen(
        [*TFDIST, "launch", "--workers=2",
         "--restart-on-failure=2", "--timeout=300", "--",
         sys.executable, TRAIN, "--epochs=5", "--batch_size=64"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    output, killed = "", None
    try:
        for line in launcher.stdout:
            output += line
            if killed is None and line.startswith("[worker:1] epoch 2 done"):
                killed = int(re.search(r"started worker:1 \(pid (\d+)\)", output)[1])
                os.kill(killed, signal.SIGKILL)
        launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert killed is not None, output
    assert launcher.returncode == 0, output
    assert "[launch] worker:1 exited with code 137: restart 1 of 2" in output
    # Both tasks resumed from the same backup (after epoch 2) and stayed in step.
    finals = re.findall(r"^\[(worker:\d)\] \1: 2 replicas, .*; losses (\[.*\])$", output, re.M)
    assert len(finals) == 2, output
    assert finals[0][1] == finals[1][1] and len(json.loads(finals[0][1])) == 3
    pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", output)]
    assert not any(alive(p) for p in pids)
    assert (tmp_path / "digits.keras").exists()
    assert not (tmp_path / "backup").exists()  # removed once training finished
