"""Benchmark: pipeline schedules against their ideal step time.

    python tools/bench_pipeline.py [--schedules=gpipe,1f1b,zb1,interleaved,zbv] \
        [--stages=2,4] [--microbatches=4,8,16] [--out=results.jsonl]

Each stage's compute is a fixed delay, so what is measured is the schedule,
not this 2-core machine's arithmetic. The model: `keras.Input`, then for each
stage a small Dense and a `Delay` layer, then a Dense head (MSE, SGD);
`stage_boundaries` puts one Dense + Delay pair in each stage (the head joins
the last). `Delay` multiplies its input by its one weight after sleeping
`--fwd_ms`; its backward sleeps `--bwd_ms` for the gradient of its input (B),
then `--wgrad_ms` for the gradient of its weight (W), which reads B's result,
so a backward that is not split lasts B + W. Zero-bubble schedules ("zb1",
"zbv") run W later, as its own action. With virtual stages ("interleaved",
`--virtual_stages` v; "zbv", v = 2) the model has p x v pairs, each delay
divided by v, so a device has the same work. A sleep (`time.sleep` in a `tf.numpy_function`)
holds one of TensorFlow's inter-op threads, so the pool is raised to
`--inter_op_threads` (its default is one thread per core) for p stages to
sleep at once.

For each schedule, p in `--stages` and m in `--microbatches`: one model under
`tfdist.Strategy(pipeline=p, microbatches=m, schedule=..., devices=p logical
CPUs)`, one `fit` of `--warmup + --steps` steps; a step's time is the wall
time from `on_train_batch_begin` to `on_train_batch_end`, medians over the
last `--steps`. With f, b, w the three delays:

- ideal = m (f + b + w), each device's own work: a step with no bubble;
- efficiency = ideal / measured step time, bubble = step - ideal, and
  bubble_fraction = bubble / step;
- theory: the schedule's step when every unit takes its delay and nothing else
  takes time, played out from the schedule's orders: (m + p - 1)(f + b + w)
  for GPipe and 1F1B, m (f + b + w) + (p - 1)(f + b - w) for ZB-H1,
  m (f + b + w) + (p - 1)(f + b + w) / v for the interleaved 1F1B, and for
  ZB-V m (f + b + w) + (p - 1) f / 2 when f = b = w and m >= p;
- one device = m x p x (f + b + w), every unit one after the other;
  speed-up = one device / measured step time.

For reference (`--reference`, on by default), the same p-block model under
Keras alone on one device (no microbatches): its ideal is p (f + b + w), and
its efficiency is the ceiling that Keras, TensorFlow and this machine leave
for a step of units this long.

Where the rest goes: every sleep's start and end are recorded, and each unit
is matched to its stage, kind and microbatch (a stage runs its forwards, its
backwards and its weight gradients in microbatch order). Per step: whether
every device ran its units in the schedule's order, and the critical path,
walked back from the last unit through the dependency that finished last (the
device's previous unit, and the units whose results it reads:
`tfdist.pipeline.schedule.needs`). Its length in units and the step time split
into: before the first unit, the units' time beyond their delays (the sleeps
overrunning), the gaps between units on the path (the ops between two
sleeps, handing over to the next stage), and after the last unit.

`--stateful_delay` makes the sleep a stateful op (`tf.py_function`), to show
what such ops do to a pipeline (docs/benchmarks.md).

Writes one JSON line per (schedule, p, m) and per reference, then a table.
"""

import collections
import os
import statistics
import sys
import threading
import time

from absl import app, flags

from results import emit

flags.DEFINE_list("schedules", ["gpipe", "1f1b", "zb1", "interleaved", "zbv"],
                  "Schedules to measure.")
flags.DEFINE_list("stages", ["2", "4"], "Pipeline stages p to measure.")
flags.DEFINE_list("microbatches", ["4", "8", "16"], "Microbatches m to measure.")
flags.DEFINE_integer("virtual_stages", 2, "Stages per device of the interleaved schedule "
                     "(zbv always has 2).")
flags.DEFINE_float("fwd_ms", 20.0, "Delay of a stage's forward of one microbatch.")
flags.DEFINE_float("bwd_ms", 20.0, "Delay of a stage's input gradient of one microbatch.")
flags.DEFINE_float("wgrad_ms", 20.0, "Delay of a stage's weight gradient of one microbatch.")
flags.DEFINE_integer("steps", 10, "Timed steps per configuration.")
flags.DEFINE_integer("warmup", 2, "Untimed steps first (the first one traces).")
flags.DEFINE_integer("batch_size", 32, "Global batch size (every m must divide it).")
flags.DEFINE_integer("width", 8, "Width of the Dense layers.")
flags.DEFINE_integer("inter_op_threads", 24, "TensorFlow's inter-op thread pool size.")
flags.DEFINE_boolean("reference", True, "Also time the model under Keras alone, one device.")
flags.DEFINE_boolean("stateful_delay", False, "Sleep in a stateful op (tf.py_function).")
flags.DEFINE_string("out", None, "Also append the JSON lines to this file.")
FLAGS = flags.FLAGS
SLEEPS = []  # (stage, "F", "B" or "W", start, end) of every sleep, perf_counter seconds
# One lock per device: a device runs one unit at a time, as an accelerator's
# compute stream does (TensorFlow would otherwise overlap independent units
# of one device, such as a stage's W with the B of the stage before it when
# Keras alone runs every stage on one device).
DEVICES = collections.defaultdict(threading.Lock)


