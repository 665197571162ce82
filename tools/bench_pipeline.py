"""Benchmark: pipeline schedules against their ideal step time.

    python tools/bench_pipeline.py [--stages=2,4] [--microbatches=1,4,8,16] [--out=results.jsonl]

Each stage's compute is a fixed delay, so what is measured is the schedule,
not this 2-core machine's arithmetic. The model: `keras.Input`, then for each
of p stages a small Dense and a `Delay` layer, then a Dense head (MSE, SGD);
`stage_boundaries` puts one Dense + Delay pair in each stage (the head joins
the last). `Delay` passes its input through after sleeping `--fwd_ms`, and its
gradient passes the output's gradient through after sleeping `--bwd_ms`
(`time.sleep` in a `tf.numpy_function`; what follows depends on its output, so
the sleep is on the path). A unit of the schedule (one stage's forward or
backward of one microbatch) lasts that long; the rest of it is small next to
it. A sleep holds one of TensorFlow's inter-op threads, so the pool is raised to
`--inter_op_threads` (its default is one thread per core) for p stages to
sleep at once.

For each schedule ("gpipe", "1f1b"), p in `--stages` and m in
`--microbatches`: one model under `tfdist.Strategy(pipeline=p,
microbatches=m, schedule=..., devices=p logical CPUs)`, one `fit` of
`--warmup + --steps` steps; a step's time is the wall time from
`on_train_batch_begin` to `on_train_batch_end`, medians over the last `--steps`.

- ideal = (m + p - 1) x (fwd + bwd): either schedule's length when every unit
  takes its delay and nothing else takes time;
- efficiency = ideal / measured step time (goal >= 0.95);
- one device = m x p x (fwd + bwd), every unit one after the other;
  speed-up = one device / measured step time.

For reference (`--reference`, on by default), the same p-block model under
Keras alone on one device (no microbatches): its ideal is p x (fwd + bwd), and
its efficiency is the ceiling that Keras, TensorFlow and this machine leave
for a step of units this long.

Where the rest goes: every sleep's start and end are recorded, and each unit
is matched to its stage, kind and microbatch (a stage runs its forwards, and
its backwards, in microbatch order). Per step: whether every stage ran its
units in the schedule's order, and the critical path, walked back from the last
unit through the dependency that finished last (the stage's previous unit;
for a forward the previous stage's forward, for a backward the next stage's
backward and its own forward). Its length in units (2(m + p - 1) when the
schedule adds no bubble) and the step time split into: before the first unit,
the units' time beyond their delays (the sleeps overrunning), the gaps between
units on the path (the ops between two sleeps, handing over to the next stage),
and after the last unit.

`--stateful_delay` makes the sleep a stateful op (`tf.py_function`), to show
what such ops do to a pipeline (docs/benchmarks.md).

Writes one JSON line per (schedule, p, m) and per reference, then a table.
"""

import os
import statistics
import sys
import time

from absl import app, flags

from results import emit

flags.DEFINE_list("schedules", ["gpipe", "1f1b"], "Schedules to measure.")
flags.DEFINE_list("stages", ["2", "4"], "Pipeline stages p to measure.")
flags.DEFINE_list("microbatches", ["1", "4", "8", "16"], "Microbatches m to measure.")
flags.DEFINE_float("fwd_ms", 30.0, "Delay of a stage's forward of one microbatch.")
flags.DEFINE_float("bwd_ms", 30.0, "Delay of a stage's backward of one microbatch.")
flags.DEFINE_integer("steps", 10, "Timed steps per configuration.")
flags.DEFINE_integer("warmup", 2, "Untimed steps first (the first one traces).")
flags.DEFINE_integer("batch_size", 32, "Global batch size (every m must divide it).")
flags.DEFINE_integer("width", 8, "Width of the Dense layers.")
flags.DEFINE_integer("inter_op_threads", 16, "TensorFlow's inter-op thread pool size.")
flags.DEFINE_boolean("reference", True, "Also time the model under Keras alone, one device.")
flags.DEFINE_boolean("stateful_delay", False, "Sleep in a stateful op (tf.py_function).")
flags.DEFINE_string("out", None, "Also append the JSON lines to this file.")
FLAGS = flags.FLAGS
SLEEPS = []  # (stage, "F" or "B", start, end) of every sleep, perf_counter seconds


