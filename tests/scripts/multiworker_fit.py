"""One worker of a MultiWorkerStrategy parity run, under `tfdist launch`.

Takes its cluster from TF_CONFIG and its ParallelConfig from TFDIST_CONFIG (both
set by the launcher), trains the test MLP with `model.fit` and writes the
reported losses, final weights and optimizer state (read whole: under `zero` every
worker takes part in gathering them), optimizer-state and parameter bytes per
device, the predicted peak's transport part, and the collective ops of the
training function to `--out` (worker 0 only).
"""

import json
import os
import sys

from absl import app, flags

flags.DEFINE_string("out", None, "Where worker 0 writes its losses and weights.")
flags.DEFINE_integer("examples", 640, "Examples to train on (helpers.data).")
flags.DEFINE_integer("batch_size", 32, "Global batch size.")
flags.DEFINE_bool("seed_per_task", False, "Worker k builds the model with seed k: the "
                  "chief's initial values (seed 0) must still be everyone's.")
flags.DEFINE_integer("reshard_block_bytes", 0, "Blocks of at most this many bytes "
                     "when values are sent or resharded in rows (0: tfdist's own).")
flags.DEFINE_integer("devices", 0, "Logical CPU devices of this worker (default: "
                     "one per pipeline stage).")
FLAGS = flags.FLAGS


def main(argv):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    keras.config.disable_traceback_filtering()  # whole tracebacks in the test log
    import tfdist

    config = tfdist.ParallelConfig.from_env()
    devices = FLAGS.devices or config.pipeline  # default: a device per stage
    if devices > 1:
        tfdist.use_virtual_devices(devices)
    strategy = tfdist.MultiWorkerStrategy(config=config, timeout_seconds=120)
    if FLAGS.reshard_block_bytes:
        from tfdist.sharding import storage
        storage.RESHARD_BLOCK_BYTES = FLAGS.reshard_block_bytes
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from helpers import data, executed_op_counts, train
    from tfdist.callbacks.metrics import optimizer_state_bytes, variable_bytes

    x, y = data(FLAGS.examples)
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    losses, weights, model = train(strategy, x=x, y=y, batch_size=FLAGS.batch_size,
                                   seed=task["index"] if FLAGS.seed_per_task else 0)
    optimizer = [v.numpy().tolist() for v in model.optimizer.variables]
    if task["index"] == 0 and FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"losses": losses, "weights": [w.tolist() for w in weights],
                       "optimizer": optimizer,
                       "optimizer_bytes": optimizer_state_bytes(model.optimizer),
                       "parameter_bytes": variable_bytes(model.trainable_weights),
                       "replicas": strategy.num_replicas_in_sync,
                       "transport": strategy.predicted_peak(model, FLAGS.batch_size).transport,
                       "collectives": {op: n for op, n in executed_op_counts(model).items()
                                       if op.startswith("Collective")}}, f)


if __name__ == "__main__":
    app.run(main)