def sleep_op(value, stage, kind, seconds, device):
    """`value`, after sleeping `seconds` with `device` to itself (recorded in SLEEPS)."""
    import tensorflow as tf

    def run(array):
        with DEVICES[device]:
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


def delays(v=1):
    """{kind: seconds} of one stage's units, with v stages per device."""
    return {"F": FLAGS.fwd_ms / 1000 / v, "B": FLAGS.bwd_ms / 1000 / v,
            "W": FLAGS.wgrad_ms / 1000 / v}


def build_model(stages, v=1, devices=1, schedule="gpipe"):
    """The model of `stages` Dense + Delay pairs, each stage's sleeps taking
    turns with the others on its device (`stage_device`)."""
    import keras
    import tensorflow as tf

    from tfdist.pipeline.schedule import stage_device

    class Delay(keras.layers.Layer):
        """`x * scale`, whose forward sleeps F; its backward sleeps B for the
        input's gradient, then W for the weight's (after B's result)."""

        def __init__(self, stage, seconds, device, **kwargs):
            super().__init__(**kwargs)
            self.stage, self.seconds, self.device = stage, seconds, device

        def build(self, input_shape):
            self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

        def call(self, x):
            @tf.custom_gradient
            def delayed(x, scale):
                def grad(dy):
                    dx = self.sleep(dy * scale, "B")
                    with tf.control_dependencies([dx]):  # W after B, as in one backward
                        dw = tf.reduce_sum(dy * x)
                    return dx, self.sleep(dw, "W")
                return self.sleep(x * scale, "F"), grad
            return delayed(x, tf.convert_to_tensor(self.scale))

        def sleep(self, value, kind):
            return sleep_op(value, self.stage, kind, self.seconds[kind], self.device)

        def compute_output_shape(self, input_shape):
            return input_shape

    keras.utils.set_random_seed(0)
    layers = [keras.Input((FLAGS.width,))]
    for s in range(stages):
        layers += [keras.layers.Dense(FLAGS.width, name=f"dense{s}"),
                   Delay(s, delays(v), stage_device(schedule, s, devices),
                         name=f"delay{s}")]
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


