"""One worker of a MultiWorkerStrategy parity run (TF_CONFIG from the environment).

Trains the test MLP with `model.fit` and writes the reported losses and final
weights to `--out` (worker 0 only).
"""

import json
import os
import sys

from absl import app, flags

flags.DEFINE_string("out", None, "Where worker 0 writes its losses and weights.")
flags.DEFINE_integer("microbatches", 1, "Microbatches per per-replica batch.")
FLAGS = flags.FLAGS


def main(argv):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    keras.config.disable_traceback_filtering()  # whole tracebacks in the test log
    import tfdist

    strategy = tfdist.MultiWorkerStrategy(microbatches=FLAGS.microbatches,
                                          timeout_seconds=120)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from helpers import train

    losses, weights, _ = train(strategy)
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    if task["index"] == 0 and FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"losses": losses, "weights": [w.tolist() for w in weights],
                       "replicas": strategy.num_replicas_in_sync}, f)


if __name__ == "__main__":
    app.run(main)
