"""Peak resident memory of pipeline training steps, with or without remat.

The peak is Linux's VmHWM, restarted after the first step (which traces and
optimises the step function) so it covers training steps only.

    python tests/scripts/pipeline_memory.py --remat      # prints: peak_rss_mib <n>

A model whose activations dwarf its weights (wide elementwise layers): GPipe
keeps every microbatch's activations until its backward; remat keeps only each
stage's inputs and recomputes the rest.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import tfdist  # noqa: E402

flags.DEFINE_bool("remat", False, "Recompute each stage's forward in its backward.")
FLAGS = flags.FLAGS
WIDTH, ROWS, MICROBATCHES = 4096, 8192, 16


def main(argv):
    del argv
    tfdist.use_virtual_devices(2)
    strategy = tfdist.Strategy(pipeline=2, microbatches=MICROBATCHES, schedule="gpipe",
                               remat=FLAGS.remat, stage_boundaries=["stage1"])
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(WIDTH),
            *[keras.layers.Activation("tanh") for _ in range(16)],
            keras.layers.Activation("tanh", name="stage1"),
            *[keras.layers.Activation("tanh") for _ in range(15)],
            keras.layers.Dense(10),
        ])
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS * 2, 64)).astype("float32")
    y = rng.integers(0, 10, size=ROWS * 2).astype("int32")
    model.fit(x[:ROWS], y[:ROWS], batch_size=ROWS, epochs=1, verbose=0)  # traces the step
    with open("/proc/self/clear_refs", "w") as f:  # restart the peak: training steps only
        f.write("5")
    model.fit(x, y, batch_size=ROWS, epochs=1, verbose=0)
    with open("/proc/self/status") as f:
        peak_kib = int(next(line for line in f if line.startswith("VmHWM:")).split()[1])
    print(f"peak_rss_mib {peak_kib / 1024:.0f}")
    sys.stdout.flush()


if __name__ == "__main__":
    app.run(main)
