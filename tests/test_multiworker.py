"""MultiWorkerStrategy under `tfdist launch --workers 2` matches a 2-device run."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import tfdist
from helpers import TFDIST, assert_parity, devices, train

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "multiworker_fit.py"


@pytest.mark.multiprocess
@pytest.mark.parametrize("microbatches", [1, 2])
def test_two_launched_workers_match_one_process_with_two_devices(tmp_path, microbatches):
    out = tmp_path / "worker0.json"
    done = subprocess.run(
        [*TFDIST, "launch", "--workers=2", "--timeout=240",
         f"--microbatches={microbatches}", "--",
         sys.executable, str(SCRIPT), f"--out={out}"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    workers = json.loads(out.read_text())
    assert workers["replicas"] == 2
    local = train(tfdist.Strategy(data=2, microbatches=microbatches, devices=devices(2)))
    # Across processes the all-reduce is the same two-term sum: tight tolerance.
    assert_parity((workers["losses"], [np.array(w) for w in workers["weights"]], None),
                  local, rtol=1e-5)
