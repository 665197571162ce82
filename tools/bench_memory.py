"""Benchmark: peak memory per worker of a model-parallel `fit`, against one process.

    python tools/bench_memory.py [--width=4096] [--layers=8] [--workers=4]
        [--modes=single,zero0,zero1,zero2,zero3,tensor4,pipeline4,data2_tensor2_zero3,
                 chief_pipeline4,int8,topk,powersgd,zero3_int8,one_bit_adam]
        [--task_env=TF_ENABLE_ONEDNN_OPTS=0,MALLOC_ARENA_MAX=2] [--release_memory]
        [--checkpoint] [--out=results.jsonl]

A model-parallel mode exists so that a model one worker cannot train alone
trains on several: each worker's *peak* (not only its steady state) must be a
fraction of one process's. Each mode trains the same MLP (`--layers` square
Dense layers of `--width` units, Adam (`one_bit_adam`: `tfdist.optim.OneBitAdam`,
compressing after 2 steps), float32; 8 x 4096 is 0.5 GiB of
parameters) for `--epochs` epochs of `model.fit`:

- `single`: one process, no strategy, the whole model;
- every other mode: `tfdist launch --workers N`, each task a
  `MultiWorkerStrategy` with that `ParallelConfig` on one CPU device;
  `chief_pipeline4`: `tfdist launch --chief --workers N`, a
  `tfdist.ChiefStrategy(pipeline=4, microbatches=4)`: the chief trains, stage
  k on worker k, and each worker, serving, writes its own measures.

Each process measures its baseline (RSS once TensorFlow and the strategy
exist), resets its high-water mark (`/proc/self/clear_refs`), builds,
compiles and fits, then reads its peak (`VmHWM`), the peak of the bytes
TensorFlow's CPU allocator had handed out at once (its tensors, by its own
count: `tf.config.experimental.get_memory_info`), and the strategy's
prediction of the peak (`Strategy.predicted_peak`). One JSON line per process,
then a table of each mode's worst worker against `single` and the prediction.

    python tools/bench_memory.py --plan=1.5GiB --release_memory
        [--workers=2 --devices_per_worker=2] [--model=convnet|gpt2|llama|bert --width=768 ...]
        [--plan_fields=microbatches=1]

`tfdist.plan`'s memory, run: the plans of the model for `--workers` hosts
of `--devices_per_worker` devices and `--plan` bytes per device; every plan
it says fits (and the `--over` smallest that do not) trained as a launched
job with that `ParallelConfig`, each worker's peak above its baseline (and
TensorFlow's count of its tensors at their peak, where its allocator keeps
one) against the plan's predicted peak, per device. With `--workers=1`, one
process of `--devices_per_worker` logical devices under
`tfdist.Strategy(config)` instead, every layout on them. Where a worker has
several devices (one allocator), its peak is set against as many times the
prediction, then the mean over its devices (`not_at_once_bytes`). One JSON
line per plan, then a table.

    python tools/bench_memory.py --cap=0.8 --modes=zero3,tensor4

The demonstration: each process capped (a memory cgroup the bench makes;
needs root or a delegated cgroup subtree) at `--cap` times what the kernel
charges one process training the model whole at its peak. One uncapped process
trains the reference; one capped process must be killed for memory; every
mode of `--modes`, each of its workers capped, must train to the reference's
losses and weights (rtol 1e-4).
"""

import contextlib
import errno
import functools
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
from absl import app, flags

from results import emit
from tfdist.cluster.release_memory import release_memory_env

# keras-hub backbones of the language models --model takes: their names here.
LANGUAGE_MODELS = {"gpt2": "GPT-2", "llama": "Llama", "bert": "BERT", "qwen2": "Qwen2"}
flags.DEFINE_enum("model", "mlp", ["mlp", "convnet", *LANGUAGE_MODELS],
                  "What every mode trains: the MLP; keras-io's convnet of 'Image "
                  "classification from scratch' (`--layers` residual blocks of separable "
                  "convolutions and batch normalisation, the first of `--width` filters, each "
                  "next twice the last's, on `--image_size` square RGB images, 10 classes); or "
                  "keras-hub's GPT2Backbone, LlamaBackbone or BertBackbone (`--layers` blocks of "
                  "width `--width`, `--vocabulary` tokens, `--sequence_length`) with a Dense "
                  "token classifier; or keras-hub's Qwen2Backbone likewise, with 2 key-value "
                  "heads (grouped-query attention) and its token embedding tied to its "
                  "classifier (the logits from its reverse).")
flags.DEFINE_integer("width", 4096, "Units of each square Dense layer (a language model: "
                     "hidden width).")
