"""The `tfdist` command: an absl app with one subcommand per task.

    tfdist config  [--config parallel.json] [--data 4 --microbatches 2 ...]
        validates a ParallelConfig and prints it as JSON.
    tfdist launch  [--chief] --workers N [--ps M] [--evaluator]
                   [--restart-on-failure K] [--timeout S] [--profiler-port P]
                   [--host-network] [config flags] COMMAND...
        runs COMMAND as every task of a local cluster (TF_CONFIG on 127.0.0.1,
        in a private network unless --host-network).
    tfdist tfjob   --name NAME --image IMAGE [--namespace NS] [--chief] --workers N
                   [--ps M] [--evaluator] [--gpus-per-worker G] [--cpu C --memory M]
                   [--logdir PATH] [--profiler-port P] [--restart-policy POLICY]
                   [--backoff-limit B] [--submit] [config flags] COMMAND...
        prints a Kubeflow TFJob manifest (kubeflow.org/v1); --submit creates it.
    tfdist profile --tasks HOST:PORT,... --logdir DIR [--duration-ms MS]
        records a trace of every listed task's profiler server at once.
    tfdist plan    --model MODULE:FUNCTION --devices N --memory-per-device 16GiB
                   --batch-size B [--sequence-length S] [--hosts H]
                   [--link-bandwidth 10Gbit] [--measure K] [--json] [config flags]
        ranks every ParallelConfig for the model (tfdist.plan); config flags
        hold those fields; --json prints the best one's JSON.
    tfdist version
        prints the tfdist, TensorFlow and Keras versions.

`tfdist --help` lists the commands, `tfdist launch --help` one command's flags.
Flags are spelled `--kebab-case` (`--restart-on-failure`, `--virtual-stages`);
`--snake_case` is accepted too. Usage errors exit with status 2.
For launch and tfjob, everything from COMMAND's first word on is COMMAND's, as
with torchrun and `kubectl exec`: `tfdist launch --workers 2 python train.py
--data 2` gives `--data 2` to train.py (`--` before COMMAND works too).

Example:

    $ tfdist launch --workers=2 --microbatches=2 python train.py --epochs 3
"""

import collections
import dataclasses
import json
import re
import sys
import typing

from tfdist.logs import quiet_tensorflow, silenced_fds

# TensorFlow's C++ INFO and WARNING lines (CUDA probing, oneDNN, CPU features)
# are noise for a command-line tool; the user's own TF_CPP_MIN_LOG_LEVEL wins.
quiet_tensorflow()

from absl import app, flags  # noqa: E402

from tfdist.config import CHOICES, ParallelConfig  # noqa: E402

FLAGS = flags.FLAGS

# ParallelConfig fields (config, launch, tfjob): one flag per field, its
# help the field's description (`ParallelConfig.field_docs`), its type and
# choices the field's.
flags.DEFINE_string("config", None, "Path of a ParallelConfig JSON file; the "
                    "flags below override its fields.")


def _define_config_flags():
    docs = ParallelConfig.field_docs()
    for field in dataclasses.fields(ParallelConfig):
        name, help_text = field.name, docs.get(field.name, field.name.replace("_", " "))
        kind = next(t for t in typing.get_args(field.type) or (field.type,)
                    if t is not type(None))
        if name in CHOICES:
            flags.DEFINE_enum(name, None, [str(c) for c in CHOICES[name]], help_text)
        elif kind is bool:
            flags.DEFINE_boolean(name, None, help_text)
        elif kind is int:
            flags.DEFINE_integer(name, None, help_text)
        elif kind is str:  # checked by ParallelConfig.validate
            flags.DEFINE_string(name, None, help_text)
        elif typing.get_origin(kind) is tuple:
            flags.DEFINE_list(name, None, help_text)
        else:
            raise TypeError(f"ParallelConfig.{name}: no flag for a field of type {kind}.")
    return tuple(field.name for field in dataclasses.fields(ParallelConfig))


