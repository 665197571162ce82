"""Benchmark: time from `model.fit` to the end of the first training step, every
tfdist mode against plain `tf.distribute.MirroredStrategy`.

    python tools/bench_first_step.py [--models=gpt2,llama] [--cases=mirrored,data4,...]
        [--repeats=3] [--out=results.jsonl]
    python tools/bench_first_step.py --models=llama --cases=data4 --repeats=1 \\
        --profile=/tmp/prof   # also writes and prints a cProfile of the measured span
    python tools/bench_first_step.py --nograppler --steps=50   # Grappler off; and the
        # median of the 50 steps after the first

The first step of `fit` is where a step's Python is traced into a graph and
TensorFlow optimises and instantiates it: it is what a user waits for before
training starts, and what most of the test suite's time goes to. Each
measurement runs in a fresh process (the tool runs itself with `--case`) on 4
logical CPU devices: it builds the model in the strategy's scope, then takes
process CPU seconds (every thread: tracing, Grappler, the step itself) and wall
seconds from just before `model.fit(...)` to the end of the first train batch
(a callback's `on_train_batch_end`, after which `fit` stops).

Models: keras-hub `GPT2Backbone` and `LlamaBackbone` with the tiny
configurations of tests/parity/test_tensor_blocks.py (2 blocks, width 16, 4
heads (Llama: 2 key/value heads), MLP 32, vocabulary 24) and a Dense token
classifier, Adam; sequence length `--seq` (16), global batch 8.

Cases (`--cases`): `mirrored` (`tf.distribute.MirroredStrategy` over the 4
devices, Keras's own step), and `tfdist.Strategy` with `data4` (data=4),
`data2_zero1`, `data4_zero3`, `data2_tensor2`, `data2_tensor2_mb2` (with
microbatches=2), `tensor4`, `pipeline2_mb2`
(data=2, pipeline=2, microbatches=2), `pipeline4_mb4` (one replica, pipeline=4,
microbatches=4), `data2_mb2` (data=2, microbatches=2), `data2_tensor2_zero3`
(data=2, tensor=2, zero=3) and `pipeline2_tensor2_mb2` (pipeline=2, tensor=2,
microbatches=2),
each on the first data x pipeline x tensor devices. A case tfdist refuses for
a model is recorded with tfdist's message and left empty in the table.

`--nograppler` turns off Grappler (TensorFlow's graph optimiser, which rewrites
a function's graph at its first call) in the case processes, as
`tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})`
does in a user's; `--steps=N` also times the N steps after the first (each to
its loss, as a progress bar does) and reports their median: what Grappler
gives back for its first-call time.

`--instantiations=K` splits the first step into its trace and TensorFlow's
instantiation of the traced step: after it, the case process runs K more
one-step `fit`s of the same model under a call configuration of their own
each (TensorFlow keys an instantiation by its call's configuration, so the
step is optimised and instantiated again from the same trace), alternately
with Grappler and without, and one under the process's configuration, which
reuses the first instantiation; the medians of their CPU seconds less that
one's are `instantiate_cpu_seconds` (with Grappler) and
`instantiate_nograppler_cpu_seconds`, and `trace_cpu_seconds` is the first
step's CPU seconds less `instantiate_cpu_seconds`. A function the step
calls without inlining it (the one body of `microbatches` without pipeline
stages) keeps its first instantiation: its cases' split counts it as trace.

One JSON line per (model, case): medians over `--repeats` processes, and the
ratios to `data4` on the same model (`data4`'s line also to `mirrored`); then
a markdown table. `--profile=DIR` writes cProfiles of the measured span only
(their overhead inflates the times): `DIR/<model>_<case>.prof` of the main
thread (wall time) and `.threads.prof` of the threads started in the span,
summed, in each thread's CPU time (MirroredStrategy traces each replica's
step in a thread of its own, which waits for the others at every
`merge_call`, while the main thread waits for them), and prints their top
tfdist / Keras / TensorFlow
functions by cumulative time.
"""

import json
import os
import pathlib
import pstats
import statistics
import subprocess
import sys
import threading
import time

from absl import app, flags

from results import emit