flags.DEFINE_integer("layers", 8, "Dense layers (a language model: transformer blocks).")
flags.DEFINE_integer("vocabulary", 16384, "A language model's tokens of the vocabulary.")
flags.DEFINE_integer("sequence_length", 32, "A language model's tokens per example.")
flags.DEFINE_integer("image_size", 64, "The convnet's image height and width, in pixels.")
flags.DEFINE_integer("workers", 4, "Worker tasks of the launched modes.")
flags.DEFINE_integer("epochs", 2, "Epochs of fit.")
flags.DEFINE_integer("examples", 64, "Training examples (batch 16).")
flags.DEFINE_list("modes", ["single", "zero0", "zero1", "zero2", "zero3", "tensor4",
                            "pipeline4", "data2_tensor2_zero3"],
                  "What to run (see the module docstring).")
flags.DEFINE_float("cap", None, "Instead of the table, the demonstration: each process of "
                   "every mode in --modes capped (a cgroup memory limit) at this fraction of "
                   "what one uncapped process training the whole model is charged at its "
                   "peak; one capped process must fail.")
flags.DEFINE_bool("checkpoint", False, "Also measure checkpoints: each trained task saves "
                  "a sharded checkpoint (`tfdist.checkpoint.ShardedCheckpoint`), then a Keras "
                  "weights file of whole tensors (`save_weights`, one file per task); then "
                  "two new jobs of the same mode build the model and read one each; the "
                  "peaks of each save and of each build with its read, against the training "
                  "peak.")
flags.DEFINE_string("plan", None, "Instead of --modes: plan the model for --workers hosts "
                    "of this memory per device (such as 1.5GiB) and run every plan that fits "
                    "(--workers=1: in one process of --devices_per_worker devices).")
flags.DEFINE_integer("devices_per_worker", 1, "With --plan: each worker's logical CPU "
                     "devices (`tfdist.use_virtual_devices`); tensor groups and pipeline "
                     "stages stay within a worker, so plans with them need 2 or more.")
flags.DEFINE_list("plan_fields", [], "With --plan: KEY=VALUE fields every plan holds "
                  "(`tfdist.plan`'s keywords), such as microbatches=1.")
flags.DEFINE_integer("over", 2, "With --plan, also run this many of the plans that do not "
                     "fit (the smallest predicted peaks).")
flags.DEFINE_string("mode", None, "Internal: the mode this task runs.")
flags.DEFINE_string("config", None, "Internal: the `ParallelConfig` (JSON file) of a "
                    "plan's task in one process.")
flags.DEFINE_string("checkpoint_dir", None, "Internal: the sharded checkpoint's directory.")
flags.DEFINE_enum("restore", None, ["sharded", "h5"], "Internal: build the model and read "
                  "the sharded checkpoint or this task's weights file instead of training.")
flags.DEFINE_integer("cap_bytes", None, "Internal: this task's memory limit.")
flags.DEFINE_string("weights", None, "Internal: where the first task saves the trained weights.")
flags.DEFINE_string("report", None, "Internal: where this task writes its measures.")
flags.DEFINE_list("task_env", [], "KEY=VALUE environment variables of every process of "
                  "every mode, e.g. the allocator's: TF_ENABLE_ONEDNN_OPTS=0,MALLOC_ARENA_MAX=2.")
flags.DEFINE_bool("release_memory", False, "Launch every mode with `tfdist launch "
                  "--release_memory` (tfdist.cluster.release_memory); `single` then runs "
                  "twice, as it is and with the same settings.")
flags.DEFINE_string("out", None, "Also append the JSON lines to this file.")
flags.register_validator("task_env", lambda items: all(item.split("=")[0] and "=" in item
                                                        for item in items),
                         "--task_env takes KEY=VALUE items")
FLAGS = flags.FLAGS
ROOT = pathlib.Path(__file__).resolve().parents[1]
BATCH = 16
CGROUP_PREFIX = "tfdist-bench-memory-"
# The checkpoint peaks of `--checkpoint`, each `<key>_peak_above_baseline_bytes`.
CHECKPOINT_PEAKS = ["sharded_save", "h5_save", "sharded_read", "h5_read"]
# A mode's ParallelConfig fields, as `tfdist launch` flags.
MODES = {"zero0": [], "zero1": ["--zero=1"], "zero2": ["--zero=2"], "zero3": ["--zero=3"],
         "tensor4": ["--tensor=4"], "pipeline4": ["--pipeline=4", "--microbatches=4"],
         "data2_tensor2_zero3": ["--tensor=2", "--zero=3"],
         "int8": ["--compression=int8"], "topk": ["--compression=topk:0.01"],
         "powersgd": ["--compression=powersgd:4"], "one_bit_adam": [],
         "zero3_int8": ["--zero=3", "--compression=int8"],
         "chief_pipeline4": ["--chief", "--pipeline=4", "--microbatches=4"]}
