"""Data-parallel training of a Keras model with tfdist on virtual CPU devices.

    python keras_examples/data_parallel.py --devices=4 --microbatches=2
    python keras_examples/data_parallel.py --devices=4 --compression=bf16

Trains an MLP on the handwritten digits with `model.fit` under
`tfdist.Strategy(data=devices, ...)`, prints each epoch's loss, accuracy and
examples/s, and ends with a summary (devices, mode, final accuracy, what to try
next). This is `make demo`.
"""

import time

import digits  # first: it quiets TensorFlow's C++ logs before TensorFlow loads

# isort: split
import keras
from absl import flags

import tfdist
from tfdist.config import COMPRESSIONS

flags.DEFINE_integer("devices", 4, "Logical CPU devices = data-parallel replicas.")
flags.DEFINE_integer("microbatches", 1, "Microbatches per per-replica batch.")
flags.DEFINE_enum("precision", "float32", ["float32", "mixed_float16", "mixed_bfloat16"],
                  "Compute precision.")
flags.DEFINE_boolean("xla", False, "XLA-compile the per-replica compute.")
flags.DEFINE_string("compression", "none",
                    f"What the gradients cross devices as: {', '.join(COMPRESSIONS)} "
                    f"(bf16, fp16: half the bytes; topk:0.01: 2% of them).")
flags.DEFINE_integer("epochs", 5, "Epochs.")
flags.DEFINE_integer("batch_size", 128, "Global batch size.")
FLAGS = flags.FLAGS


class Throughput(keras.callbacks.Callback):
    """Prints each epoch's loss, accuracy and examples/s."""

    def __init__(self, examples_per_epoch):
        super().__init__()
        self.examples_per_epoch = examples_per_epoch

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.perf_counter() - self.start
        print(f"epoch {epoch + 1}: loss {logs['loss']:.4f}  accuracy "
              f"{logs['accuracy']:.3f}  {self.examples_per_epoch / seconds:,.0f} "
              f"examples/s", flush=True)


def main(argv):
    del argv
    digits.quiet_logs()
    tfdist.use_virtual_devices(FLAGS.devices)
    x, y = digits.load()
    print(f"Made {FLAGS.devices} virtual CPU devices (tfdist.use_virtual_devices); "
          f"training an MLP on the handwritten digits ({len(x):,} 8x8 images) with "
          f"{FLAGS.epochs} epochs of model.fit, one data-parallel replica per device.",
          flush=True)
    strategy = tfdist.Strategy(data=FLAGS.devices, microbatches=FLAGS.microbatches,
                               precision=FLAGS.precision, xla=FLAGS.xla,
                               compression=FLAGS.compression)
    print(f"tfdist.Strategy: {strategy.config.to_json()}")
    with strategy.scope():
        model = digits.build_model()
    history = model.fit(x, y, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs,
                        verbose=0, callbacks=[Throughput(len(x))])
    config = strategy.config
    devices = ", ".join(d.split("device:")[-1] for d in strategy.extended.worker_devices)
    print(f"\nDone: {FLAGS.devices} devices ({devices})"
          f"\n  mode: data parallel x{config.data}, microbatches={config.microbatches}, "
          f"precision={config.precision}, xla={config.xla}"
          f"\n  final accuracy: {history.history['accuracy'][-1]:.3f}"
          f"\nNext: keras_examples/ (ZeRO, tensor and pipeline parallelism, "
          f"parameter servers), `tfdist --help` for multi-process runs, README.md.")


if __name__ == "__main__":
    digits.run(main)