# A case's tfdist.Strategy fields (None: plain MirroredStrategy).
CASES = {
    "mirrored": None,
    "data4": dict(data=4),
    "data2_zero1": dict(data=2, zero=1),
    "data4_zero3": dict(data=4, zero=3),
    "data2_tensor2": dict(data=2, tensor=2),
    "data2_tensor2_mb2": dict(data=2, tensor=2, microbatches=2),
    "tensor4": dict(tensor=4),
    "pipeline2_mb2": dict(data=2, pipeline=2, microbatches=2),
    "pipeline4_mb4": dict(pipeline=4, microbatches=4),
    "data2_mb2": dict(data=2, microbatches=2),
    "data2_tensor2_zero3": dict(data=2, tensor=2, zero=3),
    "pipeline2_tensor2_mb2": dict(pipeline=2, tensor=2, microbatches=2),
}
MODELS = ("gpt2", "llama")
flags.DEFINE_list("models", list(MODELS), f"Models to measure: {', '.join(MODELS)}.")
flags.DEFINE_list("cases", list(CASES), f"Cases to measure: {', '.join(CASES)}.")
flags.DEFINE_integer("repeats", 3, "Fresh processes per (model, case); the median is reported.")
flags.DEFINE_integer("seq", 16, "Sequence length.")
flags.DEFINE_float("timeout_seconds", 900, "Time limit of one case's process.")
flags.DEFINE_string("profile", None, "Directory for a cProfile of each case's measured span.")
flags.DEFINE_string("case", None, "Internal: measure this case in this process.")
flags.DEFINE_string("model", None, "Internal: the model of --case.")
flags.DEFINE_string("out", None, "Also append the JSON lines to this file.")
flags.DEFINE_bool("grappler", True, "Run Grappler, TensorFlow's graph optimiser (its default); "
                  "--nograppler turns its meta-optimizer off in the case processes.")
flags.DEFINE_integer("steps", 0, "Also time this many steps after the first, and report "
                     "their median (`steady_step_ms`).")
flags.DEFINE_integer("instantiations", 0, "Also instantiate the traced step this many times "
                     "more with Grappler and as many without, and split the first step "
                     "into trace and instantiation (`trace_cpu_seconds`, "
                     "`instantiate_cpu_seconds`, `instantiate_nograppler_cpu_seconds`).")
FLAGS = flags.FLAGS
ROOT = pathlib.Path(__file__).resolve().parents[1]
DEVICES = 4
BATCH = 8
# tests/parity/test_tensor_blocks.py's tiny keras-hub configurations.
WIDTH, HEADS, FF, VOCAB, BLOCKS = 16, 4, 32, 24, 2
RESULT = "FIRST_STEP_RESULT "  # prefix of the line a case process reports on


def describe(case):
    fields = CASES[case]
    if fields is None:
        return "MirroredStrategy"
    return ", ".join(f"{k}={v}" for k, v in fields.items())


def make_model(name):
    """A keras-hub backbone with a Dense token classifier, compiled with Adam."""
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    if name == "gpt2":
        body = keras_hub.models.GPT2Backbone(
            vocabulary_size=VOCAB, num_layers=BLOCKS, num_heads=HEADS, hidden_dim=WIDTH,
            intermediate_dim=FF, max_sequence_length=FLAGS.seq, dropout=0.0)
    else:
        body = keras_hub.models.LlamaBackbone(
            vocabulary_size=VOCAB, num_layers=BLOCKS, num_query_heads=HEADS,
            num_key_value_heads=HEADS // 2, hidden_dim=WIDTH, intermediate_dim=FF,
            dropout=0.0)
    model = keras.Model(body.input, keras.layers.Dense(VOCAB)(body.output))
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def lm_data(n):
    """Next-token data: `n` sequences of `--seq` tokens."""
    import numpy as np

    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(n, FLAGS.seq + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((n, FLAGS.seq), "int32")}
    return x, tokens[:, 1:]