# Modes of `tfdist.ChiefStrategy`: the chief trains, the workers only serve.
CHIEF_MODES = ("chief_pipeline4",)
# A plan in one process of several devices (`--plan --workers=1`).
ONE_HOST = "one_host"
# The one process again, with the allocator settings of `--release_memory`.
RELEASED_SINGLE = "single, memory released"


def status_bytes(field):
    """A `VmRSS` / `VmHWM` line of /proc/self/status, in bytes."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def cap_memory(limit):
    """Puts this process in a new memory cgroup limited to `limit` bytes
    (cgroup v1 or v2; needs the right to make one: root, or a delegated
    subtree)."""
    v1 = pathlib.Path("/sys/fs/cgroup/memory")
    root, limit_file = (v1, "memory.limit_in_bytes") if v1.is_dir() else (
        pathlib.Path("/sys/fs/cgroup"), "memory.max")
    group = root / f"{CGROUP_PREFIX}{os.getpid()}"
    group.mkdir()
    (group / limit_file).write_text(str(limit))
    (group / "cgroup.procs").write_text(str(os.getpid()))


def run_task():
    """Trains once in this process (under the launched job's strategy, or
    none) and writes baseline and peak to `--report`."""
    if FLAGS.cap_bytes:
        cap_memory(FLAGS.cap_bytes)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    import tfdist

    strategy = None
    if FLAGS.devices_per_worker > 1:
        tfdist.use_virtual_devices(FLAGS.devices_per_worker)
    if FLAGS.mode in CHIEF_MODES:
        if _task_name().startswith("worker"):  # serves in the strategy: measured aside
            threading.Thread(target=report_while_serving, daemon=True).start()
        strategy = tfdist.ChiefStrategy(config=tfdist.ParallelConfig.from_env())
    elif FLAGS.mode == ONE_HOST:
        config = tfdist.ParallelConfig.from_json(pathlib.Path(FLAGS.config).read_text())
        strategy = tfdist.Strategy(config)
    elif FLAGS.mode != "single":
        strategy = tfdist.MultiWorkerStrategy(config=tfdist.ParallelConfig.from_env())
    x, y = training_data()
    if FLAGS.model in LANGUAGE_MODELS:
        import keras_hub  # noqa: F401  (its modules, 0.04 GiB, are not the model's memory)
    baseline = status_bytes("VmRSS")
    reset_peak()
    tensor_peak_bytes(reset=True)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = build_model()
    if FLAGS.restore:  # a restarted job: the model built, then the checkpoint read
        if FLAGS.restore == "sharded":
            tfdist.checkpoint.ShardedCheckpoint(model, FLAGS.checkpoint_dir).restore()
        else:
            with strategy.scope() if strategy else contextlib.nullcontext():
                model.optimizer.build(model.trainable_variables)
            model.load_weights(_weights_file())
        record = {"mode": FLAGS.mode, "task": _task_name(), "baseline_bytes": baseline,
                  f"{FLAGS.restore}_read_peak_above_baseline_bytes":
                      status_bytes("VmHWM") - baseline}
        return write_report(record)
    started = time.monotonic()
    history = model.fit(x, y, batch_size=BATCH, epochs=FLAGS.epochs, verbose=0, shuffle=False)
    record = {"mode": FLAGS.mode, "task": _task_name(), "baseline_bytes": baseline,
              "peak_bytes": status_bytes("VmHWM"),
              "parameter_bytes": 4 * model.count_params(),
              "fit_seconds": round(time.monotonic() - started, 1),
              "final_loss": history.history["loss"][-1], "losses": history.history["loss"],
              "tensor_peak_bytes": tensor_peak_bytes()}
    record["peak_above_baseline_bytes"] = record["peak_bytes"] - baseline
    if strategy is not None:
        estimate = strategy.predicted_peak(model, BATCH, sequence_length())
        record["predicted_peak_bytes"] = estimate.total
        record["predicted_parts"] = dict(vars(estimate))
    if FLAGS.checkpoint_dir:
        reset_peak()
        tfdist.checkpoint.ShardedCheckpoint(model, FLAGS.checkpoint_dir,
                                            asynchronous=False).save()
        record["sharded_save_peak_above_baseline_bytes"] = status_bytes("VmHWM") - baseline
        reset_peak()
        model.save_weights(_weights_file())  # every task gathers each weight
        record["h5_save_peak_above_baseline_bytes"] = status_bytes("VmHWM") - baseline
    if FLAGS.weights:  # every task reads (gathers) each weight; the first saves it
        first = record["task"] in ("single:0", "worker:0", "chief:0")
        for i, variable in enumerate(model.weights):
            value = variable.numpy()
            if first:
                np.save(pathlib.Path(FLAGS.weights, f"{i}.npy"), value)
    write_report(record)


def build_model():
    """The compiled model every mode trains (seeded: each builds the same)."""
    import keras

    import tfdist

    keras.utils.set_random_seed(0)
    if FLAGS.model in LANGUAGE_MODELS:
        import keras_hub

        shape = dict(vocabulary_size=FLAGS.vocabulary, num_layers=FLAGS.layers,
                     hidden_dim=FLAGS.width, intermediate_dim=4 * FLAGS.width)
        heads = FLAGS.width // 64
        if FLAGS.model == "qwen2":
            body = keras_hub.models.Qwen2Backbone(num_query_heads=heads, num_key_value_heads=2,
                                                  tie_word_embeddings=True, **shape)
        elif FLAGS.model == "llama":
            body = keras_hub.models.LlamaBackbone(num_query_heads=heads,
                                                  num_key_value_heads=heads, **shape)
        else:
            backbone = {"gpt2": keras_hub.models.GPT2Backbone,
                        "bert": keras_hub.models.BertBackbone}[FLAGS.model]
            body = backbone(num_heads=heads, max_sequence_length=FLAGS.sequence_length,
                            dropout=0.0, **shape)
        tokens = body.output["sequence_output"] if FLAGS.model == "bert" else body.output
        classifier = (functools.partial(body.token_embedding, reverse=True)
                      if FLAGS.model == "qwen2" else keras.layers.Dense(FLAGS.vocabulary))
        model = keras.Model(body.input, classifier(tokens))
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    elif FLAGS.model == "convnet":
        model = convnet(keras)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        model = keras.Sequential([keras.Input((FLAGS.width,))] + [
            keras.layers.Dense(FLAGS.width, activation="relu") for _ in range(FLAGS.layers)])
        loss = "mse"
    # one_bit_adam: compressed from the third of its 8 steps
    model.compile(optimizer=tfdist.optim.OneBitAdam(1e-3, warmup_steps=2)
                  if FLAGS.mode == "one_bit_adam" else "adam", loss=loss)
    return model


def convnet(keras):
    """keras-io's "Image classification from scratch" network, its blocks'
    filters from `--width` (keras-io's: 3 blocks from 256)."""
    layers = keras.layers
    inputs = keras.Input((FLAGS.image_size, FLAGS.image_size, 3))
    x = layers.Conv2D(FLAGS.width // 2, 3, strides=2, padding="same")(inputs)
    x = layers.Activation("relu")(layers.BatchNormalization()(x))
    previous = x
    for block in range(FLAGS.layers):
        size = FLAGS.width << block
        for _ in range(2):
            x = layers.Activation("relu")(x)
            x = layers.BatchNormalization()(layers.SeparableConv2D(size, 3, padding="same")(x))
        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
        x = previous = layers.add([x, layers.Conv2D(size, 1, strides=2, padding="same")(previous)])
    x = layers.Activation("relu")(layers.BatchNormalization()(
        layers.SeparableConv2D(2 * size, 3, padding="same")(x)))
    x = layers.Dropout(0.25)(layers.GlobalAveragePooling2D()(x))
    return keras.Model(inputs, layers.Dense(10)(x))


def training_data():
    """(x, y) of `--examples` rows for `build_model`'s model (seeded)."""
    rng = np.random.default_rng(0)
    if FLAGS.model in LANGUAGE_MODELS:
        shape = (FLAGS.examples, FLAGS.sequence_length)
        tokens = rng.integers(0, FLAGS.vocabulary, size=shape).astype("int32")
        x = {"token_ids": tokens, "padding_mask": np.ones(shape, "int32")}
        if FLAGS.model == "bert":
            x["segment_ids"] = np.zeros(shape, "int32")
        return x, rng.integers(0, FLAGS.vocabulary, size=shape).astype("int32")
    if FLAGS.model == "convnet":
        shape = (FLAGS.examples, FLAGS.image_size, FLAGS.image_size, 3)
        return (rng.uniform(size=shape).astype("float32"),
                rng.integers(0, 10, size=FLAGS.examples).astype("int32"))
    return tuple(rng.normal(size=(FLAGS.examples, FLAGS.width)).astype("float32")
                 for _ in range(2))


def sequence_length():
    """Tokens per example, or None for the MLP and the convnet."""
    return FLAGS.sequence_length if FLAGS.model in LANGUAGE_MODELS else None


def model_name():
    """What `build_model` builds, for the tables."""
    if FLAGS.model in LANGUAGE_MODELS:
        return (f"{LANGUAGE_MODELS[FLAGS.model]} ({FLAGS.layers} blocks of width "
                f"{FLAGS.width}, vocabulary {FLAGS.vocabulary}, sequence "
                f"{FLAGS.sequence_length})")
    if FLAGS.model == "convnet":
        return (f"keras-io convnet ({FLAGS.layers} blocks from {FLAGS.width} filters, "
                f"{FLAGS.image_size} x {FLAGS.image_size} images)")
    return f"{FLAGS.layers} x Dense({FLAGS.width})"


def report_while_serving(period_seconds=0.2, settle_seconds=0.3, timeout_seconds=300.0):
    """A `tfdist.ChiefStrategy` worker's measures, written every
    `period_seconds` until its process ends: it serves the chief's steps
    inside the strategy and ends with the chief, never returning to the
    script. Its baseline, as a `MultiWorkerStrategy` task's includes its
    server, is its RSS once its server accepts connections (and
    `settle_seconds` more, for the server's own set-up; the chief builds
    nothing before every worker serves). A server not accepting within
    `timeout_seconds` ends the thread with an error naming it and writes no
    report (the bench then names the task that did not report)."""
    address = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][
        int(_task_name().split(":")[1])]
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_seconds
    while True:
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), 0.1):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{_task_name()}'s server at {address} accepted no "
                               f"connection within {timeout_seconds:g} s: no measures")
        time.sleep(0.02)
    time.sleep(settle_seconds)
    baseline = status_bytes("VmRSS")
    reset_peak()
    tensor_peak_bytes(reset=True)
    while True:
        peak = status_bytes("VmHWM")
        write_report({"mode": FLAGS.mode, "task": _task_name(), "baseline_bytes": baseline,
                      "peak_bytes": peak, "peak_above_baseline_bytes": peak - baseline,
                      "tensor_peak_bytes": tensor_peak_bytes()})
        time.sleep(period_seconds)