_CONFIG_FIELDS = _define_config_flags()
# The tasks of a job (launch, tfjob).
flags.DEFINE_boolean("chief", False, "Add a chief task.")
flags.DEFINE_integer("workers", 1, "Worker tasks (>= 1).")
flags.DEFINE_integer("ps", 0, "Parameter-server tasks.")
flags.DEFINE_boolean("evaluator", False, "Add an evaluator task.")
# launch
flags.DEFINE_integer("restart_on_failure", 0, "Restarts allowed per failing task.")
flags.DEFINE_float("timeout", None, "Seconds the whole job may take.")
flags.DEFINE_boolean("host_network", False, "Run the tasks in this host's network "
                     "(they reach other hosts; their TensorFlow servers, on every "
                     "interface, are reachable from them), not in a private one.")
# launch and tfjob
flags.DEFINE_boolean("release_memory", False, "Every task's allocators give freed memory "
                     "back to the system: a lower peak per worker, slower steps "
                     "(tfdist.cluster.release_memory).")
# tfjob
flags.DEFINE_string("name", None, "TFJob name (a Kubernetes name).")
flags.DEFINE_string("image", None, "Container image, with a tag or digest.")
flags.DEFINE_string("namespace", "default", "Kubernetes namespace.")
flags.DEFINE_integer("gpus_per_worker", 0, "GPUs of each chief and worker pod.")
flags.DEFINE_string("cpu", None, "CPU request and limit of each pod, e.g. 2 or 500m.")
flags.DEFINE_string("memory", None, "Memory request and limit of each pod, e.g. 4Gi.")
flags.DEFINE_string("logdir", None, "Log directory.")
flags.DEFINE_integer("profiler_port", None, "Port of each task's profiler server.")
flags.DEFINE_string("restart_policy", "OnFailure", "Pod restart policy.")
flags.DEFINE_integer("backoff_limit", None, "Retries before the job is failed.")
flags.DEFINE_list("env", None, "More environment variables of each pod, NAME=VALUE,... "
                  "e.g. MALLOC_ARENA_MAX=2.")
flags.DEFINE_boolean("submit", False, "Create the TFJob in the current kubeconfig's "
                     "cluster instead of printing it.")
# plan
flags.DEFINE_string("model", None, "MODULE:FUNCTION returning the compiled Keras model "
                    "(the module imported from the current directory or the path).")
flags.DEFINE_string("dataset", None, "With --measure, MODULE:FUNCTION taking the batch "
                    "size and returning a tf.data.Dataset of (inputs, targets).")
flags.DEFINE_integer("devices", None, "Devices to spread the model over.")
flags.DEFINE_string("memory_per_device", None, "Memory of each device, e.g. 16GiB.")
flags.DEFINE_integer("batch_size", None, "The global batch size.")
flags.DEFINE_integer("sequence_length", None, "Length of the model's unknown input "
                     "dimensions in a batch.")
flags.DEFINE_integer("hosts", 1, "Hosts the devices are spread over, equally.")
flags.DEFINE_string("link_bandwidth", "10Gbit", "Bandwidth between hosts, e.g. 10Gbit.")
flags.DEFINE_string("device_bandwidth", "100Gbit", "Bandwidth between the devices of a "
                    "host.")
flags.DEFINE_string("device_flops", None, "FLOP/s of one device, e.g. 1e12 (default: "
                    "measured on this host).")
flags.DEFINE_float("headroom", None, "The share of --memory-per-device kept free for the "
                   "predicted peak's error: a plan fits when its peak is within the rest "
                   "(default: tfdist.plan's, 0.15).")
flags.DEFINE_integer("measure", 0, "Train the first K plans that fit here for a few "
                     "steps and rank them by measured time.")
flags.DEFINE_integer("rows", 20, "Plans shown in the table.")
flags.DEFINE_boolean("json", False, "Print only the best plan's ParallelConfig as JSON.")
# profile
flags.DEFINE_list("tasks", None, "host:port of each task's profiler server.")
flags.DEFINE_integer("duration_ms", 2000, "How long to record, in milliseconds.")

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
    return ParallelConfig.from_dict(config_fields_given())


