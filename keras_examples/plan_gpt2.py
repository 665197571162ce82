"""Choosing the parallel layout of keras-hub's GPT-2 with `tfdist.plan`.

A small GPT-2 backbone (4 blocks of width 128) with a token classifier, Adam,
on `--devices` devices of `--memory_per_device` each: every configuration
`tfdist.plan` finds is ranked by its predicted step time, those whose
predicted peak exceeds the memory say so, and with `--measure=K` the first K
are trained a few steps here and ranked by their measured time. The best
plan's `ParallelConfig` is printed last as JSON, for `tfdist launch --config`
or `tfdist tfjob --config`.

    python keras_examples/plan_gpt2.py --devices=4 --memory_per_device=128MiB --measure=2

The same from the command line (`build` is this file's model function):

    tfdist plan --model keras_examples.plan_gpt2:build --devices 4 \
        --memory-per-device 128MiB --batch-size 16 --sequence-length 64
"""

from absl import flags

FLAGS = flags.FLAGS
VOCAB = 1000


def build():
    """The compiled model: GPT-2 backbone, Dense token classifier, Adam."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=4, num_heads=4, hidden_dim=128,
        intermediate_dim=512, max_sequence_length=128, dropout=0.0)
    model = keras.Model(backbone.input, keras.layers.Dense(VOCAB)(backbone.output))
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def main(argv):
    del argv
    import tfdist

    tfdist.use_virtual_devices(FLAGS.devices)
    plans = tfdist.plan(build, devices=FLAGS.devices,
                        memory_per_device=FLAGS.memory_per_device,
                        batch_size=FLAGS.batch_size, sequence_length=FLAGS.sequence_length,
                        measure=FLAGS.measure)
    print(plans.table(rows=12))
    print(plans.best.config.to_json())


def define_flags():
    """This script's flags: defined only when it runs as a script, so that
    `tfdist plan --model keras_examples.plan_gpt2:build` can import `build`
    next to the command's own flags of the same names."""
    flags.DEFINE_integer("devices", 4, "Devices to plan for (logical CPU devices here).")
    flags.DEFINE_string("memory_per_device", "128MiB", "Memory of each device.")
    flags.DEFINE_integer("batch_size", 16, "Global batch.")
    flags.DEFINE_integer("sequence_length", 64, "Tokens per example.")
    flags.DEFINE_integer("measure", 0, "Train the first K plans that fit and rank them by "
                         "measured time.")


if __name__ == "__main__":
    import digits  # (beside this file: the examples' shared runner)

    define_flags()
    digits.run(main)
