"""A Keras Transformer in pipeline stages, replicated over the data axis.

    python keras_examples/pipeline_transformer.py --devices=4 --pipeline=2 --microbatches=4

Reads each 8x8 digit as a sequence of 8 rows and classifies it with plain Keras
Transformer blocks. The model code knows nothing of tfdist: built under
`tfdist.Strategy(pipeline=2)` on 4 devices it runs as data=2 x pipeline=2:
each half of the blocks on its own device, each batch in microbatches that
flow through the stages in the 1F1B schedule. Prints the stages
(`strategy.describe`), each epoch's loss and accuracy, and the bytes of model
weights each device holds.
"""

import digits  # first: it quiets TensorFlow's C++ logs before TensorFlow loads

# isort: split
from absl import flags

import tfdist

flags.DEFINE_integer("devices", 4, "Logical CPU devices (data x pipeline).")
flags.DEFINE_integer("pipeline", 2, "Pipeline stages.")
flags.DEFINE_integer("microbatches", 4, "Microbatches per replica batch.")
flags.DEFINE_enum("schedule", "1f1b", list(tfdist.config.SCHEDULES), "Pipeline schedule.")
flags.DEFINE_integer("virtual_stages", None, "Stages per device (default 2 with "
                     "schedule=interleaved or zbv, else 1).")
flags.DEFINE_integer("blocks", 4, "Transformer blocks.")
flags.DEFINE_integer("width", 64, "Model width.")
flags.DEFINE_integer("epochs", 3, "Epochs.")
flags.DEFINE_integer("batch_size", 64, "Global batch size.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    digits.quiet_logs()
    tfdist.use_virtual_devices(FLAGS.devices)
    virtual = FLAGS.virtual_stages or (2 if FLAGS.schedule in ("interleaved", "zbv") else 1)
    strategy = tfdist.Strategy(pipeline=FLAGS.pipeline, microbatches=FLAGS.microbatches,
                               schedule=FLAGS.schedule, virtual_stages=virtual)
    digits.train_transformer(strategy, FLAGS.width, blocks=FLAGS.blocks,
                             epochs=FLAGS.epochs, batch_size=FLAGS.batch_size)

if __name__ == "__main__":
    digits.run(main)
