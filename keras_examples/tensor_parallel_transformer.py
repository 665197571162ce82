"""A Keras Transformer split across devices by tensor parallelism.

    python keras_examples/tensor_parallel_transformer.py --devices=4 --tensor=2

Reads each 8x8 digit as a sequence of 8 rows, and classifies it with a plain
Keras Transformer block (`MultiHeadAttention` + a Dense MLP). The model code
knows nothing of tfdist: built under `tfdist.Strategy(tensor=...)`, its
attention is split by heads and its MLP into a column- and a row-parallel
Dense. Prints the layout (`strategy.describe`), each epoch's loss and accuracy,
and the bytes of model weights each device holds.
"""

import digits  # first: it quiets TensorFlow's C++ logs before TensorFlow loads
from absl import app, flags

import tfdist

flags.DEFINE_integer("devices", 4, "Logical CPU devices (data x tensor).")
flags.DEFINE_integer("tensor", 2, "Devices per tensor group (splits of each weight).")
flags.DEFINE_integer("heads", 4, "Attention heads.")
flags.DEFINE_integer("width", 64, "Model width.")
flags.DEFINE_integer("epochs", 3, "Epochs.")
flags.DEFINE_integer("batch_size", 64, "Global batch size.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    digits.quiet_logs()
    tfdist.use_virtual_devices(FLAGS.devices)
    strategy = tfdist.Strategy(tensor=FLAGS.tensor)
    print(f"tfdist.Strategy: {strategy.config.to_json()}")
    with strategy.scope():
        model = digits.build_transformer(FLAGS.width, FLAGS.heads)
    print(strategy.describe(model))
    x, y = digits.load()
    x = x.reshape(-1, 8, 8)
    model.fit(x, y, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, verbose=0,
              callbacks=[digits.EpochReport()])
    sizes = digits.weight_bytes(model)
    print("weight bytes per device: " + "  ".join(
        f"{device}={size:,}" for device, size in sorted(sizes.items())))
    whole = sum(w.numpy().nbytes for w in model.weights)
    print(f"unsplit model: {whole:,} bytes")


if __name__ == "__main__":
    app.run(main)