def sleep_op(value, stage, kind, seconds):
    """`value`, after sleeping `seconds` (recorded in SLEEPS)."""
    import tensorflow as tf

    def run(array):
        start = time.perf_counter()
        time.sleep(seconds)
        SLEEPS.append((stage, kind, start, time.perf_counter()))
        return array

    if FLAGS.stateful_delay:
        out = tf.py_function(run, [value], value.dtype)
    else:
        out = tf.numpy_function(run, [value], value.dtype, stateful=False)
    out.set_shape(value.shape)
    return out


def build_model(p):
    import keras
    import tensorflow as tf

    class Delay(keras.layers.Layer):
        """Identity whose forward sleeps `fwd` seconds and whose gradient `bwd`."""

        def __init__(self, stage, fwd, bwd, **kwargs):
            super().__init__(**kwargs)
            self.stage, self.fwd, self.bwd = stage, fwd, bwd

        def call(self, x):
            @tf.custom_gradient
            def delayed(x):
                def grad(dy):
                    return sleep_op(dy, self.stage, "B", self.bwd)
                return sleep_op(x, self.stage, "F", self.fwd), grad
            return delayed(x)

        def compute_output_shape(self, input_shape):
            return input_shape

    keras.utils.set_random_seed(0)
    layers = [keras.Input((FLAGS.width,))]
    for s in range(p):
        layers += [keras.layers.Dense(FLAGS.width, name=f"dense{s}"),
                   Delay(s, FLAGS.fwd_ms / 1000, FLAGS.bwd_ms / 1000, name=f"delay{s}")]
    model = keras.Sequential(layers + [keras.layers.Dense(1, name="head")])
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    return model


