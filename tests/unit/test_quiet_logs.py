"""A tfdist run prints no TensorFlow C++ log line at the default log level."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
# A line of TensorFlow's C++ log ("2026-01-01 00:00:00.000000: I ...", "I0000 ...").
TF_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] |[IWEF]\d{4} )",
                         re.MULTILINE)
# A user's script: tfdist imported first, 3 epochs of fit on 2 virtual devices,
# 5 times over with a new strategy each (a notebook's cell run again).
USER_SCRIPT = """
import tfdist
import keras, numpy as np
tfdist.use_virtual_devices(2)
x = np.random.rand(64, 4).astype("float32"); y = np.random.rand(64, 2).astype("float32")
for _ in range(5):
    strategy = tfdist.Strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
    model.fit(x, y, batch_size=16, epochs=3, verbose=0)
print("trained")
"""


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    return dict(env, **extra)


def run(args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=clean_env())


def test_example_prints_no_tensorflow_log_line():
    done = run(["keras_examples/data_parallel.py", "--devices=2", "--epochs=3"])
    assert done.returncode == 0, done.stderr
    assert "epoch 3:" in done.stdout
    assert not TF_LOG_LINE.search(done.stdout + done.stderr), done.stdout + done.stderr


def test_script_importing_tfdist_first_prints_no_tensorflow_log_line():
    done = run(["-c", USER_SCRIPT])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "trained"
    assert not TF_LOG_LINE.search(done.stdout + done.stderr), done.stderr
    assert "retracing" not in done.stderr, done.stderr  # tfdist's own functions


def test_the_users_level_wins():
    code = "import os, tfdist; print(os.environ['TF_CPP_MIN_LOG_LEVEL'])"
    default = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60, env=clean_env())
    assert default.stdout.strip() == "2", default.stderr
    own = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=clean_env(TF_CPP_MIN_LOG_LEVEL="0"))
    assert own.stdout.strip() == "0", own.stderr
    after_tf = subprocess.run(
        [sys.executable, "-c", "import os, tensorflow, tfdist; "
                               "print(os.environ.get('TF_CPP_MIN_LOG_LEVEL'))"],
        capture_output=True, text=True, timeout=120, env=clean_env())
    assert after_tf.stdout.strip() == "None"  # TensorFlow already read it: untouched