def tensor_peak_bytes(reset=False):
    """The most bytes TensorFlow's CPU allocator has had handed out at once
    (its own count: tensors, not the memory its pool or malloc keep) since
    the last reset, or None where the allocator keeps no count."""
    import tensorflow as tf

    try:
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    except ValueError:  # "Allocator stats not available"
        return None
    if reset:
        tf.config.experimental.reset_memory_stats("CPU:0")
    return peak or None  # (0 where the allocator in use, such as malloc's, keeps none)


def reset_peak():
    """Sets this process's `VmHWM` to its current `VmRSS`."""
    pathlib.Path("/proc/self/clear_refs").write_text("5")


def write_report(record):
    """Writes this task's `record` into `--report`, one file per task, whole
    or not at all (a serving worker rewrites it until it is stopped)."""
    path = pathlib.Path(FLAGS.report, f"{_file_name()}.json")
    written = path.with_suffix(".partial")
    written.write_text(json.dumps(record))
    os.replace(written, path)


def _weights_file():
    """This task's whole-tensor weights file (one per task: Keras's
    `save_weights` writes on every task)."""
    return str(pathlib.Path(FLAGS.checkpoint_dir, f"{_file_name()}.weights.h5"))


def _file_name():
    """This task's name without its colon: `worker0`."""
    return _task_name().replace(":", "")


