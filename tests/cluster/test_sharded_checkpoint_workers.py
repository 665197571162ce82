"""Sharded checkpoints of launched jobs: under `zero=3` on 4 workers each
worker writes its own shards; a worker killed while a save is written leaves
the previous checkpoint in use; a job of 3 workers with `zero=1` resumes from
it exactly as one uninterrupted device trains, and its checkpoint loads into
one device; Top-K compression's residuals, each worker's own, are saved and a
resumed job continues them."""

import json
import os
import sys

import keras
import numpy as np
import pytest

from helpers import StepLosses, run_tfdist
from tfdist.checkpoint import ShardedCheckpoint

pytestmark = pytest.mark.multiprocess

# argv: checkpoint directory, phase ("first": segment 0, save, segment 1, a
# save during which worker 1 is killed; "resume": restore, segments 1 and 2,
# save; "frozen": a save during which worker 1 stops; "gone": a save during
# which worker 1 exits; "segment1": restore, or
# segment 0 and a save when there is no checkpoint, then segment 1).
JOB = """
import json, os, signal, sys
import keras, numpy as np, tensorflow as tf
import tfdist
from tfdist.checkpoint import ShardedCheckpoint
directory, phase = sys.argv[1], sys.argv[2]
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
strategy = tfdist.MultiWorkerStrategy(config=tfdist.ParallelConfig.from_env(),
                                      timeout_seconds=20)
with strategy.scope():
    keras.utils.set_random_seed(0 if phase == "first" else 1)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(64, activation="tanh"), keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.default_rng(0)
x = rng.normal(size=(288, 16)).astype("float32")
y = (x[:, :4] + 0.3 * rng.normal(size=(288, 4))).argmax(-1).astype("int32")
checkpoints = ShardedCheckpoint(model, directory)


def fit(segment):
    losses = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: losses.append(float(logs["loss"])))
    part = slice(segment * 96, (segment + 1) * 96)
    model.fit(x[part], y[part], batch_size=16, shuffle=False, verbose=0, callbacks=[callback])
    return losses


if phase == "gone":  # worker 1 exits (code 0: the job goes on) as it starts writing its part
    checkpoints = ShardedCheckpoint(model, directory, timeout_seconds=60)
    fit(0)
    if index == 1:
        tf.raw_ops.SaveV2 = lambda **kwargs: os._exit(0)
    checkpoints.save()
    checkpoints.wait()
    print("committed", flush=True)
elif phase == "frozen":  # worker 1 stops as it starts writing its part
    checkpoints = ShardedCheckpoint(model, directory, timeout_seconds=8)
    fit(0)
    if index == 1:
        tf.raw_ops.SaveV2 = lambda **kwargs: signal.pause()
    checkpoints.save()
    checkpoints.wait()
    print("committed", flush=True)
elif phase == "first":
    fit(0)
    checkpoints.save(metadata={"segment": 0})
    checkpoints.wait()
    print("saved", checkpoints.latest(), flush=True)
    fit(1)
    if index == 1:  # killed as it starts writing its part of the second save
        tf.raw_ops.SaveV2 = lambda **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    checkpoints.save(metadata={"segment": 1})
    checkpoints.wait()
    print("second save committed", flush=True)
elif phase == "segment1":
    found = checkpoints.restore()
    if found is None:
        fit(0)
        checkpoints.save(metadata={"segment": 0})
        checkpoints.wait()
    from tfdist.sharding.replica_state import state_of
    losses = fit(1)
    residual = sum(float(np.abs(v.numpy()).sum()) for v in state_of(model).variables.values())
    if index == 0:
        print("SEGMENT1", json.dumps({"found": found, "losses": losses, "residual": residual}),
              flush=True)
else:
    found = checkpoints.restore()
    losses = fit(1) + fit(2)
    checkpoints.save(metadata={"segment": 2})
    checkpoints.wait()
    if index == 0:
        print("RESUMED", json.dumps({"found": found, "losses": losses}), flush=True)
"""


def _make(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(64, activation="tanh"), keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(288, 16)).astype("float32")
    y = (x[:, :4] + 0.3 * rng.normal(size=(288, 4))).argmax(-1).astype("int32")
    return x, y


