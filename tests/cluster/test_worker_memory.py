"""What a launched worker's TensorFlow holds between the steps of `fit` is its
state and nothing more: the bytes of the variable components on its device
(parameters, gradients' slots), counted by TensorFlow's own allocator."""

import json
import sys

import pytest

from helpers import run_tfdist

pytestmark = pytest.mark.multiprocess

# Worker 0 prints, after each step of fit, the bytes TensorFlow's CPU
# allocator has handed out and not taken back, and the bytes of the
# components of every model and optimizer variable held on this worker.
JOB = """
import gc, json, os
import keras, numpy as np, tensorflow as tf
import tfdist
from tfdist._compat.tf_variables import storage_of

# Python's cyclic collector runs rarely in a process of many long-lived
# objects (a full collection waits for a quarter more of them): off here, so
# nothing the strategy leaves in reference cycles is freed behind its back.
gc.disable()

strategy = tfdist.MultiWorkerStrategy(config=tfdist.ParallelConfig.from_env())
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
with strategy.scope():
    model = keras.Sequential([keras.Input((1024,))] + [
        keras.layers.Dense(1024, activation="relu") for _ in range(4)])
    model.compile(optimizer="adam", loss="mse")


def held_bytes():
    total = 0
    for variable in model.weights + model.optimizer.variables:
        storage = storage_of(variable)
        for component in getattr(storage, "values", (storage,)):
            total += component.shape.num_elements() * component.dtype.size
    return total


in_use = []
callback = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: in_use.append(
    tf.config.experimental.get_memory_info("CPU:0")["current"]))
x = np.ones((64, 1024), "float32")
model.fit(x, x, batch_size=16, epochs=1, verbose=0, callbacks=[callback])
if index == 0:
    print("HELD " + json.dumps({"in_use": in_use, "state": held_bytes()}), flush=True)
"""


def test_a_tensor_split_worker_holds_its_state_between_steps():
    done = run_tfdist("launch", "--workers=2", "--tensor=2", "--timeout=150", "--",
                      sys.executable, "-c", JOB, timeout=200)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if "HELD " in line]
    held = json.loads(line.split("HELD ", 1)[1])
    # Half of each weight and of Adam's slots: 3 x 8 MiB. Reading the scope's
    # element shards whole to split them used to leave every gathered value
    # and the replaced shards in reference cycles until Python's cyclic
    # collector ran: 74 MiB in use between steps.
    assert 3 * 2**23 <= held["state"] <= 3 * 2**23 + 2**16, held
    assert len(held["in_use"]) == 4
    for in_use in held["in_use"]:
        assert in_use <= held["state"] + 2**22, held  # + the data (0.5 MiB), small tensors
