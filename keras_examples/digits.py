"""What the examples share: the digits, an MLP, quiet logs, `run`.

The digits (1,797 8x8 images, data/digits.csv.gz) ship with the examples, so
nothing downloads.
"""

import pathlib
import sys

from tfdist.logs import quiet_tensorflow

# Before TensorFlow loads: its C++ log level (errors only, unless
# TF_CPP_MIN_LOG_LEVEL is set), and on a host without a GPU driver no line
# about the missing GPU.
quiet_tensorflow(discover_devices=True)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from tfdist.callbacks.metrics import optimizer_state_bytes, variable_bytes  # noqa: E402

# 1,797 rows of 64 pixels (0-16) and the label (data/README.md).
DIGITS = pathlib.Path(__file__).parent / "data" / "digits.csv.gz"


def run(main):
    """`absl.app.run(main)` for an example: `--help` prints the example's
    docstring and flags and exits 0, and `--devices` must be >= 1."""
    if any(arg in ("-h", "--help", "-help") for arg in sys.argv[1:]):
        print((sys.modules["__main__"].__doc__ or "").strip() + "\n")
        print(flags.FLAGS.main_module_help())
        sys.exit(0)
    if "devices" in flags.FLAGS:
        flags.register_validator(
            "devices", lambda n: n >= 1,
            message="--devices (logical CPU devices to create) must be >= 1")
    app.run(main)


def quiet_logs():
    """TensorFlow's INFO lines drown an example's output: WARNING unless -v is given."""
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)


def load(examples=None):
    """(x, y): float32 pixels in [0, 1] of shape (n, 64), int32 labels 0-9.

    `examples` > 1,797 repeats the set (for longer timing runs).
    """
    digits = np.loadtxt(DIGITS, delimiter=",")
    x = (digits[:, :-1] / 16.0).astype("float32")
    y = digits[:, -1].astype("int32")
    if examples is not None:
        reps = -(-examples // len(x))
        x, y = np.tile(x, (reps, 1))[:examples], np.tile(y, reps)[:examples]
    return x, y


def build_model(hidden=256, seed=0):
    """A 3-layer MLP classifier for the digits, compiled with Adam."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(10),
        ],
        name="digits_mlp",
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def build_transformer(width=64, heads=4, blocks=1, seed=0):
    """Rows of a digit as 8 tokens -> post-norm Transformer blocks -> 10 classes.

    Plain Keras layers (`MultiHeadAttention`, a Dense MLP, residuals), compiled
    with Adam. The inputs are the digits reshaped to (8, 8).
    """
    keras.utils.set_random_seed(seed)
    rows = keras.Input((8, 8))
    x = keras.layers.Dense(width)(rows)
    for _ in range(blocks):
        attended = keras.layers.MultiHeadAttention(heads, key_dim=width // heads)(x, x)
        x = keras.layers.LayerNormalization()(x + attended)
        hidden = keras.layers.Dense(4 * width, activation="gelu")(x)
        x = keras.layers.LayerNormalization()(x + keras.layers.Dense(width)(hidden))
    logits = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(x))
    model = keras.Model(rows, logits)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def per_device(sizes):
    """{device: bytes} on one line, by device: `CPU:0=1,024  CPU:1=1,024`."""
    return "  ".join(f"{device}={size:,}" for device, size in sorted(sizes.items()))


def print_weight_bytes(model):
    """Prints the bytes of the model's weights each device holds."""
    print(f"weight bytes per device: {per_device(variable_bytes(model.weights))}")


def print_unsplit_and_state_bytes(model):
    """Prints the model's whole (unsplit) weight bytes and the bytes of
    optimizer state each device holds."""
    whole = sum(w.numpy().nbytes for w in model.weights)
    print(f"unsplit model: {whole:,} bytes")
    print(f"optimizer state bytes per device: "
          f"{per_device(optimizer_state_bytes(model.optimizer))}")


class EpochReport(keras.callbacks.Callback):
    """Prints each epoch's loss, and its accuracy when the model reports one."""

    def on_epoch_end(self, epoch, logs=None):
        accuracy = f"  accuracy {logs['accuracy']:.4f}" if "accuracy" in logs else ""
        print(f"epoch {epoch + 1}: loss {logs['loss']:.4f}{accuracy}", flush=True)


def train_transformer(strategy, width=64, heads=4, blocks=1, epochs=3, batch_size=64):
    """Builds `build_transformer` under `strategy`, prints the strategy's
    config and layout, fits it on the digits (one line per epoch) and prints
    the bytes of model weights each device holds; returns the model."""
    print(f"tfdist.Strategy: {strategy.config.to_json()}")
    with strategy.scope():
        model = build_transformer(width, heads, blocks)
    print(strategy.describe(model))
    x, y = load()
    model.fit(x.reshape(-1, 8, 8), y, batch_size=batch_size, epochs=epochs, verbose=0,
              callbacks=[EpochReport()])
    print_weight_bytes(model)
    return model


def orbit_trainer(strategy, model, dataset):
    """An `orbit.StandardTrainer` running tfdist's step for `model` (Keras 3
    or tf_keras) on `dataset`; its loops report the model's metrics."""
    import orbit
    import tensorflow as tf

    step = strategy.train_step(model)
    step.build(dataset.element_spec)  # variables before tracing

    class Trainer(orbit.StandardTrainer):
        def train_loop_begin(self):
            model.reset_metrics()

        def train_step(self, iterator):
            strategy.run(step, args=(next(iterator),))

        def train_loop_end(self):
            return {name: tf.convert_to_tensor(value)
                    for name, value in model.get_metrics_result().items()}

    return Trainer(strategy.experimental_distribute_dataset(dataset),
                   orbit.StandardTrainerOptions(use_tf_while_loop=False))