def config_fields_given() -> dict:
    """The ParallelConfig fields `--config`'s file and the field flags give
    (the flags win), unchecked: what `tfdist plan` holds.

    Example:

    >>> FLAGS(["tfdist", "--zero=3"])
    ['tfdist']
    >>> config_fields_given()
    {'zero': 3}
    >>> FLAGS.unparse_flags()
    """
    values = {}
    if FLAGS.config:
        try:
            with open(FLAGS.config) as f:
                values = json.load(f)
        except OSError as error:
            raise ValueError(f"--config={FLAGS.config}: cannot read it "
                             f"({error.strerror}).") from error
        except json.JSONDecodeError as error:
            raise ValueError(f"--config={FLAGS.config} is not valid JSON "
                             f"({error}).") from error
    for name in _CONFIG_FIELDS:
        if FLAGS[name].value is not None:
            values[name] = FLAGS[name].value
    return values


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
                  restart_on_failure=FLAGS.restart_on_failure,
                  timeout=FLAGS.timeout, config=config_from_flags(),
                  profiler_port=FLAGS.profiler_port,
                  host_network=FLAGS.host_network,
                  release_memory=FLAGS.release_memory)


def _tfjob_command(command):
    """Prints the TFJob manifest for COMMAND, or submits it with --submit."""
    from tfdist.cluster.tfjob import submit, tfjob

    for name in ("name", "image"):
        if not FLAGS[name].value:
            raise app.UsageError(f"`tfdist tfjob` needs --{name}.")
    manifest = tfjob(
        FLAGS.name, FLAGS.image, command, namespace=FLAGS.namespace, **_tasks(),
        gpus_per_worker=FLAGS.gpus_per_worker, cpu=FLAGS.cpu,
        memory=FLAGS.memory, config=config_from_flags(), logdir=FLAGS.logdir,
        profiler_port=FLAGS.profiler_port,
        restart_policy=FLAGS.restart_policy,
        backoff_limit=FLAGS.backoff_limit, env=_env_items(FLAGS.env),
        release_memory=FLAGS.release_memory)
    if FLAGS.submit:
        submit(manifest)
        print(f"created TFJob {FLAGS.namespace}/{FLAGS.name}")
    else:
        sys.stdout.write(manifest.to_yaml())
    return 0


def _env_items(items):
    """`--env`'s NAME=VALUE items as a dict (None without any)."""
    env = {}
    for item in items or ():
        name, equals, value = item.partition("=")
        if not equals:
            raise app.UsageError(f"`tfdist tfjob --env` takes NAME=VALUE items, got "
                                 f"{item!r}.")
        env[name] = value
    return env or None


