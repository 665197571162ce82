"""Adam with its state sharded across replicas (ZeRO) on virtual CPU devices.

    python keras_examples/zero_adam.py --devices=4 --zero=2
    python keras_examples/zero_adam.py --devices=4 --zero=3

Trains the digits MLP with `model.fit` under `tfdist.Strategy(data=devices,
zero=...)` and prints each epoch's loss, the bytes of optimizer state each
device holds and, for comparison, the unsharded bytes (Adam's two slots of
every weight, what each device holds with zero=0) and their ratio: with zero=1
or 2, about 1/devices. Then the bytes of parameters each device holds and
their ratio to the whole model's: about 1/devices with zero=3 (the parameters
sharded too), 1 otherwise.
"""

import digits  # first: it quiets TensorFlow's C++ logs before TensorFlow loads

# isort: split
import keras
from absl import flags

import tfdist
from tfdist.callbacks.metrics import optimizer_state_bytes, variable_bytes

flags.DEFINE_integer("devices", 4, "Logical CPU devices = data-parallel replicas.")
flags.DEFINE_enum("zero", "2", ["0", "1", "2", "3"],
                  "0: replicated state; 1: optimizer state sharded; 2: gradients too; "
                  "3: parameters too.")
flags.DEFINE_integer("epochs", 3, "Epochs.")
flags.DEFINE_integer("batch_size", 128, "Global batch size.")
FLAGS = flags.FLAGS


class EpochReport(keras.callbacks.Callback):
    """Prints each epoch's loss, the optimizer-state and parameter bytes of
    every device, and the unsharded bytes with the ratio of the largest
    device's to them."""

    def on_epoch_end(self, epoch, logs=None):
        weights = sum(w.numpy().nbytes for w in self.model.trainable_weights)
        print(f"epoch {epoch + 1}: loss {logs['loss']:.4f}  optimizer bytes "
              f"{_ratio(optimizer_state_bytes(self.model.optimizer), 2 * weights)}  "
              f"parameter bytes {_ratio(variable_bytes(self.model.trainable_weights), weights)}",
              flush=True)


def _ratio(sizes, unsharded):
    """Bytes per device, the unsharded bytes and the largest device's ratio to them."""
    per_device = "  ".join(f"{device}={size:,}" for device, size in sorted(sizes.items()))
    return (f"{per_device}  (unsharded: {unsharded:,} per device; ratio "
            f"{max(sizes.values()) / unsharded:.2f})")


def main(argv):
    del argv
    digits.quiet_logs()
    tfdist.use_virtual_devices(FLAGS.devices)
    strategy = tfdist.Strategy(data=FLAGS.devices, zero=int(FLAGS.zero))
    print(f"tfdist.Strategy: {strategy.config.to_json()}")
    with strategy.scope():
        model = digits.build_model()  # compiled with Adam
    x, y = digits.load()
    model.fit(x, y, batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, verbose=0,
              callbacks=[EpochReport()])


if __name__ == "__main__":
    digits.run(main)
