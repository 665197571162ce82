"""Benchmark: sharded optimizer state (zero=1, zero=2) against zero=0.

    python tools/bench_zero.py [--rounds=30] [--out=results.jsonl]

For N in {2, 4, 8} logical CPU devices, three models of the same digits MLP
(Adam) are trained under `tfdist.Strategy(data=N, zero=z)` for z = 0, 1, 2:

- optimizer-state bytes per device (largest and smallest over the N devices,
  summed over every physical component of every optimizer variable);
- epoch time, the three models timed in alternation in one process, the order
  reversed every round (0, 1, 2 then 2, 1, 0: each of zero=1 and zero=2 runs
  as often just before zero=0 as just after). A shared machine is noisy: only
  ratios measured side by side mean anything. Reported: the median of the
  per-round ratios zero=z / zero=0 and their quartiles (the spread of the
  noise), and the load average before and after.

Writes one JSON line per result (stdout, and `--out` if given), then a table.
"""

import json
import os
import statistics
import sys
import time

from absl import app, flags

flags.DEFINE_integer("rounds", 30, "Alternating timed epochs per model.")
flags.DEFINE_integer("examples", 4096, "Examples per epoch.")
flags.DEFINE_integer("batch_size", 512, "Global batch size.")
flags.DEFINE_integer("hidden", 512, "Hidden width of the MLP.")
flags.DEFINE_list("devices", ["2", "4", "8"], "Values of N to measure.")
flags.DEFINE_string("out", None, "Also append the JSON lines to this file.")
FLAGS = flags.FLAGS
STAGES = (0, 1, 2)


def emit(record):
    line = json.dumps(record)
    print(line, flush=True)
    if FLAGS.out:
        with open(FLAGS.out, "a") as f:
            f.write(line + "\n")


def timed_epoch(model, x, y):
    start = time.perf_counter()
    model.fit(x, y, batch_size=FLAGS.batch_size, epochs=1, shuffle=False, verbose=0)
    return time.perf_counter() - start


def measure(n, x, y):
    import digits
    import tfdist
    from tfdist.callbacks.metrics import optimizer_state_bytes

    names = [f"/cpu:{i}" for i in range(n)]
    models = {}
    for zero in STAGES:
        strategy = tfdist.Strategy(data=n, zero=zero, devices=names)
        with strategy.scope():
            models[zero] = digits.build_model(hidden=FLAGS.hidden)
        timed_epoch(models[zero], x, y)  # trace, shard, warm up
    times = {zero: [] for zero in STAGES}
    load_before = os.getloadavg()[0]
    for r in range(FLAGS.rounds):
        for zero in STAGES if r % 2 == 0 else reversed(STAGES):
            times[zero].append(timed_epoch(models[zero], x, y))
    load_after = os.getloadavg()[0]
    records = []
    for zero in STAGES:
        sizes = optimizer_state_bytes(models[zero].optimizer).values()
        ratios = [a / b for a, b in zip(times[zero], times[0])]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        record = {"bench": "zero", "devices": n, "zero": zero,
                  "optimizer_bytes_max": max(sizes), "optimizer_bytes_min": min(sizes),
                  "epoch_median_s": statistics.median(times[zero]),
                  "median_ratio_to_zero0": statistics.median(ratios),
                  "ratio_q1": q1, "ratio_q3": q3,
                  "load_before": load_before, "load_after": load_after,
                  "rounds": FLAGS.rounds, "examples": FLAGS.examples,
                  "batch_size": FLAGS.batch_size, "hidden": FLAGS.hidden}
        emit(record)
        records.append(record)
    return records


def main(argv):
    del argv
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "keras_examples"))
    import digits  # first: it quiets TensorFlow's C++ logs before TensorFlow loads
    import tfdist

    digits.quiet_logs()
    tfdist.use_virtual_devices(max(int(n) for n in FLAGS.devices))
    x, y = digits.load(FLAGS.examples)
    records = []
    for n in FLAGS.devices:
        records += measure(int(n), x, y)
    print("\n| N | zero | optimizer bytes / device (max) | median epoch (s) "
          "| median ratio to zero=0 | quartiles | load (1 min) |"
          "\n|---|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['devices']} | {r['zero']} | {r['optimizer_bytes_max']:,} | "
              f"{r['epoch_median_s']:.3f} | {r['median_ratio_to_zero0']:.3f} | "
              f"{r['ratio_q1']:.3f}-{r['ratio_q3']:.3f} | "
              f"{r['load_before']:.1f}-{r['load_after']:.1f} |")


if __name__ == "__main__":
    app.run(main)
