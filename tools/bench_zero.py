"""Benchmark: ZeRO (zero=1, 2, 3) against zero=0.

    python tools/bench_zero.py [--rounds=30] [--out=results.jsonl]
    python tools/bench_zero.py --devices=4 --microbatches=1,2,4 --zero_levels=0,3
    python tools/bench_zero.py --rss_gib=1 [--out=results.jsonl]

For N in {2, 4, 8} logical CPU devices (and each `--microbatches` k, 1 by
default), four models of the same digits MLP (Adam) are trained under
`tfdist.Strategy(data=N, zero=z, microbatches=k)` for z = 0, 1, 2, 3
(`--zero_levels`). zero=3 gathers every unit's parameters twice per
microbatch: the ratios over k show what that costs against zero=0, whose
traffic does not grow with k.

- optimizer-state and parameter bytes per device (largest and smallest over
  the N devices, summed over every physical component of every variable);
- epoch time, the four models timed in alternation in one process, the order
  reversed every round (0, 1, 2, 3 then 3, 2, 1, 0: each of zero=1, 2, 3 runs
  as often just before zero=0 as just after). A shared machine is noisy: only
  ratios measured side by side mean anything. Reported: the median of the
  per-round ratios zero=z / zero=0 and their quartiles (the spread of the
  noise), and the load average before and after;
- the same for the process's CPU time per epoch (user + system, all threads):
  the work done, which other processes on the machine disturb far less than
  the wall time (on an idle machine with as many cores as devices, wall time
  is what counts).

Writes one JSON line per result (stdout, and `--out` if given), then a table.

With `--rss_gib=G` it measures memory instead: an MLP of 8 square Dense layers
whose float32 parameters total about G GiB, trained with Adam for a few steps
at N = 4 with zero=2 and with zero=3, each in a process of its own; reported:
each process's peak resident set size, and its parameter and optimizer bytes
per device.
"""

import os
import statistics
import sys
import time

from absl import app, flags

from results import emit

flags.DEFINE_integer("rounds", 30, "Alternating timed epochs per model.")
flags.DEFINE_integer("examples", 4096, "Examples per epoch.")
flags.DEFINE_integer("batch_size", 512, "Global batch size.")
flags.DEFINE_integer("hidden", 512, "Hidden width of the MLP.")
flags.DEFINE_list("devices", ["2", "4", "8"], "Values of N to measure.")
flags.DEFINE_list("microbatches", ["1"], "Microbatches per step to measure.")
flags.DEFINE_list("zero_levels", ["0", "1", "2", "3"], "zero levels timed (0 first: the "
                  "ratios are to it).")
flags.DEFINE_string("out", None, "Also append the JSON lines to this file.")
flags.DEFINE_float("rss_gib", None, "Measure peak RSS of a model of this many GiB of "
                   "float32 parameters at N=4, zero=2 against zero=3.")
flags.DEFINE_integer("rss_zero", None, "(Internal) the zero level of one --rss_gib process.")
FLAGS = flags.FLAGS
RSS_DEVICES, RSS_LAYERS, RSS_STEPS = 4, 8, 3


def timed_epoch(model, x, y):
    """(wall seconds, CPU seconds of this process) of one epoch."""
    wall, cpu = time.perf_counter(), time.process_time()
    model.fit(x, y, batch_size=FLAGS.batch_size, epochs=1, shuffle=False, verbose=0)
    return time.perf_counter() - wall, time.process_time() - cpu


def summary(times, reference):
    """Median and quartiles of the per-round ratios `times` / `reference`."""
    ratios = [a / b for a, b in zip(times, reference)]
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    return {"median": median, "q1": q1, "q3": q3}


def measure(n, k, x, y):
    import digits
    import tfdist
    from tfdist.callbacks.metrics import optimizer_state_bytes, variable_bytes

    names = [f"/cpu:{i}" for i in range(n)]
    models = {}
    levels = [int(z) for z in FLAGS.zero_levels]
    for zero in levels:
        strategy = tfdist.Strategy(data=n, zero=zero, microbatches=k, devices=names)
        with strategy.scope():
            models[zero] = digits.build_model(hidden=FLAGS.hidden)
        timed_epoch(models[zero], x, y)  # trace, shard, warm up
    wall = {zero: [] for zero in levels}
    cpu = {zero: [] for zero in levels}
    load_before = os.getloadavg()[0]
    for r in range(FLAGS.rounds):
        for zero in levels if r % 2 == 0 else reversed(levels):
            seconds, cpu_seconds = timed_epoch(models[zero], x, y)
            wall[zero].append(seconds)
            cpu[zero].append(cpu_seconds)
    load_after = os.getloadavg()[0]
    records = []
    for zero in levels:
        sizes = optimizer_state_bytes(models[zero].optimizer).values()
        params = variable_bytes(models[zero].trainable_weights).values()
        record = {"bench": "zero", "devices": n, "microbatches": k, "zero": zero,
                  "optimizer_bytes_max": max(sizes), "optimizer_bytes_min": min(sizes),
                  "parameter_bytes_max": max(params), "parameter_bytes_min": min(params),
                  "epoch_median_s": statistics.median(wall[zero]),
                  "epoch_cpu_median_s": statistics.median(cpu[zero]),
                  "wall_ratio": summary(wall[zero], wall[0]),
                  "cpu_ratio": summary(cpu[zero], cpu[0]),
                  "load_before": load_before, "load_after": load_after,
                  "rounds": FLAGS.rounds, "examples": FLAGS.examples,
                  "batch_size": FLAGS.batch_size, "hidden": FLAGS.hidden}
        emit(record, FLAGS.out)
        records.append(record)
    return records


