"""tfdist.callbacks.Metrics: scalars read back with TensorBoard's event reader."""

import resource

import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

import tfdist
from helpers import data, devices, make_model


def read_scalars(run_dir):
    """{tag: [(step, value)]} through TensorBoard's own event reader."""
    events = event_accumulator.EventAccumulator(
        str(run_dir), size_guidance={event_accumulator.TENSORS: 0})
    events.Reload()
    return {tag: [(e.step, float(tf.make_ndarray(e.tensor_proto)))
                  for e in events.Tensors(tag)]
            for tag in events.Tags()["tensors"]}


def fit(precision, logdir, epochs=2, steps=20):
    strategy = tfdist.Strategy(data=2, microbatches=2, precision=precision,
                               devices=devices(2))
    with strategy.scope():
        model = make_model()
    x, y = data(32 * steps)
    model.fit(x, y, batch_size=32, epochs=epochs, verbose=0,
              callbacks=[tfdist.callbacks.Metrics(logdir, every_n_steps=5)])
    return model


def test_scalars_are_written_and_read_back(tmp_path):
    model = fit("float32", tmp_path)
    scalars = read_scalars(tmp_path / "tfdist")
    # 2 epochs x 20 steps: writes at steps 5, 10, ..., 40 (step 1 traces);
    # the constants also at step 1, and at every write (a line, not a point).
    writes = list(range(5, 41, 5))
    assert [s for s, _ in scalars["tfdist/examples_per_second"]] == writes
    assert scalars["tfdist/microbatches"] == [(s, 2.0) for s in [1, *writes]]
    rates = [v for _, v in scalars["tfdist/examples_per_second"]]
    per_replica = [v for _, v in scalars["tfdist/examples_per_second_per_replica"]]
    np.testing.assert_allclose(per_replica, np.array(rates) / 2)
    step_times = [v for _, v in scalars["tfdist/step_time_seconds"]]
    # examples/s = 32 examples per step / step time (exact counting, across epochs)
    np.testing.assert_allclose(rates, 32 / np.array(step_times), rtol=1e-6)
    # SGD with momentum: one slot per weight, plus iteration (int64) and lr.
    expected = sum(int(np.prod(w.shape)) * 4 for w in model.trainable_weights) + 8 + 4
    for device in ("CPU:0", "CPU:1"):
        assert scalars[f"tfdist/optimizer_state_bytes/{device}"] == [
            (s, float(expected)) for s in [1, *writes]]
    assert "tfdist/loss_scale" not in scalars
    # This process's peak resident memory, at every rate write: it only grows.
    peaks = scalars["tfdist/peak_memory_bytes"]
    assert [s for s, _ in peaks] == writes
    values = [v for _, v in peaks]
    assert values == sorted(values) and values[0] > 100 * 2**20  # TensorFlow alone is more
    assert values[-1] <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 * 1.0001


def test_loss_scale_under_mixed_float16(tmp_path):
    fit("mixed_float16", tmp_path, epochs=1)
    scalars = read_scalars(tmp_path / "tfdist")
    assert [v for _, v in scalars["tfdist/loss_scale"]] == [2.0 ** 15] * 4


def test_bad_every_n_steps(tmp_path):
    with pytest.raises(ValueError, match=r"`every_n_steps` must be an int >= 1, got 0"):
        tfdist.callbacks.Metrics(tmp_path, every_n_steps=0)
