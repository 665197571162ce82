"""tfdist's BackupAndRestore checks the weights it restores against a checksum."""

import keras
import numpy as np
import pytest

import tfdist
from helpers import data, devices, make_model


def _fit(backup_dir, epochs, double_checkpoint=False):
    strategy = tfdist.Strategy(data=2, devices=devices(2))
    with strategy.scope():
        model = make_model()
    x, y = data(64)
    history = model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=[tfdist.callbacks.BackupAndRestore(
                            str(backup_dir), double_checkpoint=double_checkpoint)])
    return model, history


def _flip_a_byte(path):
    content = bytearray(path.read_bytes())
    content[len(content) // 2] ^= 0xFF
    path.write_bytes(bytes(content))


def _interrupted(backup_dir, epochs, double_checkpoint=False):
    """Trains `epochs` epochs, then stops as a killed job would (no train end:
    the backup stays)."""
    class Stop(Exception):
        pass

    strategy = tfdist.Strategy(data=2, devices=devices(2))
    with strategy.scope():
        model = make_model()
    x, y = data(64)
    stop = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: (
        _raise(Stop()) if epoch + 1 == epochs else None))
    with pytest.raises(Stop):
        model.fit(x, y, batch_size=32, epochs=10, shuffle=False, verbose=0, callbacks=[
            tfdist.callbacks.BackupAndRestore(str(backup_dir),
                                              double_checkpoint=double_checkpoint), stop])


def _raise(error):
    raise error


@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_damaged_backup_is_refused_naming_the_file(tmp_path, damage):
    _interrupted(tmp_path, epochs=2)
    weights = tmp_path / "latest.weights.h5"
    if damage == "flipped":
        _flip_a_byte(weights)   # loaded silently before (weights off by up to 1e37)
    else:
        weights.write_bytes(weights.read_bytes()[:-100])  # h5py's raw OSError before
    with pytest.raises(OSError, match="does not match the checksum its backup recorded"):
        _fit(tmp_path, epochs=4)


def test_with_a_previous_backup_a_damaged_one_falls_back_to_it(tmp_path):
    _interrupted(tmp_path, epochs=3, double_checkpoint=True)
    _flip_a_byte(tmp_path / "latest.weights.h5")
    model, history = _fit(tmp_path, epochs=4, double_checkpoint=True)
    # the previous backup is of epoch 2: epochs 3 and 4 are trained again
    assert len(history.history["loss"]) == 2
    assert all(np.isfinite(history.history["loss"]))