def _task_name():
    config = os.environ.get("TF_CONFIG")
    if not config:
        return "single:0"
    task = json.loads(config)["task"]
    return f"{task['type']}:{task['index']}"


def run_mode(mode, task_flags=(), must_succeed=True, released_single=False,
             launch_flags=None):
    """The records of every process of one mode (none if it failed and need
    not succeed), launched with `launch_flags` (default: the mode's). A
    launched mode's tasks release memory with `--release_memory`; the one
    process only if `released_single`."""
    with tempfile.TemporaryDirectory() as report:
        script = [sys.executable, __file__, f"--mode={mode}", f"--report={report}",
                  f"--model={FLAGS.model}", f"--width={FLAGS.width}",
                  f"--layers={FLAGS.layers}", f"--vocabulary={FLAGS.vocabulary}",
                  f"--sequence_length={FLAGS.sequence_length}", f"--image_size={FLAGS.image_size}",
                  f"--epochs={FLAGS.epochs}", f"--examples={FLAGS.examples}",
                  f"--devices_per_worker={FLAGS.devices_per_worker}", *task_flags]
        env = {**os.environ, **task_env()}
        if mode not in ("single", ONE_HOST):
            released = ["--release_memory"] if FLAGS.release_memory else []
            script = [sys.executable, "-m", "tfdist.cli", "launch", f"--workers={FLAGS.workers}",
                      *(MODES[mode] if launch_flags is None else launch_flags),
                      *released, "--timeout=3600", "--", *script]
        elif released_single or (mode == ONE_HOST and FLAGS.release_memory):
            env.update(release_memory_env(env))
        done = subprocess.run(script, capture_output=True, text=True, cwd=ROOT, env=env)
        if done.returncode and must_succeed:
            sys.exit(f"{mode} failed ({done.returncode}):\n{done.stdout[-3000:]}"
                     f"{done.stderr[-3000:]}")
        if done.returncode:
            return []
        records = [json.loads(p.read_text()) for p in sorted(pathlib.Path(report).glob("*.json"))]
        tasks = 1 if mode in ("single", ONE_HOST) else FLAGS.workers + (mode in CHIEF_MODES)
        if len(records) != tasks:
            sys.exit(f"{mode}: {tasks} tasks ran but {len(records)} reported "
                     f"({[r['task'] for r in records]}):\n{done.stdout[-3000:]}"
                     f"{done.stderr[-3000:]}")
        return records


