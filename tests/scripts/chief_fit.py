"""A `tfdist.ChiefStrategy` job under `tfdist launch --chief --workers N`.

Every task runs it: the workers serve inside the strategy and end when the
chief does. The chief trains the test MLP with `model.fit` (ParallelConfig
from TFDIST_CONFIG) and writes to `--out` the reported losses, the final
weights and optimizer state, where each weight and slot lives, `evaluate`'s
loss and `predict`'s outputs; and saves the weights with `save_weights`
into `--weights`.
"""

import json
import os
import sys

from absl import app, flags

flags.DEFINE_string("out", None, "Where the chief writes its results.")
flags.DEFINE_string("weights", None, "Where the chief saves the weights (.weights.h5).")
flags.DEFINE_string("checkpoint", None, "A sharded checkpoint's directory: saved after fit, or "
                    "with --restore read into a new model instead of training.")
flags.DEFINE_bool("restore", False, "Build the model, restore --checkpoint, write its "
                  "weights and optimizer state to --out.")
flags.DEFINE_string("backup", None, "Train 3 epochs with tfdist.callbacks.BackupAndRestore "
                    "into this directory; write the weights, the step count and the "
                    "epochs this run began to --out.")
flags.DEFINE_bool("crash", False, "With --backup: end the chief (exit code 3) as epoch 2 "
                  "begins.")
flags.DEFINE_integer("epochs", 1, "Epochs of fit; more than 1: only trains, printing each "
                     "epoch's end (a long job for the failure tests).")
FLAGS = flags.FLAGS


def main(argv):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    keras.config.disable_traceback_filtering()  # whole tracebacks in the test log
    import tfdist

    strategy = tfdist.ChiefStrategy(config=tfdist.ParallelConfig.from_env(),
                                    timeout_seconds=120)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from helpers import data, make_model, train
    from tfdist._compat.keras_optimizer import trainable_variables_of
    from tfdist.pipeline.placement import component_devices
    from tfdist.sharding.slots import optimizer_slots

    x, y = data()
    if FLAGS.restore:
        with strategy.scope():
            model = make_model()
            model.optimizer.build(model.trainable_variables)
        tfdist.checkpoint.ShardedCheckpoint(model, FLAGS.checkpoint).restore()
        with open(FLAGS.out, "w") as f:
            json.dump({"weights": [w.tolist() for w in model.get_weights()],
                       "optimizer": [v.numpy().tolist() for v in model.optimizer.variables]}, f)
        return
    if FLAGS.backup:
        with strategy.scope():
            model = make_model()
        epochs_run = []

        def begin(epoch, _):
            if FLAGS.crash and epoch == 2:
                os._exit(3)
            epochs_run.append(epoch)

        model.fit(x, y, batch_size=32, epochs=3, verbose=0, shuffle=False,
                  callbacks=[tfdist.callbacks.BackupAndRestore(FLAGS.backup),
                             keras.callbacks.LambdaCallback(on_epoch_begin=begin)])
        with open(FLAGS.out, "w") as f:
            json.dump({"weights": [w.tolist() for w in model.get_weights()],
                       "iterations": int(model.optimizer.iterations.numpy()),
                       "epochs_run": epochs_run}, f)
        return
    if FLAGS.epochs > 1:
        with strategy.scope():
            model = make_model()
        model.fit(x, y, batch_size=32, epochs=FLAGS.epochs, verbose=0, callbacks=[
            keras.callbacks.LambdaCallback(
                on_epoch_end=lambda epoch, _: print(f"epoch {epoch}", flush=True))])
        return
    losses, weights, model = train(strategy, x=x, y=y)
    variables = trainable_variables_of(model.optimizer)
    slots = [(variables[index].path, component_devices(slot))
             for slot, index in optimizer_slots(model.optimizer, variables)]
    model.save_weights(FLAGS.weights)
    tfdist.checkpoint.ShardedCheckpoint(model, FLAGS.checkpoint, asynchronous=False).save()
    with open(FLAGS.out, "w") as f:
        json.dump({"losses": losses, "weights": [w.tolist() for w in weights],
                   "optimizer": [v.numpy().tolist() for v in model.optimizer.variables],
                   "weight_devices": {w.path: component_devices(w) for w in model.weights},
                   "slot_devices": slots,
                   "describe": strategy.describe(model),
                   "evaluate": model.evaluate(x, y, batch_size=32, verbose=0),
                   "predict": model.predict(x[:64], batch_size=32, verbose=0).tolist()}, f)


if __name__ == "__main__":
    app.run(main)
