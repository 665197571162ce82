"""A tfdist strategy driving a tf-models-official `orbit` custom training loop.

    python keras_examples/orbit_loop.py --devices=4 --microbatches=2 --steps=200

orbit's `Controller` runs a `StandardTrainer` whose step is tfdist's own training
step (`strategy.train_step(model)`: microbatches, one gradient all-reduce, loss
scaling), run on every replica with `strategy.run`.
"""

import digits  # first: it quiets TensorFlow's C++ logs before TensorFlow loads

# isort: split
import orbit
import tensorflow as tf
from absl import flags

import tfdist

flags.DEFINE_integer("devices", 4, "Logical CPU devices = data-parallel replicas.")
flags.DEFINE_integer("microbatches", 2, "Microbatches per per-replica batch.")
flags.DEFINE_integer("steps", 200, "Training steps.")
flags.DEFINE_integer("steps_per_loop", 50, "Steps per orbit loop (one tf.function call).")
flags.DEFINE_integer("batch_size", 64, "Global batch size.")
FLAGS = flags.FLAGS


def train(strategy, steps, steps_per_loop, batch_size):
    """Trains the digits MLP with an orbit Controller; returns (logs, model)."""
    with strategy.scope():
        model = digits.build_model()
    x, y = digits.load()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(
        batch_size, drop_remainder=True)
    logs = []
    controller = orbit.Controller(
        strategy=strategy,
        trainer=digits.orbit_trainer(strategy, model, dataset),
        global_step=model.optimizer.iterations.value,
        steps_per_loop=steps_per_loop,
        summary_interval=steps_per_loop,
        summary_dir=None,
        train_actions=[lambda output: logs.append(
            {k: float(v) for k, v in output.items()})],
    )
    controller.train(steps=steps)
    return logs, model


def main(argv):
    del argv
    digits.quiet_logs()
    tfdist.use_virtual_devices(FLAGS.devices)
    strategy = tfdist.Strategy(data=FLAGS.devices, microbatches=FLAGS.microbatches)
    logs, model = train(strategy, FLAGS.steps, FLAGS.steps_per_loop, FLAGS.batch_size)
    for i, log in enumerate(logs):
        print(f"steps {(i + 1) * FLAGS.steps_per_loop}: loss {log['loss']:.4f}  "
              f"accuracy {log['accuracy']:.3f}")
    print(f"optimizer steps applied: {int(model.optimizer.iterations.numpy())}")


if __name__ == "__main__":
    digits.run(main)