def run_case():
    """Measures one (model, case) in this fresh process; prints its result line."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tfdist.devices import use_virtual_devices

    use_virtual_devices(DEVICES)  # before TensorFlow initialises
    import keras
    import tensorflow as tf

    if not FLAGS.grappler:
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})

    record = {}
    try:
        record = measure(keras, tf)
    except (ValueError, NotImplementedError, TypeError) as error:
        record = {"refused": f"{type(error).__name__}: {error}"}
    print(RESULT + json.dumps(record), flush=True)


def measure(keras, tf):
    import cProfile

    names = [d.name for d in tf.config.list_logical_devices("CPU")]
    fields = CASES[FLAGS.case]
    started = time.perf_counter()
    if fields is None:
        strategy = tf.distribute.MirroredStrategy(names)
    else:
        import tfdist

        used = fields.get("data", 1) * fields.get("pipeline", 1) * fields.get("tensor", 1)
        strategy = tfdist.Strategy(devices=names[:used], **fields)
    with strategy.scope():
        model = make_model(FLAGS.model)
    build_seconds = time.perf_counter() - started
    x, y = lm_data((2 + FLAGS.steps) * BATCH)
    profiler = cProfile.Profile() if FLAGS.profile else None
    threads = []  # MirroredStrategy traces each replica's step in a thread of its own

    def profile_thread(*_):  # the first event of a new thread: profile the rest of it
        threads.append(cProfile.Profile(time.thread_time))  # not its waits for the others
        threads[-1].enable()

    first, ends = {}, []

    class FirstStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])  # the step's result is here
            ends.append(time.perf_counter())
            if len(ends) > FLAGS.steps:
                self.model.stop_training = True
            if first:
                return
            first["cpu"] = time.process_time() - cpu
            first["wall"] = time.perf_counter() - wall
            if profiler:
                profiler.disable()
                threading.setprofile(None)

    cpu, wall = time.process_time(), time.perf_counter()
    if profiler:
        threading.setprofile(profile_thread)
        profiler.enable()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[FirstStep()])
    fit_seconds = time.perf_counter() - wall
    if profiler:
        path = pathlib.Path(FLAGS.profile) / f"{FLAGS.model}_{FLAGS.case}"
        profiler.dump_stats(f"{path}.prof")
        if threads:
            pstats.Stats(*threads).dump_stats(f"{path}.threads.prof")
    record = {"cpu_seconds": first["cpu"], "wall_seconds": first["wall"],
              "fit_return_seconds": fit_seconds, "build_seconds": build_seconds}
    if FLAGS.steps:
        record["steady_step_ms"] = 1e3 * statistics.median(
            b - a for a, b in zip(ends, ends[1:]))
    if FLAGS.instantiations:
        record.update(instantiation_seconds(model, x, y, first["cpu"]))
    return record


def instantiation_seconds(model, x, y, first_cpu):
    """The first step's CPU seconds split into its trace and the traced step's
    instantiation (`--instantiations`): one-step `fit`s of the same model
    under call configurations of their own, with and without Grappler,
    against one under the process's own configuration."""
    import copy

    from tensorflow.python.eager import context

    def one_step_cpu(grappler=None, key=0):
        """CPU seconds of a one-step `fit`; with `grappler` set, under a fresh
        call configuration (`key` makes it unlike every other)."""
        options = context.context().function_call_options
        saved = copy.copy(options)
        if grappler is not None:
            config = copy.deepcopy(context.context().config)
            config.placement_period = 1000 + key  # unused by functions: a new instantiation
            config.graph_options.rewrite_options.disable_meta_optimizer = not grappler
            options.config_proto_serialized = config
        start = time.process_time()
        try:
            model.fit({k: v[:BATCH] for k, v in x.items()}, y[:BATCH], batch_size=BATCH,
                      epochs=1, shuffle=False, verbose=0)
        finally:
            context.context().function_call_options = saved
        return time.process_time() - start

    reused = one_step_cpu()
    timed = {True: [], False: []}
    for key in range(FLAGS.instantiations):
        for grappler in (True, False):
            timed[grappler].append(one_step_cpu(grappler, 2 * key + grappler))
    on, off = (statistics.median(timed[g]) - reused for g in (True, False))
    return {"instantiate_cpu_seconds": on, "instantiate_nograppler_cpu_seconds": off,
            "trace_cpu_seconds": first_cpu - on}