def _profile_command(args):
    """Records every listed task's profile at once; prints the files written."""
    if args:
        raise app.UsageError(f"`tfdist profile` takes no arguments, got {args}.")
    if not FLAGS.tasks or not FLAGS.logdir:
        raise app.UsageError("`tfdist profile` needs --tasks=host:port,... and --logdir.")
    from tfdist.profiling import capture

    # TensorFlow's import (cuInit on a host without a GPU driver) and its
    # profiler client (its attempts, and on failure a tip naming its own flag,
    # --num_tracing_attempts) write to the process's stdout and stderr: kept
    # aside, and a failure told in tfdist's words. Bad arguments are refused
    # before TensorFlow is imported.
    try:
        with silenced_fds():
            paths = capture(FLAGS.tasks, FLAGS.logdir, FLAGS.duration_ms)
    except RuntimeError as error:
        print(f"tfdist profile: no trace recorded from {', '.join(FLAGS.tasks)}: "
              f"{str(error).strip()}\nCheck that each task runs with its profiler server "
              f"on that port (`tfdist launch --profiler-port=P`, or "
              f"$TFDIST_PROFILER_PORT) and is running TensorFlow work (training) "
              f"while it is captured; a longer --duration-ms helps with slow steps. "
              f"A task that was answering and stopped may have been aborted by "
              f"TensorFlow 2.20's profiler (a MultiWorkerStrategy task other than "
              f"the chief, see the README's limits): a job launched with "
              f"--restart-on-failure resumes it from its last backup.",
              file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


def _plan_command(args):
    """Prints the ranked plans for --model (or the best one's JSON)."""
    if args:
        raise app.UsageError(f"`tfdist plan` takes no arguments, got {args}.")
    for name in ("model", "devices", "memory_per_device", "batch_size"):
        if FLAGS[name].value is None:
            raise app.UsageError(f"`tfdist plan` needs {spelled(name)}.")
    from absl import logging

    held = dict(config_fields_given())
    with silenced_fds((2,)):  # TensorFlow's import: cuInit on a host without a GPU driver
        import tfdist

        model = _function_named(FLAGS.model, "model")
        dataset = _function_named(FLAGS.dataset, "dataset") if FLAGS.dataset else None
    logging.set_verbosity(logging.WARNING)  # tf.distribute's INFO lines, from --measure
    if (FLAGS.measure or not FLAGS.device_flops) and not tf_gpus():
        # timed on this host's processor split into the planned devices
        tfdist.use_virtual_devices(FLAGS.devices)
    plans = tfdist.plan(
        model, devices=FLAGS.devices, memory_per_device=FLAGS.memory_per_device,
        batch_size=FLAGS.batch_size, sequence_length=FLAGS.sequence_length,
        hosts=FLAGS.hosts, link_bandwidth=FLAGS.link_bandwidth,
        device_bandwidth=FLAGS.device_bandwidth,
        device_flops=FLAGS.device_flops, measure=FLAGS.measure, dataset=dataset,
        **({} if FLAGS.headroom is None else {"headroom": FLAGS.headroom}), **held)
    print(plans.best.config.to_json() if FLAGS.json else plans.table(FLAGS.rows))
    return 0


def tf_gpus():
    """The GPUs TensorFlow sees (its devices not yet initialised)."""
    import tensorflow as tf

    return tf.config.list_physical_devices("GPU")


def _function_named(spec, flag):
    """The function `module:function` names (the module found from the
    current directory first)."""
    import importlib
    import os

    module, colon, name = spec.partition(":")
    if not colon or not module or not name.isidentifier():
        raise ValueError(f"--{flag}={spec!r}: give it as MODULE:FUNCTION, e.g. "
                         f"my_models:build_gpt2.")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        imported = importlib.import_module(module)
    except Exception as error:  # the user's module: whatever its import raised
        raise ValueError(f"--{flag}={spec!r}: importing {module!r} failed: "
                         f"{type(error).__name__}: {error}") from error
    function = getattr(imported, name, None)
    if function is None:
        raise ValueError(f"--{flag}={spec!r}: {module!r} has no {name!r}.")
    if not callable(function):
        raise ValueError(f"--{flag}={spec!r}: {name!r} is not a function.")
    return function


def _version_command(args):
    """Prints the versions of tfdist, TensorFlow and Keras."""
    if args:
        raise app.UsageError(f"`tfdist version` takes no arguments, got {args}.")
    # Importing TensorFlow logs at ERROR on a host without a GPU driver
    # (cuInit): not news when asking for a version.
    with silenced_fds((2,)):
        import keras
        import tensorflow as tf

    import tfdist

    print(f"tfdist {tfdist.__version__}, tensorflow {tf.__version__}, "
          f"keras {keras.__version__}")


_Command = collections.namedtuple("_Command", "run flags summary example")
COMMANDS = {
    "config": _Command(_config_command, _CONFIG_FLAGS,
                       "Validate a ParallelConfig and print it as JSON.",
                       "tfdist config --config parallel.json --microbatches 4"),
    "launch": _Command(_launch_command, _CONFIG_FLAGS + _TASK_FLAGS
                       + ("restart_on_failure", "timeout", "profiler_port",
                          "host_network", "release_memory"),
                       "Run COMMAND as every task of a local cluster (TF_CONFIG on "
                       "127.0.0.1).",
                       "tfdist launch --workers 2 --microbatches 2 python train.py "
                       "--epochs 3"),
    "tfjob": _Command(_tfjob_command, _CONFIG_FLAGS + _TASK_FLAGS
                      + ("name", "image", "namespace", "gpus_per_worker", "cpu",
                         "memory", "logdir", "profiler_port", "restart_policy",
                         "backoff_limit", "env", "release_memory", "submit"),
                      "Print a Kubeflow TFJob manifest for COMMAND (--submit creates it).",
                      "tfdist tfjob --name mnist --image registry.example.com/mnist:1 "
                      "--workers 2 python train.py"),
    "profile": _Command(_profile_command, ("tasks", "logdir", "duration_ms"),
                        "Record a trace of every listed task's profiler server at once.",
                        "tfdist profile --tasks 127.0.0.1:6009,127.0.0.1:6010 "
                        "--logdir logs"),
    "plan": _Command(_plan_command, _CONFIG_FLAGS + (
                         "model", "dataset", "devices", "memory_per_device", "batch_size",
                         "sequence_length", "hosts", "link_bandwidth", "device_bandwidth",
                         "device_flops", "headroom", "measure", "rows", "json"),
                     "Rank every ParallelConfig for a model, devices and memory "
                     "(tfdist.plan); a config flag holds its field in every plan.",
                     "tfdist plan --model my_models:build_gpt2 --devices 8 "
                     "--memory-per-device 16GiB --batch-size 64 --sequence-length 1024"),
    "version": _Command(_version_command, (),
                        "Print the tfdist, TensorFlow and Keras versions.",
                        "tfdist version"),
}
# A flag's help where it means something else for this command.
_COMMAND_HELP = {
    "launch": {
        "workers": "Worker tasks (>= 1), local processes.",
        "profiler_port": "Port of task 0's profiler server; task k gets this port + k, "
                         "forwarded from this host's 127.0.0.1 (TFDIST_PROFILER_PORT).",
    },
    "tfjob": {
        "chief": "Add a chief pod.",
        "workers": "Worker pods (>= 1).",
        "ps": "Parameter-server pods.",
        "evaluator": "Add an evaluator pod.",
        "logdir": "Log directory given to the pods (TFDIST_LOGDIR).",
        "profiler_port": "Port of each pod's profiler server, exposed on the pod "
                         "(TFDIST_PROFILER_PORT).",
    },
    "profile": {
        "tasks": "host:port of each task's profiler server, comma-separated.",
        "logdir": "TensorBoard log directory the traces are written to (one run, "
                  "one file per task).",
    },
}
_TAKES_A_COMMAND = ("launch", "tfjob")
_OWN_FLAGS = {name for command in COMMANDS.values() for name in command.flags}
# absl's --helpshort and --helpfull would list its own flags: every help is ours.
_HELP_FLAGS = ("-h", "--help", "-help", "--helpshort", "-helpshort", "--helpfull",
               "-helpfull")
_FLAG_WORD = re.compile(r"^(--?)([A-Za-z][A-Za-z0-9_-]*)(=.*)?$", re.DOTALL)


def spelled(name: str) -> str:
    """A flag's documented spelling: `--kebab-case`.

    Example:

    >>> spelled("restart_on_failure")
    '--restart-on-failure'
    """
    return "--" + name.replace("_", "-")


def normalise(word: str) -> str:
    """A command-line word with its flag name in absl's spelling (underscores).

    Both `--restart-on-failure=2` and `--restart_on_failure=2` are accepted;
    values and words that are not flags are left as they are.

    Example:

    >>> normalise("--virtual-stages=2"), normalise("--no-host-network"), normalise("-1")
    ('--virtual_stages=2', '--nohost_network', '-1')
    """
    match = _FLAG_WORD.match(word)
    if match is None:
        return word
    name = match[2].replace("-", "_")
    if name.startswith("no_") and name[3:] in FLAGS and name not in FLAGS:
        name = "no" + name[3:]  # absl's negation of a boolean: --nohost_network
    return match[1] + name + (match[3] or "")


def overview() -> str:
    """`tfdist --help`: the commands, one line each.

    Example:

    >>> "launch" in overview()
    True
    """
    width = max(map(len, COMMANDS))
    lines = ["usage: tfdist COMMAND [flags] [-- program args...]", "", "Commands:"]
    lines += [f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items()]
    lines += ["", "Run `tfdist COMMAND --help` for a command's flags.",
              "Example: " + COMMANDS["launch"].example]
    return "\n".join(lines)


def command_help(name: str) -> str:
    """`tfdist NAME --help`: the command's summary, flags and an example.

    Example:

    >>> "--workers" in command_help("launch")
    True
    """
    command = COMMANDS[name]
    usage = f"usage: tfdist {name} [flags]"
    if name in _TAKES_A_COMMAND:
        usage += " COMMAND [args...]"
    lines = [usage, "", command.summary]
    if command.flags:
        lines += ["", "Flags:"]
        for flag in command.flags:
            value = FLAGS[flag]
            default = "" if value.default in (None, False) else f" (default: {value.default})"
            text = _COMMAND_HELP.get(name, {}).get(flag, value.help)
            lines.append(f"  {spelled(flag):<22} {text}{default}")
    if name in _TAKES_A_COMMAND:
        lines += ["", "Everything from COMMAND's first word on is passed to COMMAND."]
    if command.flags:
        lines += ["", "Flags are spelled --kebab-case; their names with underscores for "
                  "hyphens are accepted too."]
    lines += ["", "Example:", f"  {command.example}"]
    return "\n".join(lines)


def split_argv(argv):
    """(tfdist's own argv, COMMAND) of a `tfdist launch|tfjob ...` command line.

    tfdist's flags come first; COMMAND starts at the first word that is not a
    flag nor a flag's value (or after `--`), and keeps all its own flags.

    Example:

    >>> split_argv(["tfdist", "launch", "--workers", "2", "python", "t.py", "--data", "2"])
    (['tfdist', 'launch', '--workers', '2'], ['python', 't.py', '--data', '2'])
    """
    own = list(argv[:2])
    rest = list(argv[2:])
    while rest:
        word = rest.pop(0)
        if word == "--":
            return own, rest
        if not word.startswith("-"):
            return own, [word] + rest
        word = normalise(word)
        own.append(word)
        name = word.lstrip("-").split("=", 1)[0]
        if "=" not in word and name in FLAGS and not isinstance(
                FLAGS[name], flags.BooleanFlag) and rest:
            own.append(rest.pop(0))
    return own, []


def _parse_flags(argv):
    """absl's parsing, with a flag error a usage error (exit 2) in one line."""
    try:
        return FLAGS(argv)
    except flags.Error as error:
        name = argv[1] if len(argv) > 1 else ""
        print(f"tfdist {name}: {error}\nSee `tfdist {name} --help`.", file=sys.stderr)
        sys.exit(2)


def main(argv):
    name = argv[1]
    command = COMMANDS[name]
    try:
        stray = sorted(n for n in _OWN_FLAGS - set(command.flags) if FLAGS[n].present)
        if stray:
            raise app.UsageError(
                f"`tfdist {name}` does not take {', '.join(map(spelled, stray))}; see "
                f"`tfdist {name} --help`.")
        return command.run(argv[2:]) or 0
    except app.UsageError as error:  # names the command itself
        print(error, file=sys.stderr)
        return 2
    except (ValueError, TypeError) as error:  # bad input
        print(f"tfdist {name}: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:  # e.g. no cluster to submit to
        print(f"tfdist {name}: {error}", file=sys.stderr)
        return 1


def run(argv=None):
    """Console-script entry point (`tfdist` on the PATH).

    Help is answered here (exit 0); everything else goes to the absl app,
    with a launch or tfjob COMMAND after `--`.
    """
    argv = list(sys.argv if argv is None else argv)
    if len(argv) > 2 and argv[1] == "help" and argv[2] in COMMANDS:
        argv = [argv[0], argv[2], "--help"]  # `tfdist help launch`
    if len(argv) < 2 or argv[1] in _HELP_FLAGS + ("help",):
        print(overview(), file=sys.stdout if len(argv) >= 2 else sys.stderr)
        sys.exit(0 if len(argv) >= 2 else 2)
    name = argv[1]
    if name not in COMMANDS:
        print(f"tfdist: unknown command {name!r}; commands are "
              f"{', '.join(COMMANDS)} (see `tfdist --help`).", file=sys.stderr)
        sys.exit(2)
    if name in _TAKES_A_COMMAND:
        own, command = split_argv(argv)
    else:
        own, command = argv[:2] + [normalise(word) for word in argv[2:]], []
    if any(word in _HELP_FLAGS for word in own[2:]):
        print(command_help(name))
        sys.exit(0)
    app.run(main, argv=own + (["--"] + command if command else []),
            flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
