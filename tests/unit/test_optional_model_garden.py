"""The TensorFlow Model Garden is an optional dependency (the `model-garden`
extra): a strategy's training never imports it, and `tfdist.model_garden`
without it says what to install."""

import subprocess
import sys

# A user's script: fit under a strategy, then which Model Garden packages got
# imported; then tfdist.model_garden with `official` refused, as where it is
# not installed.
SCRIPT = """
import sys
import keras, numpy as np
import tfdist
tfdist.use_virtual_devices(2)
strategy = tfdist.Strategy(data=2)
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
model.fit(np.ones((8, 4), "float32"), np.ones((8, 2), "float32"), batch_size=4, verbose=0)
print("imported:", sorted(name for name in ("official", "orbit", "tf_keras")
                          if name in sys.modules))
sys.modules["official"] = None
import tfdist.model_garden
"""


def test_training_does_not_import_it_and_its_module_says_what_to_install():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=180)
    assert "imported: []" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 1
    assert ("ImportError: tfdist.model_garden needs the TensorFlow Model Garden "
            "(`official.core`), which tfdist leaves optional: pip install "
            "'tfdist[model-garden]'") in done.stderr, done.stderr[-2000:]
