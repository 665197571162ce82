"""A multi-worker `fit` at length: nothing grows per step, nothing waits forever.

Both run `tools/bench_soak.py` (the soak benchmark's own worker) under
`tfdist launch` with 2 workers.
"""

import json
import pathlib
import subprocess
import sys
import time

import pytest

from helpers import TFDIST

SOAK = pathlib.Path(__file__).parents[2] / "tools" / "bench_soak.py"


@pytest.mark.multiprocess
@pytest.mark.parametrize("job", [["--zero=0"], ["--zero=3", "--checkpoint_every=50"]],
                         ids=["zero0", "zero3-saving"])
def test_a_long_multiworker_fit_keeps_threads_rss_and_open_files_flat(tmp_path, job):
    # 800 steps with Adam: every step runs collectives (gradients, metrics).
    # Each collective used to leave a thread sleeping for the whole collective
    # timeout: hundreds of threads after 100 steps, thousands after 800. With
    # zero=3, 16 asynchronous sharded saves as well (a thread and files each).
    out = tmp_path / "soak.jsonl"
    done = subprocess.run(
        [sys.executable, str(SOAK), "--steps=800", "--sample_every=100", "--warmup=200",
         f"--out={out}", *job], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    samples = [r for r in records if r["bench"] == "soak"]
    growth = {r["task"]: r for r in records if r["bench"] == "soak_growth"}
    assert sorted(growth) == ["worker:0", "worker:1"]
    for task, grown in growth.items():
        task_samples = [s for s in samples if s["task"] == task]
        assert [s["step"] for s in task_samples] == list(range(0, 801, 100))
        assert grown["threads"] <= 0.05, task_samples
        assert grown["fds"] <= 0.05, task_samples
        assert grown["rss_bytes"] <= 0.05, task_samples
        # and no growth while warming up either: the threads TensorFlow's
        # runtime starts, not one per step
        assert max(s["threads"] for s in task_samples) < 300, task_samples
        if "--checkpoint_every=50" in job:  # 3 kept, `latest`, one save in flight
            assert max(s["checkpoint_entries"] for s in task_samples) <= 5, task_samples


@pytest.mark.multiprocess
def test_a_task_that_stops_taking_part_fails_the_others_within_the_timeout(tmp_path):
    # worker:1 stays alive (its heartbeats go on) but sleeps before step 20:
    # worker:0 waits in that step's collectives until its watchdog aborts them.
    started = time.monotonic()
    done = subprocess.run(
        [*TFDIST, "launch", "--workers=2", "--timeout=240", "--",
         sys.executable, str(SOAK), f"--samples={tmp_path}", "--steps=200",
         "--stall_task=1", "--stall_at=20", "--stall_seconds=600",
         "--timeout_seconds=30"],
        capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert "[worker:0] tfdist.cluster.watchdog.StepTimeoutError: a step of fit did not " \
           "finish within 30 s" in output, output[-5000:]
    assert "worker:0 failed" in output, output[-3000:]
    assert elapsed < 200, (elapsed, output[-3000:])  # the stall would last 600 s
    assert not list(tmp_path.glob("worker*.json"))  # neither task finished
