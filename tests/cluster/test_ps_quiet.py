"""A parameter-server job's output has no TensorFlow SessionOptions dumps."""

import subprocess
import sys

import pytest

from helpers import TFDIST

pytestmark = pytest.mark.multiprocess

FIT_A_FEW_STEPS = """
import keras, numpy as np, tfdist
strategy = tfdist.ParameterServerStrategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
model.fit(np.ones((64, 4), "float32"), np.ones((64, 2), "float32"), batch_size=8,
          epochs=1, steps_per_epoch=4, verbose=0)
print("iterations", int(model.optimizer.iterations))
"""


def test_ps_job_output_has_no_session_options_dump():
    done = subprocess.run([*TFDIST, "launch", "--chief", "--workers=1", "--ps=1",
                           "--timeout=240", "--", sys.executable, "-c", FIT_A_FEW_STEPS],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "[chief:0] iterations 4" in done.stdout
    assert "SessionOptions" not in done.stdout
    assert "eager_service_impl" not in done.stdout