def task_env():
    """`--task_env` as a dict."""
    return dict(item.split("=", 1) for item in FLAGS.task_env)


def run_capped(mode, cap, weights):
    """Runs `mode` with each process capped at `cap` bytes; returns its
    records (none if a process died) and how many processes the kernel's
    out-of-memory killer stopped."""
    records = run_mode(mode, [f"--cap_bytes={cap}"] + ([f"--weights={weights}"] if weights
                                                         else []), must_succeed=False)
    killed, charged = 0, 0
    for root in (pathlib.Path("/sys/fs/cgroup/memory"), pathlib.Path("/sys/fs/cgroup")):
        v1 = root.name == "memory"
        for group in root.glob(f"{CGROUP_PREFIX}*"):
            events = group / ("memory.oom_control" if v1 else "memory.events")
            for line in events.read_text().splitlines():
                if line.startswith("oom_kill "):
                    killed += int(line.split()[1]) > 0
            peak = group / ("memory.max_usage_in_bytes" if v1 else "memory.peak")
            charged = max(charged, int(peak.read_text()))
            _remove(group)
    return records, killed, charged


def _remove(group, timeout_seconds=10):
    """Removes an empty cgroup. A process that just exited may still be
    leaving it: retried until `timeout_seconds`, then an error naming the
    processes still in it."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            return group.rmdir()
        except OSError as error:
            if error.errno != errno.EBUSY:
                raise
            if time.monotonic() > deadline:
                left = (group / "cgroup.procs").read_text().split()
                raise RuntimeError(
                    f"waited {timeout_seconds} s for the processes of {group} to leave it "
                    f"(still there: {left or 'none listed'}); remove it by hand") from error
            time.sleep(0.1)


def demonstrate_cap():
    """Every mode of `--modes` with each worker capped at `--cap`, against
    one uncapped and one capped process: the capped process must die, each
    mode must train to the uncapped run's losses and weights."""
    try:
        test = pathlib.Path("/sys/fs/cgroup/memory", f"{CGROUP_PREFIX}probe")
        if not test.parent.is_dir():
            test = pathlib.Path("/sys/fs/cgroup", f"{CGROUP_PREFIX}probe")
        test.mkdir()
        test.rmdir()
    except OSError as error:
        sys.exit(f"--cap needs the right to make a memory cgroup ({error}): run as root, "
                 f"or in a cgroup subtree delegated to this user.")
    with tempfile.TemporaryDirectory() as folder:
        reference = pathlib.Path(folder, "reference")
        reference.mkdir()
        # Uncapped (a limit far above it), to read what the kernel charges it:
        # its own memory, not the shared libraries already in the page cache;
        # without saving weights (their page cache is charged, but reclaimable).
        _, _, needed = run_capped("single", 2**40, None)
        (expected,), _, _ = run_capped("single", 2**40, reference)
        cap = int(FLAGS.cap * needed)
        print(f"\n{model_name()}, Adam; one process training the "
              f"whole model is charged {needed / 2**30:.2f} GiB at its peak; each process "
              f"capped at {cap / 2**30:.2f} GiB ({FLAGS.cap} x)")
        print("| mode | largest charged peak (GiB) | processes killed for memory | trained "
              "| losses match | largest weight difference (relative) |")
        print("|---|---|---|---|---|---|")
        for mode in ["single"] + [m for m in FLAGS.modes if m != "single"]:
            weights = pathlib.Path(folder, mode)
            weights.mkdir()
            records, killed, charged = run_capped(mode, cap, weights)
            row = {"bench": "memory_cap", "mode": mode, "cap_bytes": cap, "killed": killed,
                   "trained": bool(records), "charged_peak_bytes": charged}
            if records:
                row["losses_match"] = bool(np.allclose(records[0]["losses"], expected["losses"],
                                                       rtol=1e-4))
                row["weight_difference"] = max(
                    float(np.max(np.abs(np.load(f) - np.load(reference / f.name)))
                          / max(float(np.max(np.abs(np.load(reference / f.name)))), 1e-12))
                    for f in weights.glob("*.npy"))
                row["peaks_bytes"] = [r["peak_bytes"] for r in records]
            emit(row, FLAGS.out)
            print(f"| {mode} | {charged / 2**30:.2f} | {killed} | {row['trained']} | "
                  f"{row.get('losses_match', '-')} | {row.get('weight_difference', '-')} |")