def breakdown(sleeps, begin, end, orders):
    """One step's sleeps against the schedule's `orders`: (in order?,
    critical path in units, {part: seconds}) with the parts summing to the
    step time. A backward not split from its W spans both sleeps."""
    from tfdist.pipeline.schedule import needs

    p = len(orders)
    stages = 1 + max(a.stage for order in orders for a in order)
    split = any(a.kind == "W" for order in orders for a in order)
    spans = {}
    for s in range(stages):
        mine = sorted((start, end_, kind) for stage, kind, start, end_ in sleeps if stage == s)
        for kind in "FBW":
            for i, (start, end_, _) in enumerate(u for u in mine if u[2] == kind):
                spans[s, kind, i] = (start, end_)
    units = {}
    for order in orders:
        for a in order:
            start, end_ = spans[a.stage, a.kind, a.microbatch]
            if a.kind == "B" and not split:
                end_ = spans[a.stage, "W", a.microbatch][1]
            units[a] = (start, end_)
    in_order = all(sorted(order, key=lambda a: units[a][0]) == order for order in orders)
    position = {a: (d, n) for d, order in enumerate(orders) for n, a in enumerate(order)}

    def deps(action):
        """The device's previous action, and the actions whose results it reads."""
        d, n = position[action]
        return ([orders[d][n - 1]] if n else []) + needs(action, stages)

    unit = max(units, key=lambda u: units[u][1])
    path = [unit]
    while deps(unit):
        unit = max(deps(unit), key=lambda u: units[u][1])
        path.append(unit)
    path.reverse()
    delay = delays(stages // p)
    if not split:
        delay["B"] += delay["W"]
    parts = {"before_first_unit": units[path[0]][0] - begin,
             "delays": sum(delay[u.kind] for u in path),
             "sleep_overrun": sum(units[u][1] - units[u][0] - delay[u.kind] for u in path),
             "gaps_between_units": sum(units[b][0] - units[a][1]
                                       for a, b in zip(path, path[1:])),
             "after_last_unit": end - units[path[-1]][1]}
    return in_order, len(path), parts


def theory(orders, v):
    """The step in seconds of the devices' `orders` when every unit takes
    exactly its delay (a backward not split from its W both) and nothing else
    takes time: each device runs its units in order, each as soon as the
    device is free and the units it reads are done."""
    from tfdist.pipeline.schedule import needs

    stages = 1 + max(a.stage for order in orders for a in order)
    split = any(a.kind == "W" for order in orders for a in order)
    delay = delays(v)
    if not split:
        delay["B"] += delay["W"]
    done, position, free = {}, [0] * len(orders), [0.0] * len(orders)
    while len(done) < sum(map(len, orders)):
        for d, order in enumerate(orders):
            while position[d] < len(order) and all(
                    n in done for n in needs(order[position[d]], stages)):
                action = order[position[d]]
                start = max([free[d]] + [done[n] for n in needs(action, stages)])
                done[action] = free[d] = start + delay[action.kind]
                position[d] += 1
    return max(done.values())


def measure(schedule, p, m):
    """Times `fit` of the p-stage model; schedule "keras": Keras alone, one device."""
    import numpy as np
    import tensorflow as tf

    import tfdist
    from tfdist.pipeline.schedule import VIRTUAL, stage_orders

    v = 1 if schedule not in VIRTUAL else VIRTUAL[schedule] or FLAGS.virtual_stages
    if schedule == "keras":
        strategy, devices = tf.distribute.get_strategy(), 1
        orders = stage_orders("gpipe", p, 1)
    else:
        strategy, devices = tfdist.Strategy(
            pipeline=p, microbatches=m, schedule=schedule, virtual_stages=v,
            stage_boundaries=[f"dense{s}" for s in range(1, p * v)],
            devices=[f"/cpu:{i}" for i in range(p)]), p
        orders = stage_orders(schedule, p, m, v)
    with strategy.scope():
        model = build_model(p * v, v, devices, schedule)
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
    analyses = [breakdown([u for u in SLEEPS if begin <= u[2] <= end], begin, end, orders)
                for begin, end in timed]
    step = statistics.median(seconds)
    unit = sum(delays().values())
    ideal = (p if schedule == "keras" else m) * unit
    ms = {part: round(1000 * statistics.median(a[2][part] for a in analyses), 2)
          for part in analyses[0][2]}
    record = {"bench": "pipeline", "schedule": schedule, "p": p, "m": m,
              "virtual_stages": v, "devices": devices,
              "fwd_ms": FLAGS.fwd_ms, "bwd_ms": FLAGS.bwd_ms, "wgrad_ms": FLAGS.wgrad_ms,
              "step_seconds": round(step, 4), "step_min_seconds": round(min(seconds), 4),
              "ideal_seconds": round(ideal, 4), "efficiency": round(ideal / step, 3),
              "bubble_seconds": round(step - ideal, 4),
              "bubble_fraction": round((step - ideal) / step, 3),
              "theory_seconds": round(theory(orders, v), 4),
              "one_device_seconds": round(m * p * unit, 4),
              "speedup": round(m * p * unit / step, 3),
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
    print("\n| schedule | p | m | step (s) | theory (s) | ideal (s) | efficiency | bubble (s) "
          "| bubble / 1F1B's | speed-up | in order | path (units) "
          "| before / overrun / gaps / after (ms) |"
          "\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    one_f_one_b = {(r["p"], r["m"]): r["bubble_seconds"] for r in records
                   if r["schedule"] == "1f1b"}
    for r in records:
        b = r["breakdown_median_ms"]
        name = {"keras": "Keras alone, 1 device",
                "interleaved": f"interleaved, v={r['virtual_stages']}",
                "zbv": "zbv (V, v=2)"}.get(
                    r["schedule"], r["schedule"])
        base = one_f_one_b.get((r["p"], r["m"]))
        ratio = f"{r['bubble_seconds'] / base:.2f}" if base and r["schedule"] != "keras" else "-"
        print(f"| {name} | {r['p']} | {r['m']} | {r['step_seconds']:.3f} | "
              f"{r['theory_seconds']:.3f} | {r['ideal_seconds']:.3f} | {r['efficiency']:.3f} | "
              f"{r['bubble_seconds']:.3f} | {ratio} | {r['speedup']:.2f} | "
              f"{'yes' if r['in_schedule_order'] else 'NO'} | "
              f"{'/'.join(str(n) for n in r['critical_path_units'])} | "
              f"{b['before_first_unit']:.1f} / {b['sleep_overrun']:.1f} / "
              f"{b['gaps_between_units']:.1f} / {b['after_last_unit']:.1f} |")


if __name__ == "__main__":
    app.run(main)
