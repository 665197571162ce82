"""Benchmark: the overhead of tfdist.callbacks.Metrics on training steps/s.

    python tools/bench_profiling.py [--rounds=30] [--out=results.jsonl]

One model under `tfdist.Strategy(data=4)` (the digits MLP, 16,384 examples per
epoch, batch 256: 64 steps per epoch); its epochs alternate between no callback
and `Metrics(every_n_steps=n)`, so only the callback differs. Reports the median
of the per-round ratios of steps/s with / without (goal >= 0.98: overhead < 2%).
Writes one JSON line per result, then a table.
"""

import os
import statistics
import sys
import tempfile
import time

from absl import app, flags

from results import emit

flags.DEFINE_integer("rounds", 30, "Alternating pairs of epochs per setting.")
flags.DEFINE_list("every_n_steps", ["10", "50"],
                  "Metrics write intervals to measure (an epoch is 64 steps).")
flags.DEFINE_string("out", None, "Also append the JSON lines to this file.")
FLAGS = flags.FLAGS
DEVICES, EXAMPLES, BATCH = 4, 16384, 256


def main(argv):
    del argv
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "keras_examples"))
    import digits  # first: it quiets TensorFlow's C++ logs before TensorFlow loads
    # isort: split
    import tfdist

    digits.quiet_logs()
    tfdist.use_virtual_devices(DEVICES)
    strategy = tfdist.Strategy(data=DEVICES)
    with strategy.scope():
        model = digits.build_model()
    x, y = digits.load(EXAMPLES)

    def steps_per_second(callbacks):
        start = time.perf_counter()
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=callbacks)
        return (EXAMPLES // BATCH) / (time.perf_counter() - start)

    steps_per_second([])  # trace and warm up
    rows = []
    with tempfile.TemporaryDirectory() as logdir:
        for n in (int(v) for v in FLAGS.every_n_steps):
            metrics = tfdist.callbacks.Metrics(logdir, every_n_steps=n)
            ratios, plain, metered = [], [], []
            for r in range(FLAGS.rounds):
                if r % 2:
                    with_cb, without = steps_per_second([metrics]), steps_per_second([])
                else:
                    without, with_cb = steps_per_second([]), steps_per_second([metrics])
                plain.append(without)
                metered.append(with_cb)
                ratios.append(with_cb / without)
            record = {"bench": "profiling", "what": "metrics_overhead",
                      "every_n_steps": n, "rounds": FLAGS.rounds,
                      "steps_per_s_without": statistics.median(plain),
                      "steps_per_s_with": statistics.median(metered),
                      "median_ratio": statistics.median(ratios)}
            rows.append(record)
            emit(record, FLAGS.out)
    print("\n| every_n_steps | steps/s without | steps/s with | median ratio |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['every_n_steps']} | {r['steps_per_s_without']:.1f} | "
              f"{r['steps_per_s_with']:.1f} | {r['median_ratio']:.3f} |")


if __name__ == "__main__":
    app.run(main)
