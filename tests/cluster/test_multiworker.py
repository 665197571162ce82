"""MultiWorkerStrategy under `tfdist launch --workers 2` matches a 2-device run."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import tfdist
from helpers import TFDIST, assert_parity, data, devices, train, trained_reference
from tfdist.callbacks.metrics import optimizer_state_bytes
from tfdist.optim.zero3 import each_unit_weights
from tfdist.sharding.peak import ALL_REDUCE_COPIES

SCRIPT = pathlib.Path(__file__).parents[1] / "scripts" / "multiworker_fit.py"


@pytest.mark.multiprocess
@pytest.mark.parametrize("microbatches,zero", [(1, 0), (2, 0), (1, 1), (2, 3)])
def test_two_launched_workers_match_one_process_with_two_devices(tmp_path, microbatches, zero):
    out = tmp_path / "worker0.json"
    done = subprocess.run(
        [*TFDIST, "launch", "--workers=2", "--timeout=240",
         f"--microbatches={microbatches}", f"--zero={zero}", "--",
         sys.executable, str(SCRIPT), f"--out={out}"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    workers = json.loads(out.read_text())
    assert workers["replicas"] == 2
    if (microbatches, zero) == (1, 0):
        # Three collectives a step cross the workers: the input's agreement
        # that both have a batch (tf.distribute's), the batch's row count, and
        # the gradients packed with the metric states; Keras's mean of each
        # reported metric over the replicas needs none (each collective key
        # TensorFlow has seen costs memory for good: docs/benchmarks.md).
        assert workers["collectives"] == {"CollectiveReduceV2": 3}
    # zero=1 shards the optimizer state across the two processes (zero=3 the
    # parameters too); the local run does not, so this is also zero against zero=0.
    local = train(tfdist.Strategy(data=2, microbatches=microbatches, devices=devices(2)))
    # Across processes the all-reduce is the same two-term sum: tight tolerance.
    assert_parity((workers["losses"], [np.array(w) for w in workers["weights"]], None),
                  local, rtol=1e-5)
    for value, ref in zip(workers["optimizer"], local[2].optimizer.variables):
        np.testing.assert_allclose(value, ref.numpy(), rtol=1e-5, atol=1e-6)
    (worker_bytes,) = workers["optimizer_bytes"].values()  # its one device
    local_bytes = max(optimizer_state_bytes(local[2].optimizer).values())
    scalars = 8 + 4  # iterations, learning rate
    if zero:  # each worker holds half of the momentum slots
        assert worker_bytes - scalars == (local_bytes - scalars) // 2
    else:
        assert worker_bytes == local_bytes
    (parameter_bytes,) = workers["parameter_bytes"].values()
    whole = sum(w.numpy().nbytes for w in local[2].trainable_weights)
    # (the test MLP's variables split evenly in two)
    assert parameter_bytes == (whole // 2 if zero == 3 else whole)
    # The replicas are in two processes: the predicted peak counts gRPC's
    # copies of the largest data collective's messages (the packed
    # gradients' all-reduce, in halves; under zero=3 the shard of its
    # largest unit, a Dense layer, received from the other worker).
    if zero == 3:
        largest = max(sum(w.numpy().nbytes for w in weights) for weights in
                      each_unit_weights(tfdist.ParallelConfig(zero=3), local[2]))
        assert workers["transport"] == -(-largest // 2) < -(-whole // 2)
    else:
        assert workers["transport"] == ALL_REDUCE_COPIES * -(-whole // 2)


@pytest.mark.multiprocess
def test_uneven_batches_across_workers_match_one_process(tmp_path):
    # Global batch 17 = 9 + 8 rows on the two workers, and a last batch of 10.
    out = tmp_path / "worker0.json"
    done = subprocess.run(
        [*TFDIST, "launch", "--workers=2", "--timeout=240", "--",
         sys.executable, str(SCRIPT), f"--out={out}", "--examples=61", "--batch_size=17"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    workers = json.loads(out.read_text())
    x, y = data(61)
    reference = trained_reference(x=x, y=y, batch_size=17)
    assert_parity((workers["losses"], [np.array(w) for w in workers["weights"]], None),
                  reference, steps=4)


@pytest.mark.multiprocess
def test_two_launched_workers_with_two_stages_each_match_one_process(tmp_path):
    out = tmp_path / "worker0.json"
    done = subprocess.run(
        [*TFDIST, "launch", "--workers=2", "--timeout=240", "--pipeline=2",
         "--microbatches=2", "--schedule=1f1b", "--",
         sys.executable, str(SCRIPT), f"--out={out}"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    workers = json.loads(out.read_text())
    assert workers["replicas"] == 2
    local = train(tfdist.Strategy(data=2, pipeline=2, microbatches=2, schedule="1f1b",
                                  devices=devices(4)))
    assert_parity((workers["losses"], [np.array(w) for w in workers["weights"]], None),
                  local, rtol=1e-5)
    # Pipeline within the host: each worker's optimizer state on its two stage devices.
    assert sorted(workers["optimizer_bytes"]) == ["CPU:0", "CPU:1"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("workers, zero", [(2, 0), (4, 1)])
def test_tensor_groups_across_workers_match_one_process(tmp_path, workers, zero):
    # One CPU replica per worker: 2 workers form one tensor group; 4 form two
    # tensor groups (workers 0-1, 2-3) and two data groups (0-2, 1-3), with
    # zero=1 each data group shards its state across its two workers. Each
    # worker seeds its build differently: the weights, created as shards, must
    # start from the chief's values as one process's (sent in blocks of rows,
    # here of 1 KiB: several per kernel, each task keeping its shard's part).
    out = tmp_path / "worker0.json"
    done = subprocess.run(
        [*TFDIST, "launch", f"--workers={workers}", "--timeout=240", "--tensor=2",
         f"--zero={zero}", "--", sys.executable, str(SCRIPT), f"--out={out}",
         "--seed_per_task", "--reshard_block_bytes=1024"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["replicas"] == workers
    local = train(tfdist.Strategy(data=workers // 2, tensor=2, devices=devices(workers)))
    assert_parity((result["losses"], [np.array(w) for w in result["weights"]], None),
                  local, rtol=1e-5)
    for value, ref in zip(result["optimizer"], local[2].optimizer.variables):
        np.testing.assert_allclose(value, ref.numpy(), rtol=1e-5, atol=1e-6)
    # Worker 0 holds tensor rank 0's shards of the state, as device 0 of the
    # one-process run; with zero, half of them (the rest is on worker 2).
    local_bytes = optimizer_state_bytes(local[2].optimizer)["CPU:0"]
    (size,) = result["optimizer_bytes"].values()
    scalars = 8 + 4  # iterations, learning rate
    if zero:
        padding = 4 * 6  # at most one float32 per slot (6 momentum slots)
        assert (local_bytes - scalars) // 2 <= size - scalars <= (
            local_bytes - scalars) // 2 + padding
    else:
        assert size == local_bytes
