"""One worker of `bench_compression.py --link_mbit`: its median step time.

    TF_CONFIG=... python tools/linked_worker.py --compression=int8 [--steps=30]

Trains an MLP whose gradients are large for its compute (512 inputs, two
Dense(1024), 10 classes: 1.6 M parameters, 6.3 MB of float32 gradients; a
global batch of 32) with `tfdist.MultiWorkerStrategy(compression=...)`, SGD
0.01 with momentum 0.9, for `--warmup` then `--steps` steps of one epoch of
`model.fit`; prints as JSON the median of the timed steps (from one step's end,
its loss read, to the next's).
"""

import json
import os
import time

import keras
import numpy as np
from absl import app, flags

import tfdist

flags.DEFINE_string("compression", "none", "MultiWorkerStrategy(compression=).")
flags.DEFINE_integer("steps", 30, "Timed steps.")
flags.DEFINE_integer("warmup", 5, "Steps before the timed ones.")
flags.DEFINE_float("timeout_seconds", 600, "MultiWorkerStrategy(timeout_seconds=).")
FLAGS = flags.FLAGS
BATCH, INPUTS, WIDTH, CLASSES = 32, 512, 1024, 10


class StepEnds(keras.callbacks.Callback):
    """When each step ended (its loss read, so finished)."""

    def __init__(self):
        super().__init__()
        self.times = []

    def on_train_batch_end(self, batch, logs=None):
        float(logs["loss"])
        self.times.append(time.perf_counter())


def main(argv):
    del argv
    strategy = tfdist.MultiWorkerStrategy(compression=FLAGS.compression,
                                          timeout_seconds=FLAGS.timeout_seconds)
    rng = np.random.default_rng(0)
    rows = BATCH * (FLAGS.warmup + FLAGS.steps + 1)
    x = rng.normal(size=(rows, INPUTS)).astype("float32")
    y = rng.integers(0, CLASSES, size=rows).astype("int32")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((INPUTS,)), keras.layers.Dense(WIDTH, activation="relu"),
            keras.layers.Dense(WIDTH, activation="relu"), keras.layers.Dense(CLASSES)])
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ends = StepEnds()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[ends])
    steps = np.diff(ends.times[FLAGS.warmup:])
    print(json.dumps({"task": json.loads(os.environ["TF_CONFIG"])["task"],
                      "steps": len(steps),
                      "step_seconds": float(np.median(steps))}), flush=True)


if __name__ == "__main__":
    app.run(main)