def main(argv):
    del argv
    if FLAGS.mode:
        return run_task()
    if FLAGS.cap:
        return demonstrate_cap()
    if FLAGS.plan:
        return run_plans()
    unknown = [m for m in FLAGS.modes if m != "single" and m not in MODES]
    if unknown:
        sys.exit(f"--modes: unknown {unknown}; choose from single, {', '.join(MODES)}")
    worst, predicted, tensors, checkpoints = {}, {}, {}, {}
    runs = [(mode, False) for mode in FLAGS.modes]
    if FLAGS.release_memory and "single" in FLAGS.modes:
        runs.insert(FLAGS.modes.index("single") + 1, ("single", True))
    for mode, released_single in runs:
        name = RELEASED_SINGLE if released_single else mode
        with tempfile.TemporaryDirectory() as directory:
            saving = [f"--checkpoint_dir={directory}"] if FLAGS.checkpoint else []
            records = run_mode(mode, saving, released_single=released_single)
            reads = [r for kind in ("sharded", "h5") if FLAGS.checkpoint
                     for r in run_mode(mode, [*saving, f"--restore={kind}"],
                                       released_single=released_single)]
        for record in records:
            for read in (r for r in reads if r["task"] == record["task"]):
                record.update((k, v) for k, v in read.items() if "_read_peak_" in k)
            emit({"bench": "memory", "width": FLAGS.width, "layers": FLAGS.layers,
                  "workers": 1 if mode == "single" else FLAGS.workers,
                  "task_env": task_env(), "release_memory": released_single or (
                      FLAGS.release_memory and mode != "single"), **record}, FLAGS.out)
            worst[name] = max(worst.get(name, 0), record["peak_above_baseline_bytes"])
            predicted[name] = max(predicted.get(name, 0), record.get("predicted_peak_bytes", 0))
            tensors[name] = max(tensors.get(name, 0), record.get("tensor_peak_bytes") or 0)
            if FLAGS.checkpoint:
                checkpoints[name] = [max(checkpoints.get(name, [0] * 4)[i],
                                         record[f"{key}_peak_above_baseline_bytes"])
                                     for i, key in enumerate(CHECKPOINT_PEAKS)]
    print_table(worst, predicted, tensors)
    if checkpoints:
        print_checkpoints(worst, checkpoints)


