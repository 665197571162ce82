"""Fits the test MLP under tfdist.Strategy with the flags given; prints the losses.

Used by tests that need a fresh process (XLA dump flags are read at start-up).
"""

import json
import os
import sys

from absl import app, flags

flags.DEFINE_integer("devices", 4, "Logical CPU devices (data x pipeline).")
flags.DEFINE_integer("microbatches", 1, "Microbatches.")
flags.DEFINE_boolean("xla", False, "XLA-compile the per-replica compute.")
flags.DEFINE_integer("pipeline", 1, "Pipeline stages (data = devices / pipeline).")
FLAGS = flags.FLAGS


def main(argv):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tfdist

    tfdist.use_virtual_devices(FLAGS.devices)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from helpers import train

    strategy = tfdist.Strategy(pipeline=FLAGS.pipeline, microbatches=FLAGS.microbatches,
                               xla=FLAGS.xla)
    losses, _, _ = train(strategy)
    print(json.dumps({"losses": losses}))


if __name__ == "__main__":
    app.run(main)
