"""Benchmark: parameter-server scaling with workers, and async vs synchronous.

    python tools/bench_ps.py [--workers=1,2,4,8] [--delay_ms=200] [--out=results.jsonl]

Every worker's batch takes a fixed `--delay_ms` to produce (a sleep in its
input pipeline, not CPU work), so what is measured is how well steps overlap
across workers, not this 2-core machine's arithmetic. For each worker count w,
one `tfdist launch` job trains the digits MLP with
`tfdist.ParameterServerStrategy` (w workers, 1 ps) and one with
`tfdist.MultiWorkerStrategy` (w workers), side by side. Reported: batches/s
in the second epoch (the first traces and warms up); scaling = batches/s(w) /
(w x batches/s(1)) (goal >= 0.9); and async / sync batches/s.
Writes one JSON line per result, then a table.
"""

import json
import os
import pathlib
import subprocess
import sys
import time

from absl import app, flags

from results import emit

flags.DEFINE_list("workers", ["1", "2", "4", "8"], "Worker counts to measure.")
flags.DEFINE_integer("delay_ms", 200, "Time each worker takes to produce a batch.")
flags.DEFINE_float("seconds", 4.0, "Target length of the measured epoch at ideal speed.")
flags.DEFINE_enum("role", "bench", ["bench", "ps", "sync"], "bench: run everything; "
                  "ps / sync: one task of a launched job (internal).")
flags.DEFINE_integer("steps_per_epoch", 0, "ps / sync: steps per epoch (internal).")
flags.DEFINE_string("out", None, "Also append the JSON lines to this file.")
FLAGS = flags.FLAGS
ROOT = pathlib.Path(__file__).resolve().parents[1]
BATCH = 64


def task():
    """One task of a launched job: trains two epochs, the chief (or worker 0) reports."""
    sys.path.insert(0, str(ROOT / "keras_examples"))
    import digits  # first: it quiets TensorFlow's C++ logs before TensorFlow loads
    # isort: split
    import keras
    import tensorflow as tf
    from tensorflow.python.data.experimental.ops import testing

    import tfdist

    digits.quiet_logs()
    if FLAGS.role == "ps":
        strategy = tfdist.ParameterServerStrategy()  # workers and ps serve here
    else:
        strategy = tfdist.MultiWorkerStrategy(timeout_seconds=300)
    x, y = digits.load()

    def batches(context=None):  # what each worker reads: BATCH rows, after the delay
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH, drop_remainder=True)
        return data.repeat().apply(testing.sleep(FLAGS.delay_ms * 1000))

    # Synchronous: every worker's own pipeline gives its replica BATCH rows per step.
    data = batches() if FLAGS.role == "ps" else strategy.distribute_datasets_from_function(
        batches)
    with strategy.scope():
        model = digits.build_model(hidden=64)

    class EpochTimes(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds = time.perf_counter() - self.start

    timer = EpochTimes()
    model.fit(data, epochs=2, steps_per_epoch=FLAGS.steps_per_epoch, verbose=0,
              callbacks=[timer])
    workers = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]
    steps_per_s = FLAGS.steps_per_epoch / timer.seconds
    # A synchronous step consumes one batch on every worker.
    batches = steps_per_s * (len(workers) if FLAGS.role == "sync" else 1)
    if FLAGS.role == "ps" or json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
        print("RESULT " + json.dumps({"batches_per_s": batches}), flush=True)


def measure(mode, workers):
    ideal = workers * 1000 / FLAGS.delay_ms  # batches/s
    steps = max(10, int(ideal * FLAGS.seconds / (workers if mode == "sync" else 1)))
    roles = ["--chief", f"--workers={workers}", "--ps=1"] if mode == "ps" else [
        f"--workers={workers}"]
    done = subprocess.run(
        [sys.executable, "-m", "tfdist.cli", "launch", *roles, "--timeout=600", "--",
         sys.executable, __file__, f"--role={mode}", f"--delay_ms={FLAGS.delay_ms}",
         f"--steps_per_epoch={steps}"],
        capture_output=True, text=True, timeout=700)
    lines = [l for l in done.stdout.splitlines() if "RESULT " in l]
    if done.returncode or not lines:
        sys.exit(f"{mode} with {workers} workers failed:\n{done.stdout[-3000:]}")
    return json.loads(lines[0].split("RESULT ", 1)[1])["batches_per_s"]


def main(argv):
    del argv
    if FLAGS.role != "bench":
        return task()
    counts = [int(w) for w in FLAGS.workers]
    rows, one_worker = [], None
    for w in counts:
        ps, sync = measure("ps", w), measure("sync", w)
        one_worker = one_worker if one_worker is not None else ps / w
        record = {"bench": "ps", "workers": w, "delay_ms": FLAGS.delay_ms,
                  "ps_batches_per_s": round(ps, 2), "sync_batches_per_s": round(sync, 2),
                  "ideal_batches_per_s": round(w * 1000 / FLAGS.delay_ms, 2),
                  "scaling": round(ps / (w * one_worker), 3),
                  "async_over_sync": round(ps / sync, 3)}
        emit(record, FLAGS.out)
        rows.append(record)
    print("\n| workers | PS batches/s | scaling vs w x 1 worker | sync batches/s | async / sync |"
          "\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workers']} | {r['ps_batches_per_s']:.2f} | {r['scaling']:.3f} | "
              f"{r['sync_batches_per_s']:.2f} | {r['async_over_sync']:.3f} |")


if __name__ == "__main__":
    app.run(main)
