"""The `tfdist` command: an absl app with one subcommand per task.

    tfdist config [--config parallel.json] [--data 4 --microbatches 2 ...]
        validates a ParallelConfig and prints it as JSON.
    tfdist version
        prints the tfdist, TensorFlow and Keras versions.

Example:

    $ tfdist config --data=4 --microbatches=2
    {"data": 4, "pipeline": 1, "tensor": 1, "microbatches": 2, ...}
"""

import json
import sys

from absl import app, flags

from tfdist.config import PRECISIONS, SCHEDULES, ParallelConfig

FLAGS = flags.FLAGS

flags.DEFINE_string("config", None, "Path of a ParallelConfig JSON file; the "
                    "flags below override its fields.")
flags.DEFINE_integer("data", None, "Data-parallel replicas.")
flags.DEFINE_integer("pipeline", None, "Pipeline stages.")
flags.DEFINE_integer("tensor", None, "Tensor-parallel shards.")
flags.DEFINE_integer("microbatches", None, "Microbatches per per-replica batch.")
flags.DEFINE_integer("zero", None, "Optimizer-state sharding stage: 0, 1 or 2.")
flags.DEFINE_enum("precision", None, list(PRECISIONS), "Compute precision.")
flags.DEFINE_boolean("xla", None, "jit-compile the per-replica compute.")
flags.DEFINE_enum("schedule", None, list(SCHEDULES), "Pipeline schedule.")

_CONFIG_FIELDS = ("data", "pipeline", "tensor", "microbatches", "zero",
                  "precision", "xla", "schedule")


def config_from_flags() -> ParallelConfig:
    """The ParallelConfig given by `--config` and the field flags, validated.

    Example:

    >>> FLAGS(["tfdist", "--data=2"])  # doctest: +SKIP
    >>> config_from_flags().data  # doctest: +SKIP
    2
    """
    values = {}
    if FLAGS.config:
        with open(FLAGS.config) as f:
            values = json.load(f)
    for name in _CONFIG_FIELDS:
        if FLAGS[name].value is not None:
            values[name] = FLAGS[name].value
    return ParallelConfig.from_dict(values)


def _config_command(args):
    """Validates the config given by the flags and prints it as JSON."""
    if args:
        raise app.UsageError(f"`tfdist config` takes no arguments, got {args}.")
    print(config_from_flags().to_json())


def _version_command(args):
    """Prints the versions of tfdist, TensorFlow and Keras."""
    import keras
    import tensorflow as tf

    import tfdist

    print(f"tfdist {tfdist.__version__}, tensorflow {tf.__version__}, "
          f"keras {keras.__version__}")


COMMANDS = {"config": _config_command, "version": _version_command}


def main(argv):
    if len(argv) < 2 or argv[1] not in COMMANDS:
        raise app.UsageError(
            f"usage: tfdist {{{'|'.join(COMMANDS)}}} [flags]; got "
            f"{argv[1:2] or 'no command'}."
        )
    try:
        COMMANDS[argv[1]](argv[2:])
    except (ValueError, TypeError) as error:
        print(f"tfdist {argv[1]}: {error}", file=sys.stderr)
        return 2
    return 0


def run():
    """Console-script entry point (`tfdist` on the PATH)."""
    app.run(main)


if __name__ == "__main__":
    run()