def run_plans():
    """`--plan`: every plan that fits, and `--over` that do not, trained;
    each one's worst worker against its predicted peak and the limit."""
    import tfdist
    from tfdist.planning import describe_config

    per_worker = FLAGS.devices_per_worker
    fields = {key: json.loads(value) for key, value in
              (item.split("=", 1) for item in FLAGS.plan_fields)}
    # Times are not what this bench measures: a nominal rate instead of the
    # planner's calibration, but for several devices per worker, logical
    # devices of this host sharing its memory, which the calibrated hardware
    # says (`shared_cores`): their predicted peak is then the mean of the
    # process's over its devices.
    nominal = {} if per_worker > 1 else {"device_flops": 1e12}
    plans = tfdist.plan(build_model, devices=FLAGS.workers * per_worker,
                        memory_per_device=FLAGS.plan, batch_size=BATCH,
                        sequence_length=sequence_length(), hosts=FLAGS.workers,
                        **nominal, **fields)
    limit = plans.memory_per_device
    if per_worker > 1 and FLAGS.workers > 1:  # a CPU worker is one replica, its stages its devices
        runnable = [p for p in plans if p.config.pipeline == per_worker]
        print(f"Not run: {len(plans) - len(runnable)} plans with pipeline != {per_worker} "
              "(they place several replicas on a worker, where a CPU worker has one).")
        plans = runnable
    chosen = [p for p in plans if p.fits] + [p for p in plans if not p.fits][:FLAGS.over]
    print(f"\n{model_name()}, Adam, batch {BATCH}, {FLAGS.workers} "
          f"hosts of {per_worker} device(s), {FLAGS.plan} per device: "
          f"{sum(p.fits for p in plans)} of {len(plans)} plans fit; running {len(chosen)}")
    if per_worker > 1:  # one allocator per process
        print(f"A worker's peak is compared with {per_worker} x the predicted peak: the mean "
              "over its devices, which share its memory (balanced stages assumed).")
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for plan in chosen:
            path = pathlib.Path(directory, "plan.json")
            path.write_text(plan.config.to_json())
            records = (run_mode(ONE_HOST, [f"--config={path}"]) if FLAGS.workers == 1
                       else run_mode("plan", launch_flags=[f"--config={path}"]))
            worst = max(r["peak_above_baseline_bytes"] for r in records)
            tensors = [r["tensor_peak_bytes"] for r in records]
            tensors = None if None in tensors else max(tensors)
            rows.append((plan, worst / per_worker, tensors and tensors / per_worker))
            emit({"bench": "memory_plan", "model": model_name(), "width": FLAGS.width,
                  "layers": FLAGS.layers,
                  "workers": FLAGS.workers, "devices_per_worker": per_worker,
                  "limit_bytes": int(limit),
                  "config": describe_config(plan.config), "fits": plan.fits,
                  "planned_peak_bytes": plan.peak.total, "worst_worker_bytes": worst,
                  "workers_peaks_bytes": [r["peak_above_baseline_bytes"] for r in records],
                  "worst_worker_tensors_bytes": tensors,
                  "job_predicted_bytes": max(r["predicted_peak_bytes"] for r in records),
                  "task_env": task_env(), "release_memory": FLAGS.release_memory}, FLAGS.out)
    # Beside the process's peak, TensorFlow's own count of its tensors at
    # their peak: what a GPU's memory would hold (without the runtime's).
    print(f"| plan | fits in {limit / 2**30:.2f} GiB | predicted (GiB) | worst worker "
          f"/ {per_worker} (GiB) | measured / predicted | within the limit "
          "| tensors at their peak (GiB) | tensors / predicted |")
    print("|---|---|---|---|---|---|---|---|")
    for plan, worst, tensors in rows:
        print(f"| {describe_config(plan.config)} | {'yes' if plan.fits else 'no'} | "
              f"{plan.peak.total / 2**30:.2f} | {worst / 2**30:.2f} | "
              f"{worst / plan.peak.total:.2f} | {'yes' if worst <= limit else 'no'} | "
              + ("- | - |" if tensors is None else
                 f"{tensors / 2**30:.2f} | {tensors / plan.peak.total:.2f} |"))


def print_table(worst, predicted, tensors):
    """Each run's worst worker against the one process (and against the one
    process with the same allocator settings, with `--release_memory`)."""
    single, released = worst.get("single"), worst.get(RELEASED_SINGLE)
    settings = "tfdist launch --release_memory" if FLAGS.release_memory else "as they are"
    print(f"\n{model_name()}, Adam, {FLAGS.workers} workers, "
          f"environment {task_env() or 'unchanged'}, allocators {settings}")
    print("| mode | worst worker's peak above baseline (GiB) | x single process "
          "| x single, memory released | predicted (GiB) | measured / predicted "
          "| TensorFlow's tensors at their peak (GiB) | tensors / predicted |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, peak in worst.items():
        ratios = " | ".join(f"{peak / base:.2f}" if base else "-" for base in (single, released))
        guess = predicted[mode]
        versus = f"{guess / 2**30:.2f} | {peak / guess:.2f}" if guess else "- | -"
        held = tensors[mode]
        counted = (f"{held / 2**30:.2f} | " + (f"{held / guess:.2f}" if guess else "-")
                   if held else "- | -")
        print(f"| {mode} | {peak / 2**30:.2f} | {ratios} | {versus} | {counted} |")


def print_checkpoints(worst, checkpoints):
    """The `--checkpoint` table: each save's and read's worst worker against
    its training peak."""
    print("\nCheckpoints, worst worker's peak above baseline (GiB): training; after it, "
          "a sharded save and a whole-tensor save_weights; a new job's build with the "
          "sharded restore, and with load_weights")
    print("| mode | training | sharded save | save_weights | build + sharded restore "
          "| build + load_weights |")
    print("|---|---|---|---|---|---|")
    for mode, peaks in checkpoints.items():
        print(f"| {mode} | {worst[mode] / 2**30:.2f} | "
              + " | ".join(f"{p / 2**30:.2f}" for p in peaks) + " |")


if __name__ == "__main__":
    app.run(main)
