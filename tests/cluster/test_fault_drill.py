"""Fault drill: a worker SIGKILLed mid-training; the job restarts and resumes.

With `zero=1` the optimizer state is sharded across the two workers: every
backup is a sharded checkpoint (each task writes its own shards while
training goes on) and the restarted job reads its shards back. The kill
waits for the first backup's commit (a slow host may still be writing it
when epoch 2 ends), and may interrupt a later save (it needs worker 1's
part): that save is never committed and the job resumes from the last one.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import keras
import pytest

from helpers import TFDIST, alive

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "keras_examples")
TRAIN = os.path.join(EXAMPLES, "tfjob", "train.py")
EPOCHS, BATCH = 5, 64
sys.path.insert(0, EXAMPLES)
import digits  # noqa: E402

pytestmark = pytest.mark.alone


def run_drill(logdir, zero):
    """Launches 2 workers for 5 epochs, SIGKILLs worker 1 after epoch 2; returns
    (launcher output, return code, killed pid)."""
    env = dict(os.environ, TFDIST_LOGDIR=str(logdir))
    launcher = subprocess.Popen(
        [*TFDIST, "launch", "--workers=2", f"--zero={zero}",
         "--restart-on-failure=2", "--timeout=300", "--",
         sys.executable, TRAIN, f"--epochs={EPOCHS}", f"--batch_size={BATCH}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    output, killed = "", None
    try:
        for line in launcher.stdout:
            output += line
            if killed is None and line.startswith("[worker:1] epoch 2 done"):
                if zero:  # the sharded backups are written while training goes on
                    _wait_for_commit(os.path.join(logdir, "backup", "sharded", "latest"))
                killed = int(re.search(r"started worker:1 \(pid (\d+)\)", output)[1])
                os.kill(killed, signal.SIGKILL)
        launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    return output, launcher.returncode, killed


def _wait_for_commit(latest, timeout=120):
    deadline = time.monotonic() + timeout
    while not os.path.exists(latest):
        assert time.monotonic() < deadline, f"no backup committed in {timeout} s ({latest})"
        time.sleep(0.05)


def final_losses(output):
    """Each task's losses of the epochs after the restart."""
    finals = re.findall(r"^\[(worker:\d)\] \1: 2 replicas, .*; losses (\[.*\])$", output, re.M)
    assert len(finals) == 2, output
    return [json.loads(losses) for _, losses in finals]


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero", [0, 1])
def test_killed_worker_is_restarted_and_every_task_resumes_from_one_backup(tmp_path, zero):
    output, returncode, killed = run_drill(tmp_path, zero)
    assert killed is not None, output
    assert returncode == 0, output
    assert "[launch] worker:1 exited with code 137: restart 1 of 2" in output
    # Both tasks resumed from the same backup (after epoch 2; with zero the
    # last committed: after epoch 1, 2 or 3) and stayed in step.
    finals = final_losses(output)
    assert finals[0] == finals[1] and len(finals[0]) in ((2, 3, 4) if zero else (3,))
    # The backup restored the optimizer state too (a truncated backup's is
    # skipped with this warning, and the step counter restarts).
    assert "Skipping variable loading for optimizer" not in output
    steps = -(-len(digits.load()[0]) // BATCH)
    trained = keras.models.load_model(tmp_path / "digits.keras")
    assert int(trained.optimizer.iterations.numpy()) == EPOCHS * steps
    pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", output)]
    assert not any(alive(p) for p in pids)
    assert not (tmp_path / "backup").exists()  # removed once training finished
