"""Asynchronous parameter-server training of a Keras 3 model with `model.fit`.

The same script runs on every task of a cluster (worker and ps tasks serve
inside `tfdist.ParameterServerStrategy()`; the chief trains):

    tfdist launch --chief --workers 2 --ps 1 -- python keras_examples/parameter_server.py

Without TF_CONFIG it starts an in-process cluster of `--workers` and `--ps`:

    python keras_examples/parameter_server.py --workers=2 --ps=1

Trains an MLP on the handwritten digits for `--epochs` x `--steps_per_epoch`
asynchronous steps, validates on the chief after each epoch, and checks that
the optimizer applied exactly the steps asked for.
"""

import os
import sys

import digits  # first: it quiets TensorFlow's C++ logs before TensorFlow loads

# isort: split
import keras
import tensorflow as tf
from absl import flags

import tfdist

flags.DEFINE_integer("workers", 2, "Worker tasks of the in-process cluster (no TF_CONFIG).")
flags.DEFINE_integer("ps", 1, "Ps tasks of the in-process cluster (no TF_CONFIG).")
flags.DEFINE_integer("epochs", 3, "Epochs.")
flags.DEFINE_integer("steps_per_epoch", 40, "Steps per epoch (over all workers).")
flags.DEFINE_integer("batch_size", 64, "Batch size of each worker's step.")
flags.DEFINE_string("backup_dir", None, "If set, BackupAndRestore keeps the job's state "
                    "there, so a restarted chief resumes.")
FLAGS = flags.FLAGS


class EpochSummary(keras.callbacks.Callback):
    """Prints each epoch's loss, accuracy and validation accuracy."""

    def on_epoch_end(self, epoch, logs=None):
        print(f"epoch {epoch + 1}: loss {logs['loss']:.4f}  accuracy {logs['accuracy']:.4f}  "
              f"val_accuracy {logs['val_accuracy']:.4f}", flush=True)


def main(argv):
    digits.quiet_logs()
    if "TF_CONFIG" in os.environ:
        strategy = tfdist.ParameterServerStrategy()  # worker and ps tasks serve here
    else:
        resolver = tfdist.ps.in_process_cluster(workers=FLAGS.workers, ps=FLAGS.ps)
        strategy = tfdist.ParameterServerStrategy(cluster_resolver=resolver)

    x, y = digits.load()
    train = tf.data.Dataset.from_tensor_slices((x[:1500], y[:1500]))
    train = train.shuffle(1500).batch(FLAGS.batch_size, drop_remainder=True).repeat()
    with strategy.scope():
        model = digits.build_model()
    callbacks = [EpochSummary()]
    if FLAGS.backup_dir:
        callbacks.append(keras.callbacks.BackupAndRestore(FLAGS.backup_dir))
    model.fit(train, epochs=FLAGS.epochs, steps_per_epoch=FLAGS.steps_per_epoch,
              validation_data=(x[1500:], y[1500:]), callbacks=callbacks, verbose=0)

    applied = int(model.optimizer.iterations)
    asked = FLAGS.epochs * FLAGS.steps_per_epoch
    print(f"optimizer.iterations = {applied} (steps asked: {asked}; "
          f"{strategy.num_workers} workers, {strategy.num_ps} ps)")
    if applied != asked:
        sys.exit(f"{asked - applied} steps were lost")


if __name__ == "__main__":
    digits.run(main)