def step_timer():
    """A Keras callback recording (begin, end) of every training step."""
    import keras

    class StepTimes(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.steps = []

        def on_train_batch_begin(self, batch, logs=None):
            self.begin = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.steps.append((self.begin, time.perf_counter()))

    return StepTimes()


def breakdown(sleeps, begin, end, schedule, p, m):
    """One step's sleeps against the schedule: (in order?, critical path in units,
    {part: seconds}) with the parts summing to the step time."""
    from tfdist.pipeline.schedule import Action, needs, stage_orders

    orders = stage_orders(schedule, p, m)
    units, ran = {}, {s: [] for s in range(p)}
    for s in range(p):
        mine = sorted((start, end_, kind) for stage, kind, start, end_ in sleeps if stage == s)
        ran[s] = [kind for _, _, kind in mine]
        for kind in "FB":
            for i, (start, end_, _) in enumerate(u for u in mine if u[2] == kind):
                units[Action(s, kind, i)] = (start, end_)
    in_order = all(ran[s] == [action.kind for action in orders[s]] for s in range(p))

    def deps(action):
        """The stage's previous action, and the actions whose results it reads."""
        position = orders[action.stage].index(action)
        previous = [orders[action.stage][position - 1]] if position else []
        return previous + needs(action, p)

    unit = max(units, key=lambda u: units[u][1])
    path = [unit]
    while deps(unit):
        unit = max(deps(unit), key=lambda u: units[u][1])
        path.append(unit)
    path.reverse()
    delay = {"F": FLAGS.fwd_ms / 1000, "B": FLAGS.bwd_ms / 1000}
    parts = {"before_first_unit": units[path[0]][0] - begin,
             "delays": sum(delay[u.kind] for u in path),
             "sleep_overrun": sum(units[u][1] - units[u][0] - delay[u.kind] for u in path),
             "gaps_between_units": sum(units[b][0] - units[a][1]
                                       for a, b in zip(path, path[1:])),
             "after_last_unit": end - units[path[-1]][1]}
    return in_order, len(path), parts


def measure(schedule, p, m):
    """Times `fit` of the p-stage model; schedule "keras": Keras alone, one device."""
    import numpy as np
    import tensorflow as tf

    import tfdist

    if schedule == "keras":
        strategy, devices = tf.distribute.get_strategy(), 1
    else:
        strategy, devices = tfdist.Strategy(
            pipeline=p, microbatches=m, schedule=schedule,
            stage_boundaries=[f"dense{s}" for s in range(1, p)],
            devices=[f"/cpu:{i}" for i in range(p)]), p
    with strategy.scope():
        model = build_model(p)
    n = FLAGS.batch_size * (FLAGS.warmup + FLAGS.steps)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, FLAGS.width)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    timer = step_timer()
    SLEEPS.clear()
    model.fit(x, y, batch_size=FLAGS.batch_size, epochs=1, shuffle=False, verbose=0,
              callbacks=[timer])
    timed = timer.steps[FLAGS.warmup:]
    seconds = [end - begin for begin, end in timed]
    analyses = [breakdown([u for u in SLEEPS if begin <= u[2] <= end], begin, end,
                          "gpipe" if schedule == "keras" else schedule, p, m)
                for begin, end in timed]
    step = statistics.median(seconds)
    unit = (FLAGS.fwd_ms + FLAGS.bwd_ms) / 1000
    ideal, one_device = (m + p - 1) * unit, m * p * unit
    ms = {part: round(1000 * statistics.median(a[2][part] for a in analyses), 2)
          for part in analyses[0][2]}
    record = {"bench": "pipeline", "schedule": schedule, "stages": p, "devices": devices,
              "microbatches": m,
              "fwd_ms": FLAGS.fwd_ms, "bwd_ms": FLAGS.bwd_ms,
              "step_median_s": round(step, 4), "step_min_s": round(min(seconds), 4),
              "ideal_s": round(ideal, 4), "efficiency": round(ideal / step, 3),
              "one_device_s": round(one_device, 4), "speedup": round(one_device / step, 3),
              "in_schedule_order": all(a[0] for a in analyses),
              "critical_path_units": sorted({a[1] for a in analyses}),
              "breakdown_median_ms": ms,
              "steps": FLAGS.steps, "batch_size": FLAGS.batch_size,
              "inter_op_threads": FLAGS.inter_op_threads,
              "stateful_delay": FLAGS.stateful_delay}
    emit(record, FLAGS.out)
    return record


def main(argv):
    del argv
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "keras_examples"))
    import digits  # first: it quiets TensorFlow's C++ logs before TensorFlow loads
    # isort: split
    import tensorflow as tf

    import tfdist

    digits.quiet_logs()
    stages = [int(p) for p in FLAGS.stages]
    tf.config.threading.set_inter_op_parallelism_threads(FLAGS.inter_op_threads)
    tfdist.use_virtual_devices(max(stages))
    records = [measure("keras", p, 1) for p in stages if FLAGS.reference]
    records += [measure(schedule, p, int(m)) for schedule in FLAGS.schedules
                for p in stages for m in FLAGS.microbatches]
    print("\n| schedule | p | m | step (s) | ideal (s) | efficiency | one device (s) "
          "| speed-up | in order | path (units) | before / overrun / gaps / after (ms) |"
          "\n|---|---|---|---|---|---|---|---|---|---|---|")
    for r in records:
        b = r["breakdown_median_ms"]
        name = "Keras alone, 1 device" if r["schedule"] == "keras" else r["schedule"]
        print(f"| {name} | {r['stages']} | {r['microbatches']} | "
              f"{r['step_median_s']:.3f} | {r['ideal_s']:.3f} | {r['efficiency']:.3f} | "
              f"{r['one_device_s']:.3f} | {r['speedup']:.2f} | "
              f"{'yes' if r['in_schedule_order'] else 'NO'} | "
              f"{'/'.join(str(n) for n in r['critical_path_units'])} | "
              f"{b['before_first_unit']:.1f} / {b['sleep_overrun']:.1f} / "
              f"{b['gaps_between_units']:.1f} / {b['after_last_unit']:.1f} |")


if __name__ == "__main__":
    app.run(main)
