"""A Keras Transformer split across devices by tensor parallelism.

    python keras_examples/tensor_parallel_transformer.py --devices=4 --tensor=2
    python keras_examples/tensor_parallel_transformer.py --devices=8 --tensor=2 \
        --pipeline=2 --microbatches=2 --zero=1 --blocks=2

Reads each 8x8 digit as a sequence of 8 rows, and classifies it with a plain
Keras Transformer block (`MultiHeadAttention` + a Dense MLP). The model code
knows nothing of tfdist: built under `tfdist.Strategy(tensor=...)`, its
attention is split by heads and its MLP into a column- and a row-parallel
Dense. With `--pipeline`, the blocks are cut into stages too (data x pipeline
x tensor), and `--zero` shards the optimizer state over each data group.
Prints the layout (`strategy.describe`), each epoch's loss and accuracy, and
the bytes of model weights and of optimizer state each device holds.
"""

import digits  # first: it quiets TensorFlow's C++ logs before TensorFlow loads

# isort: split
from absl import flags

import tfdist

flags.DEFINE_integer("devices", 4, "Logical CPU devices (data x pipeline x tensor).")
flags.DEFINE_integer("tensor", 2, "Devices per tensor group (splits of each weight).")
flags.DEFINE_integer("pipeline", 1, "Pipeline stages.")
flags.DEFINE_integer("microbatches", 1, "Microbatches per replica batch.")
flags.DEFINE_integer("zero", 0, "ZeRO stage (0, 1, 2) over each data group.")
flags.DEFINE_integer("blocks", 1, "Transformer blocks.")
flags.DEFINE_integer("heads", 4, "Attention heads.")
flags.DEFINE_integer("width", 64, "Model width.")
flags.DEFINE_integer("epochs", 3, "Epochs.")
flags.DEFINE_integer("batch_size", 64, "Global batch size.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    digits.quiet_logs()
    tfdist.use_virtual_devices(FLAGS.devices)
    strategy = tfdist.Strategy(tensor=FLAGS.tensor, pipeline=FLAGS.pipeline,
                               microbatches=FLAGS.microbatches, zero=FLAGS.zero)
    model = digits.train_transformer(strategy, FLAGS.width, FLAGS.heads, FLAGS.blocks,
                                     FLAGS.epochs, FLAGS.batch_size)
    digits.print_unsplit_and_state_bytes(model)


if __name__ == "__main__":
    digits.run(main)
