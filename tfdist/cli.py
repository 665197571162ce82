"""The `tfdist` command: an absl app with one subcommand per task.

    tfdist config  [--config parallel.json] [--data 4 --microbatches 2 ...]
        validates a ParallelConfig and prints it as JSON.
    tfdist launch  [--chief] --workers N [--ps M] [--evaluator]
                   [--restart-on-failure K] [--timeout S] [--profiler-port P]
                   [config flags] -- COMMAND...
        runs COMMAND as every task of a local cluster (TF_CONFIG on 127.0.0.1).
    tfdist tfjob   --name NAME --image IMAGE [--namespace NS] [--chief] --workers N
                   [--ps M] [--evaluator] [--gpus-per-worker G] [--cpu C --memory M]
                   [--logdir PATH] [--profiler-port P] [--restart-policy POLICY]
                   [--backoff-limit B] [--submit] [config flags] -- COMMAND...
        prints a Kubeflow TFJob manifest (kubeflow.org/v1); --submit creates it.
    tfdist profile --tasks HOST:PORT,... --logdir DIR [--duration-ms MS]
        records a trace of every listed task's profiler server at once.
    tfdist version
        prints the tfdist, TensorFlow and Keras versions.

Put `--` before COMMAND so that its own flags are not read as tfdist's.

Example:

    $ tfdist launch --workers=2 --microbatches=2 -- python train.py
"""

import json
import sys

from absl import app, flags

from tfdist.config import PRECISIONS, SCHEDULES, ParallelConfig

FLAGS = flags.FLAGS

# ParallelConfig fields (config, launch, tfjob).
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
# The tasks of a job (launch, tfjob).
flags.DEFINE_boolean("chief", False, "Add a chief task.")
flags.DEFINE_integer("workers", 1, "Worker tasks (>= 1).")
flags.DEFINE_integer("ps", 0, "Parameter-server tasks.")
flags.DEFINE_boolean("evaluator", False, "Add an evaluator task.")
# launch
flags.DEFINE_integer("restart-on-failure", 0, "Restarts allowed per failing task.")
flags.DEFINE_float("timeout", None, "Seconds the whole job may take.")
# tfjob
flags.DEFINE_string("name", None, "TFJob name (a Kubernetes name).")
flags.DEFINE_string("image", None, "Container image, with a tag or digest.")
flags.DEFINE_string("namespace", "default", "Kubernetes namespace.")
flags.DEFINE_integer("gpus-per-worker", 0, "GPUs of each chief and worker pod.")
flags.DEFINE_string("cpu", None, "CPU request and limit of each pod, e.g. 2 or 500m.")
flags.DEFINE_string("memory", None, "Memory request and limit of each pod, e.g. 4Gi.")
flags.DEFINE_string("logdir", None, "Log directory given to the pods (TFDIST_LOGDIR).")
flags.DEFINE_integer("profiler-port", None, "Port of each task's profiler server "
                     "(tfdist launch: task k gets this port + k).")
flags.DEFINE_string("restart-policy", "OnFailure", "Pod restart policy.")
flags.DEFINE_integer("backoff-limit", None, "Retries before the job is failed.")
flags.DEFINE_boolean("submit", False, "Create the TFJob in the current kubeconfig's "
                     "cluster instead of printing it.")
# profile
flags.DEFINE_list("tasks", None, "host:port of each task's profiler server.")
flags.DEFINE_integer("duration-ms", 2000, "How long to record, in milliseconds.")

_CONFIG_FIELDS = ("data", "pipeline", "tensor", "microbatches", "zero",
                  "precision", "xla", "schedule")
_CONFIG_FLAGS = ("config",) + _CONFIG_FIELDS
_TASK_FLAGS = ("chief", "workers", "ps", "evaluator")


def config_from_flags() -> ParallelConfig | None:
    """The ParallelConfig given by `--config` and the field flags, or None.

    Example:

    >>> FLAGS(["tfdist", "--data=2"])
    ['tfdist']
    >>> config_from_flags().data
    2
    >>> FLAGS.unparse_flags()
    """
    if not any(FLAGS[name].present for name in _CONFIG_FLAGS):
        return None
    values = {}
    if FLAGS.config:
        with open(FLAGS.config) as f:
            values = json.load(f)
    for name in _CONFIG_FIELDS:
        if FLAGS[name].value is not None:
            values[name] = FLAGS[name].value
    return ParallelConfig.from_dict(values)


