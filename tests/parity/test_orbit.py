"""A tfdist strategy drives an orbit custom loop to the single-device numbers."""

import pathlib
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfdist
from helpers import devices

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "keras_examples"))
import digits  # noqa: E402
import orbit_loop  # noqa: E402

pytestmark = pytest.mark.model_garden  # conftest.py: collected where it is installed


def test_orbit_loop_matches_single_device_fit():
    strategy = tfdist.Strategy(data=4, microbatches=2, devices=devices(4))
    logs, model = orbit_loop.train(strategy, steps=100, steps_per_loop=25, batch_size=64)
    assert model.optimizer.iterations.numpy() == 100
    assert len(logs) == 4

    reference = digits.build_model()
    x, y = digits.load()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
        64, drop_remainder=True)
    history = reference.fit(dataset, steps_per_epoch=25, epochs=4, verbose=0, shuffle=False)
    np.testing.assert_allclose([log["loss"] for log in logs], history.history["loss"],
                               rtol=1e-4)
    np.testing.assert_allclose([log["accuracy"] for log in logs],
                               history.history["accuracy"], rtol=1e-4)
    for w, r in zip(model.weights, reference.weights):
        np.testing.assert_allclose(w.numpy(), r.numpy(), rtol=1e-4, atol=1e-5)
