"""Benchmark: peak memory per worker of a model-parallel `fit`, against one process.

    python tools/bench_memory.py [--width=4096] [--layers=8] [--workers=4]
        [--modes=single,zero0,zero1,zero2,zero3,tensor4,pipeline4,data2_tensor2_zero3]
        [--out=results.jsonl]

A model-parallel mode exists so that a model one worker cannot train alone
trains on several: each worker's *peak* (not only its steady state) must be a
fraction of one process's. Each mode trains the same MLP (`--layers` square
Dense layers of `--width` units, Adam, float32; 8 x 4096 is 0.5 GiB of
parameters) for `--epochs` epochs of `model.fit`:

- `single`: one process, no strategy, the whole model;
- every other mode: `tfdist launch --workers N`, each task a
  `MultiWorkerStrategy` with that `ParallelConfig` on one CPU device.

Each process measures its baseline (RSS once TensorFlow and the strategy
exist), resets its high-water mark (`/proc/self/clear_refs`), builds,
compiles and fits, then reads its peak (`VmHWM`) and the strategy's
prediction of it (`Strategy.predicted_peak`). One JSON line per process,
then a table of each mode's worst worker against `single` and the prediction.
"""

import contextlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from results import emit

flags.DEFINE_integer("width", 4096, "Units of each square Dense layer.")
flags.DEFINE_integer("layers", 8, "Dense layers.")
flags.DEFINE_integer("workers", 4, "Worker tasks of the launched modes.")
flags.DEFINE_integer("epochs", 2, "Epochs of fit.")
flags.DEFINE_integer("examples", 64, "Training examples (batch 16).")
flags.DEFINE_list("modes", ["single", "zero0", "zero1", "zero2", "zero3", "tensor4",
                            "pipeline4", "data2_tensor2_zero3"],
                  "What to run (see the module docstring).")
flags.DEFINE_string("mode", None, "Internal: the mode this task runs.")
flags.DEFINE_string("report", None, "Internal: where this task writes its measures.")
flags.DEFINE_string("out", None, "Also append the JSON lines to this file.")
FLAGS = flags.FLAGS
ROOT = pathlib.Path(__file__).resolve().parents[1]
BATCH = 16
# A mode's ParallelConfig fields, as `tfdist launch` flags.
MODES = {"zero0": [], "zero1": ["--zero=1"], "zero2": ["--zero=2"], "zero3": ["--zero=3"],
         "tensor4": ["--tensor=4"], "pipeline4": ["--pipeline=4", "--microbatches=4"],
         "data2_tensor2_zero3": ["--tensor=2", "--zero=3"]}


def status_bytes(field):
    """A `VmRSS` / `VmHWM` line of /proc/self/status, in bytes."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def run_task():
    """Trains once in this process (under the launched job's strategy, or
    none) and writes baseline and peak to `--report`."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np

    import tfdist

    strategy = None
    if FLAGS.mode != "single":
        strategy = tfdist.MultiWorkerStrategy(config=tfdist.ParallelConfig.from_env())
    rng = np.random.default_rng(0)
    x = rng.normal(size=(FLAGS.examples, FLAGS.width)).astype("float32")
    y = rng.normal(size=(FLAGS.examples, FLAGS.width)).astype("float32")
    baseline = status_bytes("VmRSS")
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = keras.Sequential([keras.Input((FLAGS.width,))] + [
            keras.layers.Dense(FLAGS.width, activation="relu") for _ in range(FLAGS.layers)])
        model.compile(optimizer="adam", loss="mse")
    started = time.monotonic()
    history = model.fit(x, y, batch_size=BATCH, epochs=FLAGS.epochs, verbose=0, shuffle=False)
    record = {"mode": FLAGS.mode, "task": _task_name(), "baseline_bytes": baseline,
              "peak_bytes": status_bytes("VmHWM"),
              "parameter_bytes": 4 * model.count_params(),
              "fit_seconds": round(time.monotonic() - started, 1),
              "final_loss": history.history["loss"][-1]}
    record["peak_above_baseline_bytes"] = record["peak_bytes"] - baseline
    if strategy is not None:
        estimate = strategy.predicted_peak(model, BATCH)
        record["predicted_peak_bytes"] = estimate.total
        record["predicted_parts"] = {k: v for k, v in vars(estimate).items()}
    pathlib.Path(FLAGS.report, f"{record['task'].replace(':', '')}.json").write_text(
        json.dumps(record))


def _task_name():
    config = os.environ.get("TF_CONFIG")
    if not config:
        return "single:0"
    task = json.loads(config)["task"]
    return f"{task['type']}:{task['index']}"


def run_mode(mode):
    """The records of every process of one mode."""
    with tempfile.TemporaryDirectory() as report:
        script = [sys.executable, __file__, f"--mode={mode}", f"--report={report}",
                  f"--width={FLAGS.width}", f"--layers={FLAGS.layers}",
                  f"--epochs={FLAGS.epochs}", f"--examples={FLAGS.examples}"]
        if mode != "single":
            script = [sys.executable, "-m", "tfdist.cli", "launch", f"--workers={FLAGS.workers}",
                      *MODES[mode], "--timeout=3600", "--", *script]
        done = subprocess.run(script, capture_output=True, text=True, cwd=ROOT)
        if done.returncode:
            sys.exit(f"{mode} failed ({done.returncode}):\n{done.stdout[-3000:]}"
                     f"{done.stderr[-3000:]}")
        return [json.loads(p.read_text()) for p in sorted(pathlib.Path(report).glob("*.json"))]


def main(argv):
    del argv
    if FLAGS.mode:
        return run_task()
    unknown = [m for m in FLAGS.modes if m != "single" and m not in MODES]
    if unknown:
        sys.exit(f"--modes: unknown {unknown}; choose from single, {', '.join(MODES)}")
    worst, predicted = {}, {}
    for mode in FLAGS.modes:
        for record in run_mode(mode):
            emit({"bench": "memory", "width": FLAGS.width, "layers": FLAGS.layers,
                  "workers": 1 if mode == "single" else FLAGS.workers, **record}, FLAGS.out)
            worst[mode] = max(worst.get(mode, 0), record["peak_above_baseline_bytes"])
            predicted[mode] = max(predicted.get(mode, 0), record.get("predicted_peak_bytes", 0))
    single = worst.get("single")
    print(f"\n{FLAGS.layers} x Dense({FLAGS.width}), Adam, {FLAGS.workers} workers")
    print("| mode | worst worker's peak above baseline (GiB) | x single process "
          "| predicted (GiB) | measured / predicted |")
    print("|---|---|---|---|---|")
    for mode, peak in worst.items():
        ratio = f"{peak / single:.2f}" if single else "-"
        guess = predicted[mode]
        versus = f"{guess / 2**30:.2f} | {peak / guess:.2f}" if guess else "- | -"
        print(f"| {mode} | {peak / 2**30:.2f} | {ratio} | {versus} |")


if __name__ == "__main__":
    app.run(main)