def _tasks():
    return {name: FLAGS[name].value for name in _TASK_FLAGS}


def _config_command(args):
    """Validates the config given by the flags and prints it as JSON."""
    if args:
        raise app.UsageError(f"`tfdist config` takes no arguments, got {args}.")
    print((config_from_flags() or ParallelConfig()).to_json())


def _launch_command(command):
    """Runs COMMAND as every task of a local cluster; exits with the job's code."""
    from tfdist.cluster.launch import launch

    if not command:
        raise app.UsageError("`tfdist launch` needs a command: tfdist launch "
                             "--workers=2 -- python train.py")
    return launch(command, **_tasks(),
                  restart_on_failure=FLAGS["restart-on-failure"].value,
                  timeout=FLAGS.timeout, config=config_from_flags(),
                  profiler_port=FLAGS["profiler-port"].value)


def _tfjob_command(command):
    """Prints the TFJob manifest for COMMAND, or submits it with --submit."""
    from tfdist.cluster.tfjob import submit, tfjob

    for name in ("name", "image"):
        if not FLAGS[name].value:
            raise app.UsageError(f"`tfdist tfjob` needs --{name}.")
    manifest = tfjob(
        FLAGS.name, FLAGS.image, command, namespace=FLAGS.namespace, **_tasks(),
        gpus_per_worker=FLAGS["gpus-per-worker"].value, cpu=FLAGS.cpu,
        memory=FLAGS.memory, config=config_from_flags(), logdir=FLAGS.logdir,
        profiler_port=FLAGS["profiler-port"].value,
        restart_policy=FLAGS["restart-policy"].value,
        backoff_limit=FLAGS["backoff-limit"].value)
    if FLAGS.submit:
        submit(manifest)
        print(f"created TFJob {FLAGS.namespace}/{FLAGS.name}")
    else:
        sys.stdout.write(manifest.to_yaml())
    return 0


def _profile_command(args):
    """Records every listed task's profile at once; prints the files written."""
    if args:
        raise app.UsageError(f"`tfdist profile` takes no arguments, got {args}.")
    if not FLAGS.tasks or not FLAGS.logdir:
        raise app.UsageError("`tfdist profile` needs --tasks=host:port,... and --logdir.")
    from tfdist.profiling import capture

    for path in capture(FLAGS.tasks, FLAGS.logdir, FLAGS["duration-ms"].value):
        print(path)
    return 0


def _version_command(args):
    """Prints the versions of tfdist, TensorFlow and Keras."""
    import keras
    import tensorflow as tf

    import tfdist

    print(f"tfdist {tfdist.__version__}, tensorflow {tf.__version__}, "
          f"keras {keras.__version__}")


# command -> (function, the tfdist flags it takes)
COMMANDS = {
    "config": (_config_command, _CONFIG_FLAGS),
    "launch": (_launch_command, _CONFIG_FLAGS + _TASK_FLAGS
               + ("restart-on-failure", "timeout", "profiler-port")),
    "tfjob": (_tfjob_command, _CONFIG_FLAGS + _TASK_FLAGS
              + ("name", "image", "namespace", "gpus-per-worker", "cpu", "memory",
                 "logdir", "profiler-port", "restart-policy", "backoff-limit",
                 "submit")),
    "profile": (_profile_command, ("tasks", "logdir", "duration-ms")),
    "version": (_version_command, ()),
}
_OWN_FLAGS = {name for _, names in COMMANDS.values() for name in names}


def main(argv):
    if len(argv) < 2 or argv[1] not in COMMANDS:
        raise app.UsageError(
            f"usage: tfdist {{{'|'.join(COMMANDS)}}} [flags]; got "
            f"{argv[1:2] or 'no command'}.")
    command, allowed = COMMANDS[argv[1]]
    stray = sorted(n for n in _OWN_FLAGS - set(allowed) if FLAGS[n].present)
    if stray:
        raise app.UsageError(
            f"`tfdist {argv[1]}` does not take --{', --'.join(stray)}.")
    try:
        return command(argv[2:]) or 0
    except (ValueError, TypeError) as error:  # bad input
        print(f"tfdist {argv[1]}: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:  # e.g. no cluster to submit to
        print(f"tfdist {argv[1]}: {error}", file=sys.stderr)
        return 1


def run():
    """Console-script entry point (`tfdist` on the PATH)."""
    app.run(main)


if __name__ == "__main__":
    run()