def run_subprocess(model, case):
    """One measurement in a fresh process: its record, or what went wrong."""
    command = [sys.executable, __file__, f"--case={case}", f"--model={model}",
               f"--seq={FLAGS.seq}", f"--steps={FLAGS.steps}",
               f"--instantiations={FLAGS.instantiations}",
               "--grappler" if FLAGS.grappler else "--nograppler"]
    if FLAGS.profile:
        command.append(f"--profile={FLAGS.profile}")
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                              timeout=FLAGS.timeout_seconds)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {FLAGS.timeout_seconds:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode or not lines:
        return {"error": f"exit {done.returncode}: {done.stderr[-2000:]}"}
    return json.loads(lines[-1][len(RESULT):])


def ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def print_profile(model, case, top=30):
    for suffix, what in (("prof", "main thread"), ("threads.prof", "other threads, summed")):
        path = pathlib.Path(FLAGS.profile) / f"{model}_{case}.{suffix}"
        if path.exists():
            print(f"\n### {model}, {describe(case)}, {what}: top functions by cumulative "
                  f"time ({path})")
            stats = pstats.Stats(str(path), stream=sys.stdout)
            stats.sort_stats("cumulative").print_stats(r"tfdist|keras|tensorflow", top)


def bench():
    unknown = sorted(set(FLAGS.cases) - set(CASES)) + sorted(set(FLAGS.models) - set(MODELS))
    if unknown:
        sys.exit(f"unknown --cases / --models {unknown}; cases: {', '.join(CASES)}; "
                 f"models: {', '.join(MODELS)}")
    if FLAGS.profile:
        os.makedirs(FLAGS.profile, exist_ok=True)
    runs = {(m, c): [] for m in FLAGS.models for c in FLAGS.cases}
    steady = bool(FLAGS.steps)  # the steps after the first are timed too
    split = ["trace_cpu_seconds", "instantiate_cpu_seconds",
             "instantiate_nograppler_cpu_seconds"] if FLAGS.instantiations else []
    medians = ["cpu_seconds", "wall_seconds", "fit_return_seconds", "build_seconds",
               *["steady_step_ms"] * steady, *split]
    for repeat in range(FLAGS.repeats):  # repeats outermost: load drifts spread over cases
        for model, case in runs:
            record = run_subprocess(model, case)
            print(f"# repeat {repeat}: {model} {case}: {record}", file=sys.stderr, flush=True)
            runs[model, case].append(record)
    results = {}
    for (model, case), records in runs.items():
        timed = [r for r in records if "cpu_seconds" in r]
        result = {"bench": "first_step", "model": model, "case": case,
                  "config": describe(case), "seq": FLAGS.seq, "batch_size": BATCH,
                  "devices": DEVICES, "grappler": FLAGS.grappler, "repeats": len(timed)}
        if timed:
            for key in medians:
                result[key] = round(statistics.median(r[key] for r in timed), 3)
            result["cpu_seconds_all"] = [round(r["cpu_seconds"], 3) for r in timed]
            result["wall_seconds_all"] = [round(r["wall_seconds"], 3) for r in timed]
        else:
            result["cpu_seconds"] = result["wall_seconds"] = None
            failed = records[-1]
            result.update({k: failed[k] for k in ("refused", "error") if k in failed})
        results[model, case] = result
    for (model, case), result in results.items():
        base = results.get((model, "data4"), {})
        for key in ("cpu", "wall"):
            result[f"{key}_ratio_to_data4"] = ratio(result[f"{key}_seconds"],
                                                    base.get(f"{key}_seconds"))
        if case == "data4":
            mirrored = results.get((model, "mirrored"), {})
            for key in ("cpu", "wall"):
                result[f"{key}_ratio_to_mirrored"] = ratio(result[f"{key}_seconds"],
                                                           mirrored.get(f"{key}_seconds"))
        emit(result, FLAGS.out)
    print(f"\nFirst step of fit (median of {FLAGS.repeats} fresh process(es)): CPU s / wall s / "
          f"CPU ratio to data=4{' / later steps ms' * steady}; {DEVICES} logical CPU devices, "
          f"batch {BATCH}, seq {FLAGS.seq}, Grappler {'on' if FLAGS.grappler else 'off'}")
    print("| case | " + " | ".join(f"{m} CPU s | {m} wall s | {m} x data=4"
                                    + f" | {m} step ms" * steady
                                    for m in FLAGS.models) + " |")
    print("|---|" + ("---|---|---|" + "---|" * steady) * len(FLAGS.models))
    for case in FLAGS.cases:
        cells = []
        for model in FLAGS.models:
            result = results[model, case]
            if result["cpu_seconds"] is None:
                cells += ["", "", "refused" if "refused" in result else "failed"] + [""] * steady
            else:
                cpu_ratio = result["cpu_ratio_to_data4"]
                cells += [f"{result['cpu_seconds']:.2f}", f"{result['wall_seconds']:.2f}",
                          f"{cpu_ratio:.2f}" if cpu_ratio is not None else "-"]
                if steady:
                    cells.append(f"{result['steady_step_ms']:.1f}")
        print(f"| {describe(case)} | " + " | ".join(cells) + " |")
    if split:
        print("\nThe first step's CPU s split (`--instantiations`): the trace, the traced "
              "step's instantiation with Grappler, and without it")
        print("| case | " + " | ".join(f"{m} trace | {m} instantiation | {m} without Grappler"
                                        for m in FLAGS.models) + " |")
        print("|---|" + "---|---|---|" * len(FLAGS.models))
        for case in FLAGS.cases:
            cells = [f"{results[model, case][key]:.2f}" if results[model, case].get(key)
                     is not None else "" for model in FLAGS.models for key in split]
            print(f"| {describe(case)} | " + " | ".join(cells) + " |")
    if FLAGS.profile:
        for model, case in runs:
            print_profile(model, case)


def main(argv):
    del argv
    run_case() if FLAGS.case else bench()


if __name__ == "__main__":
    app.run(main)