@pytest.mark.alone  # a worker killed at a set moment; 7 tasks in all (29 s alone, 65-78 in a round)
def test_a_worker_killed_during_a_save_leaves_the_last_checkpoint_and_the_job_resumes(tmp_path):
    first = run_tfdist("launch", "--workers=4", "--zero=3", "--timeout=150", "--",
                       sys.executable, "-c", JOB, str(tmp_path), "first", timeout=200)
    output = first.stdout + first.stderr
    assert first.returncode != 0, output[-3000:]
    assert first.stdout.count("saved ckpt-6-") == 4, output[-3000:]
    assert "second save committed" not in output
    assert "worker:1 failed with exit code 137" in output, output[-3000:]
    (committed,) = [e for e in os.listdir(tmp_path) if e.startswith("ckpt-")]
    assert committed.startswith("ckpt-6-") and (tmp_path / "latest").read_text() == committed
    # Each worker wrote its own quarter of the shards (zero=3 over 4 workers).
    data = sorted(e for e in os.listdir(tmp_path / committed) if ".data-" in e)
    assert data == [f"ckpt.data-0000{k}-of-00004" for k in range(4)]
    sizes = [os.path.getsize(tmp_path / committed / e) for e in data]
    parameters = 16 * 64 + 64 + 64 * 64 + 64 + 64 * 4 + 4
    assert sum(sizes) >= 3 * 4 * parameters  # weights, Adam's m and v, in float32
    assert max(sizes) <= 0.27 * sum(sizes), sizes

    # Resumed by another layout: 3 workers (uneven batches of 16), zero=1.
    resumed = run_tfdist("launch", "--workers=3", "--zero=1", "--timeout=150", "--",
                         sys.executable, "-c", JOB, str(tmp_path), "resume", timeout=200)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-3000:]
    (line,) = [line for line in resumed.stdout.splitlines() if "RESUMED " in line]
    result = json.loads(line.split("RESUMED ", 1)[1])
    assert result["found"] == {"step": 6, "segment": 0}
    # One device, uninterrupted: segments 0, 1 and 2 (each fit reports its
    # own running mean).
    x, y = _data()
    reference, losses = _make(0), []
    for segment in range(3):
        recorder = StepLosses()
        part = slice(segment * 96, (segment + 1) * 96)
        reference.fit(x[part], y[part], batch_size=16, shuffle=False, verbose=0,
                      callbacks=[recorder])
        if segment:
            losses += recorder.losses
    np.testing.assert_allclose(result["losses"], losses, rtol=1e-4)
    # The job's last checkpoint, loaded into one device and plain Keras.
    loaded = _make(1)
    assert ShardedCheckpoint(loaded, tmp_path).restore() == {"step": 18, "segment": 2}
    for value, expected in zip(loaded.weights + loaded.optimizer.variables,
                               reference.weights + reference.optimizer.variables):
        np.testing.assert_allclose(value.numpy(), expected.numpy(), rtol=1e-4, atol=1e-6)


def test_a_worker_that_stops_during_a_save_fails_it_within_the_timeout_naming_it(tmp_path):
    done = run_tfdist("launch", "--workers=2", "--zero=3", "--timeout=150", "--",
                      sys.executable, "-c", JOB, str(tmp_path), "frozen", timeout=200)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert "committed" not in done.stdout
    assert ("TimeoutError: Waited 8 s for the other tasks' parts of checkpoint 'ckpt-6-"
            in output and "(missing: task 1)" in output), output[-3000:]
    assert not (tmp_path / "latest").exists()


def test_topk_residuals_are_saved_by_each_worker_and_a_resumed_job_continues_them(tmp_path):
    def segment1():
        done = run_tfdist("launch", "--workers=2", "--compression=topk:0.05", "--timeout=150",
                          "--", sys.executable, "-c", JOB, str(tmp_path), "segment1",
                          timeout=200)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        (line,) = [line for line in done.stdout.splitlines() if "SEGMENT1 " in line]
        return json.loads(line.split("SEGMENT1 ", 1)[1])

    whole = segment1()  # segment 0, a save, segment 1
    assert whole["found"] is None
    (committed,) = [e for e in os.listdir(tmp_path) if e.startswith("ckpt-")]
    index = json.loads((tmp_path / committed / "index.json").read_text())
    state = [v for v in index["variables"] if v["key"].startswith("state/")]
    assert [v["shape"][0] for v in state] == [2] * 6  # a row per worker, per weight
    resumed = segment1()  # restored, then segment 1 with the saved residuals
    assert resumed["found"] == {"step": 6, "segment": 0}
    np.testing.assert_allclose(resumed["losses"], whole["losses"], rtol=1e-6)
    # The residuals left after segment 1 (what was not sent yet): the same.
    assert whole["residual"] > 0
    np.testing.assert_allclose(resumed["residual"], whole["residual"], rtol=1e-6)


def test_a_worker_gone_during_a_save_fails_it_at_once_naming_it(tmp_path):
    # Task 0 waits for the other tasks' parts of a save; a task that is down
    # (or restarted) will never write its part: the wait ends at the next
    # check of the peers, not at the save's 60 s timeout.
    done = run_tfdist("launch", "--workers=2", "--zero=1", "--timeout=150", "--",
                      sys.executable, "-c", JOB, str(tmp_path), "gone", timeout=200)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert "committed" not in done.stdout
    assert ("RuntimeError: Stopped waiting for the other tasks' parts of checkpoint 'ckpt-6-"
            in output and "task worker:1 (" in output), output[-3000:]
    assert "Waited 60 s" not in output
    assert not (tmp_path / "latest").exists()
