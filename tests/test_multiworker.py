"""MultiWorkerStrategy: 2 worker processes on localhost match a 2-device run."""

import json
import pathlib

import numpy as np
import pytest

import tfdist
from cluster import run_workers
from helpers import assert_parity, devices, train

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "multiworker_fit.py"


@pytest.mark.multiprocess
@pytest.mark.parametrize("microbatches", [1, 2])
def test_two_workers_match_one_process_with_two_devices(tmp_path, microbatches):
    out = tmp_path / "worker0.json"
    results = run_workers(SCRIPT, 2, [f"--out={out}", f"--microbatches={microbatches}"])
    for index, (code, output) in enumerate(results):
        assert code == 0, f"worker {index} failed:\n{output[-3000:]}"
    workers = json.loads(out.read_text())
    assert workers["replicas"] == 2
    local = train(tfdist.Strategy(data=2, microbatches=microbatches, devices=devices(2)))
    # Across processes the all-reduce is the same two-term sum: tight tolerance.
    assert_parity((workers["losses"], [np.array(w) for w in workers["weights"]], None),
                  local, rtol=1e-5)