def peak_rss(zero):
    """Trains the --rss_gib MLP for a few steps under zero=`zero`; emits its
    peak resident set size and per-device bytes (run in a process of its own)."""
    import resource

    import keras
    import numpy as np

    import tfdist
    from tfdist.callbacks.metrics import optimizer_state_bytes, variable_bytes

    tfdist.use_virtual_devices(RSS_DEVICES)
    width = int((FLAGS.rss_gib * 2**30 / 4 / RSS_LAYERS) ** 0.5)
    strategy = tfdist.Strategy(data=RSS_DEVICES, zero=zero)
    with strategy.scope():
        model = keras.Sequential([keras.Input((width,))] + [
            keras.layers.Dense(width, activation="relu" if i < RSS_LAYERS - 1 else None,
                               use_bias=False) for i in range(RSS_LAYERS)])
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    batch = 2 * RSS_DEVICES
    x = np.random.default_rng(0).normal(size=(batch * RSS_STEPS, width)).astype("float32")
    model.fit(x, x, batch_size=batch, epochs=1, verbose=0)
    record = {"bench": "zero_rss", "devices": RSS_DEVICES, "zero": zero,
              "parameter_gib": model.count_params() * 4 / 2**30, "width": width,
              "layers": RSS_LAYERS, "steps": RSS_STEPS,
              "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
              "parameter_bytes_max": max(variable_bytes(model.trainable_weights).values()),
              "optimizer_bytes_max": max(optimizer_state_bytes(model.optimizer).values())}
    emit(record, FLAGS.out)


def rss_table():
    """Runs `peak_rss` for zero=2 and zero=3, each in a new process; prints a table."""
    import json
    import subprocess

    rows = []
    for zero in (2, 3):
        done = subprocess.run(
            [sys.executable, __file__, f"--rss_gib={FLAGS.rss_gib}", f"--rss_zero={zero}"]
            + ([f"--out={FLAGS.out}"] if FLAGS.out else []),
            capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(done.stdout.strip().splitlines()[-1], flush=True)
    print("\n| N | zero | parameters (GiB) | parameter bytes / device | optimizer bytes / "
          "device | peak RSS (GiB) |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['devices']} | {r['zero']} | {r['parameter_gib']:.2f} | "
              f"{r['parameter_bytes_max']:,} | {r['optimizer_bytes_max']:,} | "
              f"{r['peak_rss_gib']:.2f} |")


def main(argv):
    del argv
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "keras_examples"))
    import digits  # first: it quiets TensorFlow's C++ logs before TensorFlow loads
    # isort: split
    import tfdist

    digits.quiet_logs()
    if FLAGS.rss_zero is not None:
        return peak_rss(FLAGS.rss_zero)
    if FLAGS.rss_gib is not None:
        return rss_table()
    tfdist.use_virtual_devices(max(int(n) for n in FLAGS.devices))
    x, y = digits.load(FLAGS.examples)
    records = []
    for n in FLAGS.devices:
        for k in FLAGS.microbatches:
            records += measure(int(n), int(k), x, y)
    print("\n| N | microbatches | zero | optimizer bytes / device (max) | "
          "parameter bytes / device (max) | "
          "wall epoch (s) | wall ratio (quartiles) | CPU epoch (s) | CPU ratio (quartiles) | "
          "load (1 min) |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in records:
        wall, cpu = r["wall_ratio"], r["cpu_ratio"]
        print(f"| {r['devices']} | {r['microbatches']} | {r['zero']} | "
              f"{r['optimizer_bytes_max']:,} | "
              f"{r['parameter_bytes_max']:,} | {r['epoch_median_s']:.3f} | "
              f"{wall['median']:.3f} ({wall['q1']:.2f}-{wall['q3']:.2f}) | "
              f"{r['epoch_cpu_median_s']:.3f} | "
              f"{cpu['median']:.3f} ({cpu['q1']:.2f}-{cpu['q3']:.2f}) | "
              f"{r['load_before']:.1f}-{r['load_after']:.1f} |")


if __name__ == "__main__":
    app.run(main)
