"""Profile a tfdist training run and look at it in TensorBoard.

    python keras_examples/profile_fit.py --logdir=logs
    tensorboard --logdir=logs        # then open the Profile and Scalars tabs

Trains the digits MLP under `tfdist.Strategy(data=4, microbatches=2)` with two
callbacks: `tfdist.callbacks.Profiler` records steps 20-25 (a trace per host in
`logs/plugins/profile/<run>/`), and `tfdist.callbacks.Metrics` writes examples/s,
step time, microbatches and optimizer-state bytes per device (`logs/tfdist`).
"""

import digits  # first: it quiets TensorFlow's C++ logs before TensorFlow loads

# isort: split
from absl import flags

import tfdist

flags.DEFINE_string("logdir", "logs", "TensorBoard log directory.")
flags.DEFINE_integer("devices", 4, "Logical CPU devices = data-parallel replicas.")
flags.DEFINE_integer("microbatches", 2, "Microbatches per per-replica batch.")
flags.DEFINE_integer("epochs", 3, "Epochs.")
flags.DEFINE_list("profile_steps", ["20", "25"], "start,stop of the traced steps.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    digits.quiet_logs()
    tfdist.use_virtual_devices(FLAGS.devices)
    strategy = tfdist.Strategy(data=FLAGS.devices, microbatches=FLAGS.microbatches)
    with strategy.scope():
        model = digits.build_model()
    x, y = digits.load()
    start, stop = (int(step) for step in FLAGS.profile_steps)
    profiler = tfdist.callbacks.Profiler(FLAGS.logdir, steps=(start, stop))
    model.fit(x, y, batch_size=128, epochs=FLAGS.epochs, verbose=0, callbacks=[
        profiler, tfdist.callbacks.Metrics(FLAGS.logdir, every_n_steps=5)])
    print(f"trace: {profiler.trace_path}")
    print(f"scalars: {FLAGS.logdir}/tfdist")
    print(f"view: tensorboard --logdir {FLAGS.logdir}")


if __name__ == "__main__":
    digits.run(main)
