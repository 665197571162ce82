"""A weights file that cannot be read, given to `load_weights` under a tfdist
strategy, is named and said to be truncated or corrupt."""

import re
import zipfile

import keras
import numpy as np
import pytest

import tfdist

X, Y = np.ones((8, 4), "float32"), np.zeros((8, 2), "float32")


def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
                              keras.layers.Dense(2)])
    model.compile("adam", "mse")
    return model


def saved(tmp_path, suffix):
    path = tmp_path / f"model{suffix}"
    model = build()
    model.fit(X, Y, verbose=0)
    if suffix == ".keras":
        model.save(path)
    else:
        model.save_weights(path)
    return path, model


def under(config, fitted):
    strategy = tfdist.Strategy(devices=["CPU:0", "CPU:1", "CPU:2", "CPU:3"][
        :config.get("data", 1) * config.get("tensor", 1)], **config)
    with strategy.scope():
        model = build()
    if fitted:  # optimizer state sharded (zero), layers split (tensor)
        model.fit(X, Y, verbose=0)
    return model


@pytest.mark.parametrize("suffix", [".weights.h5", ".keras"])
@pytest.mark.parametrize("damage", ["first_half", "empty"])
def test_a_truncated_file_is_named(tmp_path, suffix, damage):
    path, _ = saved(tmp_path, suffix)
    content = path.read_bytes()
    path.write_bytes(content[:len(content) // 2] if damage == "first_half" else b"")
    model = under({"data": 2}, fitted=False)
    with pytest.raises(OSError, match=rf"^The weights file '{re.escape(str(path))}' is "
                                      rf"truncated or corrupt: it cannot be read") as raised:
        model.load_weights(path)
    assert isinstance(raised.value.__cause__, (OSError, zipfile.BadZipFile))


@pytest.mark.parametrize("config", [{"data": 2, "zero": 1}, {"data": 2, "tensor": 2}],
                         ids=["zero", "tensor"])
def test_a_truncated_file_is_named_where_state_is_split(tmp_path, config):
    path, trained = saved(tmp_path, ".weights.h5")
    model = under(config, fitted=True)
    model.load_weights(path)  # whole: loads, resharded
    for loaded, expected in zip(model.get_weights(), trained.get_weights()):
        np.testing.assert_allclose(loaded, expected)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(OSError, match="is truncated or corrupt"):
        model.load_weights(path)


def test_a_missing_file_keeps_its_own_error(tmp_path):
    model = under({"data": 2}, fitted=False)
    with pytest.raises(FileNotFoundError):
        model.load_weights(tmp_path / "missing.weights.h5")
