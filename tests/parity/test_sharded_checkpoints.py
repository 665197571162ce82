"""`tfdist.checkpoint.ShardedCheckpoint`: a run moved through five layouts by
sharded checkpoints continues exactly as one uninterrupted device; what is
saved is a checkpoint of full-shape tensors; a save that never commits
leaves the previous checkpoint in use; refusals."""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from helpers import StepLosses, assert_parity, data, devices, make_model, strategy_on_its_devices
from test_zero_checkpoints import _state
from tfdist.checkpoint import ShardedCheckpoint

BATCH, CHUNK = 24, 120  # 5 steps per segment; 24 divides over 2, 3 and 4 replicas
LAYOUTS = [dict(data=4, zero=3), dict(data=2, tensor=2), dict(pipeline=2, microbatches=2),
           None, dict(data=3, zero=1)]


def make(seed=0):
    return make_model(optimizer=keras.optimizers.Adam(1e-2), seed=seed)


def _fresh(config, seed=1):
    """The model under `config` (None: one device, no strategy); by default
    other initial weights than the reference's, which a restore replaces."""
    if config is None:
        return make(seed)
    with strategy_on_its_devices(**config).scope():
        return make(seed)


def _fit(model, x, y, segment):
    recorder = StepLosses()
    part = slice(segment * CHUNK, (segment + 1) * CHUNK)
    model.fit(x[part], y[part], batch_size=BATCH, shuffle=False, verbose=0, callbacks=[recorder])
    return recorder.losses


def test_five_layouts_in_a_row_continue_as_one_uninterrupted_device(tmp_path):
    x, y = data(len(LAYOUTS) * CHUNK)
    losses, saved = [], None
    for segment, config in enumerate(LAYOUTS):
        model = _fresh(config, seed=0 if segment == 0 else 1)
        checkpoints = ShardedCheckpoint(model, tmp_path, max_to_keep=2)
        found = checkpoints.restore()
        if segment == 0:
            assert found is None
        else:  # exactly the state saved under the previous layout
            assert found == {"step": segment * CHUNK // BATCH, "segment": segment - 1}
            state = _state(model)
            assert len(state) == len(saved)
            for value, expected in zip(state, saved):
                np.testing.assert_array_equal(value, expected)
        losses += _fit(model, x, y, segment)
        saved = _state(model)
        checkpoints.save(metadata={"segment": segment})
        # Training goes on while the files are written: the checkpoint keeps
        # the values of the moment `save` returned.
        model.train_on_batch(x[:BATCH], y[:BATCH])
        checkpoints.wait()
    # One device, the same five fits (Keras reports each fit's running mean).
    uninterrupted, reference = make(), []
    for segment in range(len(LAYOUTS)):
        reference += _fit(uninterrupted, x, y, segment)
    assert_parity((losses, saved[:len(model.weights)], None),
                  (reference, _state(uninterrupted)[:len(model.weights)], None), steps=25)
    # Two checkpoints kept, each TensorFlow's format of full-shape tensors.
    kept = sorted(e for e in os.listdir(tmp_path) if e.startswith("ckpt-"))
    assert len(kept) == 2 and open(tmp_path / "latest").read() in kept
    reader = tf.train.load_checkpoint(str(tmp_path / kept[-1] / "ckpt"))
    shapes = reader.get_variable_to_shape_map()
    weights = model.weights + model.optimizer.variables
    assert len(shapes) == len(weights)
    with open(tmp_path / kept[-1] / "index.json") as f:
        index = json.load(f)
    for entry, variable in zip(index["variables"], weights):
        assert shapes[entry["key"]] == list(variable.shape)


def test_a_save_that_never_commits_leaves_the_last_checkpoint_in_use(tmp_path):
    strategy = tfdist.Strategy(data=2, zero=3, devices=devices(2))
    with strategy.scope():
        model = make()
    x, y = data(96)
    model.fit(x, y, batch_size=BATCH, verbose=0)
    checkpoints = ShardedCheckpoint(model, tmp_path, asynchronous=False)
    checkpoints.save(4)
    saved = _state(model)
    # A second save whose writing stops half-way (its task killed): a staging
    # directory with part of the files, never renamed into place.
    model.fit(x, y, batch_size=BATCH, verbose=0)
    os.makedirs(tmp_path / ".staging-0123abcd" / "task-0")
    (tmp_path / ".staging-0123abcd" / "task-0" / "part.index").write_bytes(b"cut")
    restored = _fresh(dict(data=2, zero=3))
    assert ShardedCheckpoint(restored, tmp_path).restore() == {"step": 4}
    for value, expected in zip(_state(restored), saved):
        np.testing.assert_array_equal(value, expected)
    # The next commit clears what the interrupted save left.
    ShardedCheckpoint(model, tmp_path, asynchronous=False).save(8)
    assert not any(e.startswith(".staging-") for e in os.listdir(tmp_path))


def test_a_checkpoint_of_another_model_is_refused_naming_the_variable(tmp_path):
    model = make()
    model.fit(*data(48), batch_size=BATCH, verbose=0)
    ShardedCheckpoint(model, tmp_path, asynchronous=False).save(2)
    other = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8),
                              keras.layers.Dense(32), keras.layers.Dense(4)])
    other.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    with pytest.raises(ValueError, match=r"holds model/0 \('.*kernel'\) of shape \(16, 32\) "
                                         r"and dtype float32, but this model's '.*kernel' has "
                                         r"shape \(16, 8\)"):
        ShardedCheckpoint(other, tmp_path).restore()
    with pytest.raises(ValueError, match=r"`max_to_keep` must be an int >= 1, got 0"):
        ShardedCheckpoint(model, tmp_path, max_to_keep=0)
    with pytest.raises(ValueError, match=r"`directory` must be a path of a POSIX file system "
                                         r"every task shares, got 'gs://bucket/ckpt'"):
        ShardedCheckpoint(model, "gs://bucket/ckpt")


def test_backup_and_restore_of_sharded_state_resumes_on_another_layout(tmp_path):
    class Stop(Exception):
        pass

    def stop_after(epochs):
        def check(epoch, logs):
            if epoch + 1 == epochs:
                raise Stop()
        return keras.callbacks.LambdaCallback(on_epoch_end=check)

    x, y = data(96)
    fit = dict(batch_size=BATCH, shuffle=False, verbose=0)
    # Killed after epoch 2 of 4 under zero=3: the backup is each replica's shards.
    interrupted = _fresh(dict(data=4, zero=3), seed=0)
    with pytest.raises(Stop):
        interrupted.fit(x, y, epochs=4, **fit, callbacks=[
            tfdist.callbacks.BackupAndRestore(str(tmp_path)), stop_after(2)])
    assert sorted(os.listdir(tmp_path)) == ["sharded"]
    # Resumed at epoch 3 under data=2 x tensor=2.
    resumed = _fresh(dict(data=2, tensor=2))
    history = resumed.fit(x, y, epochs=4, **fit,
                          callbacks=[tfdist.callbacks.BackupAndRestore(str(tmp_path))])
    assert history.epoch == [2, 3]
    assert not tmp_path.exists()  # deleted when training ended
    uninterrupted = make()
    expected = uninterrupted.fit(x, y, epochs=4, **fit)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"][2:], rtol=1e-4)
    for value, reference in zip(resumed.weights, uninterrupted.weights):
        np.testing.assert_allclose(value.numpy(), reference.numpy(), rtol=1e-4, atol=1e-6)
