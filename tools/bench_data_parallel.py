"""Benchmark: tfdist.Strategy(data=4) against tf.distribute.MirroredStrategy.

    python tools/bench_data_parallel.py [--rounds=10] [--out=results.jsonl]

1. Epoch time of the same model, data and 4 logical CPU devices under
   `tfdist.Strategy(data=4)` and under `tf.distribute.MirroredStrategy`, timed in
   alternation in one process (this machine is shared and noisy: only ratios
   measured side by side mean anything). Reports the median ratio tfdist/plain.
2. `microbatches` k in {1, 2, 4, 8}: examples/s and peak RSS, each k in a fresh
   process (peak RSS is per process), on a larger batch and model whose
   activations outweigh TensorFlow's own memory.

Writes one JSON line per result (stdout, and `--out` if given), then a table.
"""

import json
import os
import resource
import statistics
import subprocess
import sys
import time

from absl import app, flags

from results import emit

flags.DEFINE_integer("rounds", 40, "Alternating timed epochs per strategy.")
flags.DEFINE_integer("examples", 16384, "Examples per epoch.")
flags.DEFINE_integer("batch_size", 512, "Global batch size.")
flags.DEFINE_integer("hidden", 512, "Hidden width of the MLP.")
flags.DEFINE_list("microbatches", ["1", "2", "4", "8"], "Values of k to measure.")
flags.DEFINE_integer("memory_batch_size", 65536,
                     "Global batch size of the microbatch runs (activations dominate).")
flags.DEFINE_integer("memory_hidden", 512, "Hidden width of the microbatch runs.")
flags.DEFINE_integer("timed_epochs", 5, "Timed epochs per microbatch run.")
flags.DEFINE_integer("k", None, "Internal: measure one k in this process.")
flags.DEFINE_string("out", None, "Also append the JSON lines to this file.")
FLAGS = flags.FLAGS
DEVICES = 4


def timed_epoch(model, x, y, batch_size):
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return time.perf_counter() - start


def build(strategy, hidden):
    import digits

    with strategy.scope():
        return digits.build_model(hidden=hidden)


def compare_with_mirrored():
    import tensorflow as tf

    import digits
    import tfdist

    x, y = digits.load(FLAGS.examples)
    names = [f"/cpu:{i}" for i in range(DEVICES)]
    models = {"tfdist": build(tfdist.Strategy(data=DEVICES, devices=names), FLAGS.hidden),
              "mirrored": build(tf.distribute.MirroredStrategy(names), FLAGS.hidden)}
    for model in models.values():  # trace and warm up
        timed_epoch(model, x, y, FLAGS.batch_size)
    times = {name: [] for name in models}
    for r in range(FLAGS.rounds):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            times[name].append(timed_epoch(models[name], x, y, FLAGS.batch_size))
    ratios = [a / b for a, b in zip(times["tfdist"], times["mirrored"])]
    emit({"bench": "data_parallel", "what": "epoch_time_ratio", "devices": DEVICES,
          "tfdist_median_s": statistics.median(times["tfdist"]),
          "mirrored_median_s": statistics.median(times["mirrored"]),
          "median_ratio": statistics.median(ratios), "rounds": FLAGS.rounds,
          "examples": FLAGS.examples, "batch_size": FLAGS.batch_size,
          "hidden": FLAGS.hidden}, FLAGS.out)


def measure_microbatches(k):
    import digits
    import tfdist

    batch = FLAGS.memory_batch_size
    x, y = digits.load(2 * batch)  # two steps per epoch
    model = build(tfdist.Strategy(data=DEVICES, microbatches=k), FLAGS.memory_hidden)
    timed_epoch(model, x, y, batch)
    seconds = statistics.median(
        timed_epoch(model, x, y, batch) for _ in range(FLAGS.timed_epochs))
    emit({"bench": "data_parallel", "what": "microbatches", "microbatches": k,
          "examples_per_s": len(x) / seconds,
          "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
          "batch_size": batch, "hidden": FLAGS.memory_hidden}, FLAGS.out)


def main(argv):
    del argv
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "keras_examples"))
    import digits  # first: it quiets TensorFlow's C++ logs before TensorFlow loads
    # isort: split
    import tfdist

    digits.quiet_logs()

    tfdist.use_virtual_devices(DEVICES)
    if FLAGS.k is not None:
        measure_microbatches(FLAGS.k)
        return
    if FLAGS.rounds:
        compare_with_mirrored()
    records = []
    for k in FLAGS.microbatches:
        args = [sys.executable, __file__, f"--k={k}", f"--examples={FLAGS.examples}",
                f"--memory_batch_size={FLAGS.memory_batch_size}",
                f"--memory_hidden={FLAGS.memory_hidden}",
                f"--timed_epochs={FLAGS.timed_epochs}"]
        done = subprocess.run(args, capture_output=True, text=True, timeout=900, check=True)
        record = json.loads(done.stdout.strip().splitlines()[-1])
        records.append(record)
        if FLAGS.out:
            with open(FLAGS.out, "a") as f:
                f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)
    print("\n| microbatches | examples/s | peak RSS (MiB) |\n|---|---|---|")
    for r in records:
        print(f"| {r['microbatches']} | {r['examples_per_s']:,.0f} | {r['peak_rss_mib']:,.0f} |")


if __name__ == "__main__":
    app.run(main)
